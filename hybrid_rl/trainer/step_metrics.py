"""What one RL step reports beside the losses: the switch's phases, throughput and FLOPs, and the
reduction of every metric over ranks. A component of the loop, kept apart from it."""

from __future__ import annotations

import logging
from typing import Any

import torch

from hybrid_rl.batch import Rollout, TrainBatch
from hybrid_rl.dist import all_reduce_max_list, all_reduce_sum, mean_over_ranks
from hybrid_rl.engine.flops import DecoderFlops
from hybrid_rl.hybrid.switch import SwitchReport
from hybrid_rl.timing import PhaseTimer

log = logging.getLogger("hybrid_rl")


def model_flops(engine: Any) -> DecoderFlops | None:
    """The FLOP counter for the engine's HF causal LM (None where it has none, e.g. a fake)."""
    config = getattr(getattr(getattr(engine, "module", None), "lm", None), "config", None)
    return DecoderFlops.from_hf_config(config) if config is not None else None


def switch_metrics(report: SwitchReport) -> dict[str, float]:
    m = {f"switch/{report.direction}/{k}_s": v for k, v in report.seconds.items()}
    m[f"switch/{report.direction}_s"] = report.total_seconds
    last = list(report.memory.values())[-1] if report.memory else {}
    for k, v in last.items():
        m[f"memory/after_{report.direction}/{k}"] = v
    m[f"switch/{report.direction}/freed"] = float(report.freed)
    for k, v in report.moved_bytes.items():
        m[f"switch/{report.direction}/moved_mib/{k}"] = v / 2**20
    return m


class NotesOnce:
    """Says each distinct note of a mode switch once, on rank 0: a setting that does nothing on
    this hardware (``rollout.sleep_level`` where the engine has no sleep mode, ``offload_optimizer``
    on the CPU) is worth one line where the user looks, not one per step and not none."""

    def __init__(self, is_main: bool) -> None:
        self.is_main, self.seen = is_main, set()

    def __call__(self, report: SwitchReport) -> SwitchReport:
        for note in report.notes:
            if note not in self.seen:
                self.seen.add(note)
                if self.is_main:
                    log.info("switch %s: %s", report.direction, note)
        return report


def reduce_metrics(m: dict[str, float]) -> dict[str, float]:
    """Mean over ranks, except token counts (summed), throughput (already global), memory peaks
    and ``*/max`` (the largest rank's: the one that meets the limit first) and ``*/min`` (the smallest).
    A reward function's extras (``reward/<key>``) arrive as the same global mean on every rank
    (:func:`~hybrid_rl.trainer.collect.extra_metrics`), which the mean, max and min keep; they
    are never summed, whatever their name (``reward/answer_tokens`` is a mean, not a count)."""
    summed = {
        k for k in m if (k.endswith("_tokens") and not k.startswith("reward/")) or k in ("reward/failed", "reward/timeouts")
    }
    globals_ = {k for k in m if k.endswith(("tokens_per_s", "tflops_per_s")) or k.startswith("dapo/")}
    rest = [k for k in m if k not in summed and k not in globals_]
    peaks = sorted(k for k in rest if "peak_" in k or k.endswith("/max"))
    lows = sorted(k for k in rest if k.endswith("/min"))
    sums = dict(zip(sorted(summed), all_reduce_sum([m[k] for k in sorted(summed)]), strict=True))
    # one collective for both: min(x) = -max(-x)
    extremes = all_reduce_max_list([m[k] for k in peaks] + [-m[k] for k in lows])
    maxes = dict(zip(peaks, extremes[: len(peaks)], strict=True))
    mins = {k: -v for k, v in zip(lows, extremes[len(peaks) :], strict=True)}
    means = mean_over_ranks({k: v for k, v in m.items() if k in rest and k not in maxes and k not in mins})
    return {**means, **sums, **maxes, **mins, **{k: m[k] for k in globals_}}


def length_metrics(samples: list[Any], max_prompt_length: int = 0) -> dict[str, float]:
    """verl's length figures over ``samples``: model-written response tokens (tool output
    excluded; clip_ratio: cut at the budget) and prompts (clip_ratio: at data.max_prompt_length)."""
    lengths = torch.tensor([sum(s.response_mask) for s in samples], dtype=torch.float32)
    prompts = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.float32)
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "prompt_length/mean": float(prompts.mean()),
        "prompt_length/max": float(prompts.max()),
        "prompt_length/min": float(prompts.min()),
        "prompt_length/clip_ratio": float((prompts >= max_prompt_length).float().mean()) if max_prompt_length else 0.0,
    }


class Throughput:
    """Tokens and model FLOPs per second of generation and of the update, for one step."""

    def __init__(self, actor: Any, epochs: int, max_prompt_length: int = 0) -> None:
        self.actor, self.epochs, self.max_prompt_length = actor, epochs, max_prompt_length
        self.flops = model_flops(actor)

    def __call__(self, rollout: Rollout, batch: TrainBatch, timer: PhaseTimer) -> dict[str, float]:
        # Model-written tokens (tool output excluded); clip_ratio: responses cut at the budget.
        lengths = torch.tensor([sum(s.response_mask) for s in rollout.samples], dtype=torch.float32)
        local = [float(lengths.sum()), float(batch.attention_mask.sum()) * self.epochs, *self.flop_counts(rollout)]
        gen_tokens, train_tokens, update_flops, gen_flops = all_reduce_sum(local)  # one collective for all four

        def per_s(amount: float, phase: str) -> float:
            return amount / max(timer.seconds.get(phase, 1e-9), 1e-9)

        m = {
            **length_metrics(rollout.samples, self.max_prompt_length),
            "rollout/tokens_per_s": per_s(gen_tokens, "generate"),
            "train/tokens_per_s": per_s(train_tokens, "update"),
        }
        if self.flops is not None:
            m["perf/update_tflops_per_s"] = per_s(update_flops, "update") / 1e12
            m["perf/generate_tflops_per_s"] = per_s(gen_flops, "generate") / 1e12
        return m

    def flop_counts(self, rollout: Rollout) -> list[float]:
        """This rank's model FLOPs of the policy update (forward + backward, all epochs; with the
        shared-prefix forward each group's prompt counts once, as it is computed once) and of
        generation (:mod:`hybrid_rl.engine.flops`); over the phases' times they are the achieved
        FLOP/s, whose ratio to the hardware's peak is MFU (benchmarks/precision.py measures both)."""
        if self.flops is None:
            return [0.0, 0.0]
        s = rollout.samples
        prompt = [len(x.prompt_ids) for x in s]
        response = [len(x.response_ids) for x in s]
        groups = [x.group for x in s]
        shared = getattr(self.actor.module, "shared_prefix", False)
        train = self.flops.train_shared_prefix(prompt, response, groups) if shared else self.flops.train([x.text_len for x in s])
        return [train * self.epochs, self.flops.generate(prompt, response, groups)]


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """verl's ``critic/vf_explained_var``: :math:`1 - \\mathrm{Var}(R - V) / \\mathrm{Var}(R)` over
    the response tokens (``[B, R]`` each), with the values the critic gave before its update.
    1: the critic predicts the returns; 0: no better than their mean; below 0: worse."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    if r.numel() < 2 or float(r.var()) == 0.0:
        return 0.0
    return float(1.0 - (r - v).var() / r.var())
