"""Mutation run: does a test fail when the code is broken the way a real bug would break it?

    make mutants                                   # the whole catalogue (long; not in make test)
    python -m benchmarks.mutants [--only NAME,...] [--timeout S] [--no-baseline] [--keep]
    python -m benchmarks.mutants --list            # the catalogue, the tests each runs, rough times
    python -m benchmarks.mutants --check           # each applies once, compiles, its tests exist (seconds)

A *mutant* (:class:`Mutant`) is one small, named source change under ``hybrid_rl/``: ``old`` (an
exact substring that occurs exactly once in ``path``) becomes ``new``, a one-line break of the kind
a real bug makes (a sign, an off-by-one, a missing normalisation, a step left out), which still
imports. Each names the fastest tests that should catch it (unit tests where they can see the break;
an integration or e2e test only where nothing smaller can) and the bug it models.

The run:

1. copies the working tree (``git ls-files -co --exclude-standard``: tracked and untracked,
   not ignored, uncommitted edits included) into a temporary directory, so the checkout is never
   touched; every test runs there with ``PYTHONPATH`` set to the copy (so torchrun scripts and the
   launcher's ranks import the copy, not the editable install) and without writing bytecode;
2. runs the union of every named test once, unmutated (the baseline): all must pass, else the
   run stops and names the failing ones. The baseline also fills the shared cache
   (``~/.cache/hybrid_rl``: tiny models, datasets) with unmutated artifacts, so the mutants find them there and build none of their own;
3. for each mutant: applies it (asserting one occurrence), runs
   ``python -m pytest -x -q -rfEs -p no:cacheprovider <tests>`` in the copy under a per-mutant
   timeout (the project's addopts and pytest-timeout settings stay in force), restores the file,
   and records the seconds and the result:

   - ``killed``: pytest exited 1, a test failed; the first ``FAILED``/``ERROR`` id is recorded;
   - ``survived``: every test passed. A survivor is a missing test;
   - ``skipped``: pytest exited 0 but nothing passed (every test skipped here): not a kill;
   - ``error``: any other exit status (collection error, usage error): not a kill;
   - ``timeout``: the tests ran past ``--timeout``; a kill only for a mutant marked
     ``timeout_kills`` (one that makes the code hang), otherwise not.

   A mutant with ``expect_survivor_reason`` is one no existing test is believed to catch; it runs
   all the same, and the reason says which test is missing.

Outputs: ``benchmarks/results/mutants.json`` (machine, settings, one row per mutant) and
``mutants.png`` (seconds per mutant, coloured by result), then the page
``docs/reference/mutants.md`` (what a mutant is, how to run it, the machine, the table) and the
regenerated reference pages (``scripts/gen_docs.py``: the results table lists the new JSON). With
``HYBRID_RL_BENCH_RESULTS`` set, all of it goes to that folder and the docs are left alone. The exit
status is 1 when any mutant was not killed.

``--only`` runs write the same files, with the mutants that ran.

Time: roughly 30-40 min for the whole catalogue on 2 cores (``--list`` prints rough per-mutant
guesses from measured test durations; slower machines take up to ~2x).
Most of it is the baseline and the few integration and e2e tests (vLLM engines, torchrun ranks,
tiny training runs); each unit-test mutant costs a pytest start-up and seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import RESULTS, figure, machine_info, run_in_session, save_figure, write_json

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    """One named break: ``old`` (exactly once in ``path``) becomes ``new``; ``tests`` should fail."""

    name: str
    area: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    bug: str
    # Set when no existing test is believed to catch it: which test is missing, and why.
    expect_survivor_reason: str | None = None
    # A mutant that makes the code hang: running past the timeout counts as a kill.
    timeout_kills: bool = False


ADV = "hybrid_rl/algorithms/advantages.py"
LOSSES = "hybrid_rl/algorithms/losses.py"
KL = "hybrid_rl/algorithms/kl.py"
FILTERS = "hybrid_rl/algorithms/filters.py"
HEADS = "hybrid_rl/engine/heads.py"
FSDP = "hybrid_rl/engine/fsdp.py"
T_ADV = "tests/unit/test_advantages.py"
T_LOSS = "tests/unit/test_losses.py"
T_CORR = "tests/unit/test_correctness.py"
T_TKF = "tests/unit/test_truncation_kl_and_filters.py"
T_ENG = "tests/integration/test_engines.py"
T_DATA = "tests/unit/test_data.py"
T_CKPT = "tests/unit/test_checkpoint.py"
T_LORA = "tests/unit/test_lora_parts.py"

CATALOGUE: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ advantages
    Mutant("grpo_sign", "advantages", ADV,
           'adv = scores - mean\n    if params.norm_adv_by_std:',
           'adv = mean - scores\n    if params.norm_adv_by_std:',
           (f"{T_ADV}::test_grpo_hand_computed",),
           "GRPO advantage with the sign flipped: the policy is pushed away from its best answers"),
    Mutant("grpo_biased_std", "advantages", ADV,
           "std = torch.where(n > 1, (sq / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(n))",
           "std = torch.where(n > 1, (sq / n).sqrt(), torch.zeros_like(n))",
           (f"{T_ADV}::test_grpo_hand_computed", f"{T_ADV}::test_group_stats_and_whiten"),
           "group std normalisation with the population std (divide by G, not G - 1): GRPO's scale is off"),
    Mutant("rloo_baseline_includes_self", "advantages", ADV,
           "adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), torch.zeros_like(scores))",
           "adv = torch.where(n > 1, scores - mean, torch.zeros_like(scores))",
           (f"{T_ADV}::test_rloo_leave_one_out_loop",),
           "RLOO's baseline includes the sample itself (plain group mean, no G / (G - 1) correction)"),
    Mutant("gae_lambda_without_gamma", "advantages", ADV,
           "new_running = delta + gamma * lam * running",
           "new_running = delta + lam * running",
           (f"{T_ADV}::test_gae_hand_computed_terminal",),
           "GAE accumulates with lambda instead of gamma * lambda (the discount drops out of the trace)"),
    Mutant("gae_value_through_tool_tokens", "advantages", ADV,
           "next_value = torch.where(m > 0, values[:, t], next_value)",
           "next_value = values[:, t]",
           (f"{T_ADV}::test_gae_matches_loop_with_masked_tool_tokens",),
           "GAE bootstraps from the critic's value on masked tool-output tokens of a multi-turn response"),
    Mutant("reinforce_pp_not_whitened", "advantages", ADV,
           "return masked_whiten(returns, inp.response_mask), returns",
           "return returns, returns",
           (f"{T_ADV}::test_reinforce_pp_returns_and_global_whitening",),
           "REINFORCE++ returns used raw: the batch whitening (its baseline) is left out"),
    Mutant("remax_batch_mean_baseline", "advantages", ADV,
           "out = _broadcast(scores - inp.baseline_scores, inp.response_mask)",
           "out = _broadcast(scores - scores.mean(), inp.response_mask)",
           (f"{T_ADV}::test_remax_greedy_baseline",),
           "ReMax subtracts the batch mean instead of the greedy answer's reward"),
    # ------------------------------------------------------------------ losses
    Mutant("ppo_clip_min", "losses", LOSSES,
           "loss = torch.maximum(pg1, pg2)\n    metrics = {",
           "loss = torch.minimum(pg1, pg2)\n    metrics = {",
           (f"{T_LOSS}::test_ppo_clip_hand_computed",),
           "PPO's pessimistic max of the two surrogates written as a min: the clip never binds"),
    Mutant("ppo_clip_high_ignored", "losses", LOSSES,
           "ratio = torch.exp(log_ratio)\n    pg1 = -advantages * ratio\n"
           "    pg2 = -advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)",
           "ratio = torch.exp(log_ratio)\n    pg1 = -advantages * ratio\n"
           "    pg2 = -advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_low)",
           (f"{T_LOSS}::test_ppo_clip_hand_computed",),
           "clip bounds: the upper bound reads clip_ratio_low, so DAPO's clip-higher is silently off"),
    Mutant("gspo_ratio_not_length_normalised", "losses", LOSSES,
           "seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)",
           "seq_log_ratio = (log_ratio * mask).sum(-1)",
           (f"{T_LOSS}::test_gspo_sequence_ratio_and_gradient",),
           "GSPO's sequence ratio is the product of token ratios, not their geometric mean"),
    Mutant("token_mean_local_normaliser", "losses", LOSSES,
           "return mask / max(n_tokens, 1.0)",
           "return mask / mask.sum().clamp(min=1)",
           (f"{T_LOSS}::test_agg_weights_split_into_micro_batches_is_exact",),
           "token-mean normalised per micro-batch instead of over the whole mini-batch and all ranks"),
    Mutant("drgrpo_padded_length", "losses", LOSSES,
           "length = max_len if max_len is not None else mask.shape[-1]",
           "length = mask.shape[-1]",
           (f"{T_LOSS}::test_agg_modes_hand_computed",),
           "Dr.GRPO's constant length L replaced by the batch's padded width: the length bias is back"),
    Mutant("tis_ratio_inverted", "losses", LOSSES,
           "log_w = (old_logprobs - rollout_logprobs) * mask",
           "log_w = (rollout_logprobs - old_logprobs) * mask",
           (f"{T_LOSS}::test_tis_weights_token_and_sequence",),
           "truncated importance sampling with mu / pi_old instead of pi_old / mu"),
    Mutant("entropy_bonus_sign", "losses", LOSSES,
           "loss = loss - cfg.entropy_coeff * out.entropy",
           "loss = loss + cfg.entropy_coeff * out.entropy",
           (f"{T_LOSS}::test_actor_loss_composes_pg_entropy_and_kl",),
           "the entropy bonus enters the loss with the wrong sign (an entropy penalty)"),
    Mutant("kl_loss_type_ignored", "losses", LOSSES,
           "kl = kl_estimate(policy, mb.ref_logprobs, kl_loss.type)",
           "kl = kl_estimate(policy, mb.ref_logprobs)",
           (f"{T_LOSS}::test_actor_loss_composes_pg_entropy_and_kl",),
           "algorithm.kl_loss.type is not passed on: the KL loss is always k3"),
    Mutant("kl_loss_coef_ignored", "losses", LOSSES,
           "loss = loss + kl_loss.coef * kl",
           "loss = loss + kl",
           (f"{T_LOSS}::test_actor_loss_composes_pg_entropy_and_kl",),
           "algorithm.kl_loss.coef is dropped: the KL term always has weight 1"),
    Mutant("kl_loss_on_truncated_logprobs", "losses", LOSSES,
           "policy = out.kl_logprobs if out.kl_logprobs is not None else out.logprobs",
           "policy = out.logprobs",
           (f"{T_TKF}::test_kl_loss_uses_the_untruncated_logprobs",),
           "the KL loss compares the top-k/top-p truncated policy with the full-softmax reference (KL > 0 at equal weights)"),
    # ------------------------------------------------------------------ KL estimators and controller
    Mutant("k1_sign", "kl", KL,
           "return -log_ratio",
           "return log_ratio",
           (f"{T_LOSS}::test_kl_estimators_hand_computed",),
           "k1 with the sign flipped: the KL penalty rewards drifting from the reference"),
    Mutant("k2_without_half", "kl", KL,
           "return 0.5 * log_ratio**2",
           "return log_ratio**2",
           (f"{T_LOSS}::test_kl_estimators_hand_computed",),
           "k2 without its 1/2: the KL term is twice its coefficient"),
    Mutant("k3_reversed_ratio", "kl", KL,
           "return (torch.exp(log_ratio) - 1 - log_ratio).clamp(-10.0, 10.0)",
           "return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-10.0, 10.0)",
           (f"{T_LOSS}::test_kl_estimators_hand_computed", f"{T_LOSS}::test_k3_is_unbiased_estimate_of_kl"),
           "k3 with the ratio inverted (pi / pi_ref): a biased estimate of the other KL direction"),
    Mutant("adaptive_kl_sign", "kl", KL,
           "self.value *= 1.0 + error * n_steps / self.horizon",
           "self.value *= 1.0 - error * n_steps / self.horizon",
           (f"{T_LOSS}::test_adaptive_kl_controller",),
           "the adaptive KL controller lowers beta when the KL is above its target"),
    # ------------------------------------------------------------------ filters
    Mutant("dapo_keeps_any_correct_group", "filters", FILTERS,
           "return (hi - lo > eps)[inv]",
           "return (hi > eps)[inv]",
           (f"{T_ADV}::test_informative_groups_drops_equal_reward_groups",),
           "DAPO dynamic sampling keeps groups with any reward instead of groups whose rewards differ"),
    Mutant("dapo_filters_on_shaped_score", "filters", "hybrid_rl/trainer/collect.py",
           'values = [s.acc if f.metric == "acc" else s.score for s in everyone]',
           "values = [s.score for s in everyone]",
           (f"{T_TKF}::test_dapo_filter_drops_an_all_correct_group_that_differs_only_in_length[acc-4]",),
           "DAPO filters on the length-shaped score, so an all-correct group trains on length alone"),
    # ------------------------------------------------------------------ engine
    Mutant("outside_logprob_minus_inf", "engine", HEADS,
           "OUTSIDE_LOGPROB = -1.0e4",
           'OUTSIDE_LOGPROB = float("-inf")',
           (f"{T_TKF}::test_a_target_outside_top_k_gets_a_finite_logprob_not_minus_inf",),
           "the log-prob floor for targets outside top-k/top-p is -inf: masked padding gives NaN (-inf x 0)"),
    Mutant("head_temperature_dropped", "engine", HEADS,
           "logits = logits / temperature",
           "logits = logits",
           (f"{T_CORR}::test_truncated_head_gives_renormalised_logprobs_and_finite_entropy",),
           "the trainer's log-prob head ignores the sampling temperature the engine sampled with"),
    Mutant("logprob_offset", "engine", HEADS,
           "h = hidden[:, prompt_len - 1 : t - 1].reshape(b * r, -1)",
           "h = hidden[:, prompt_len:t].reshape(b * r, -1)",
           (f"{T_ENG}::test_fsdp_logprobs_match_hf_forward",),
           "off by one: hidden state P + j scores response token j (it predicts token j + 1)"),
    Mutant("padding_logprobs_not_zeroed", "engine", FSDP,
           "v = torch.nn.functional.pad(torch.where(real > 0, v, 0.0), (0, r_full - v.shape[1]))",
           "v = torch.nn.functional.pad(v, (0, r_full - v.shape[1]))",
           (f"{T_ENG}::test_truncated_sampling_on_short_rows_stays_finite[ppo_clip]",),
           "forward_outputs leaves log-probs on padding positions unmasked (old log-probs of short rows)"),
    Mutant("grad_accumulation_double_scaled", "engine", FSDP,
           "(loss * self.ctx.world_size).backward()",
           "(loss * self.ctx.world_size / len(mbs)).backward()",
           (f"{T_ENG}::test_micro_batching_gives_the_same_update",),
           "gradient accumulation divides by the micro-batch count although the loss weights are already global"),
    Mutant("rank_scale_dropped", "engine", FSDP,
           "(loss * self.ctx.world_size).backward()",
           "loss.backward()",
           ("tests/integration/test_ranks.py::test_one_and_two_ranks_give_the_same_gradient[token-mean]",),
           "no world-size factor before backward: FSDP's gradient average over ranks shrinks the update N times"),
    Mutant("nonfinite_loss_steps", "engine", FSDP,
           "if loss_finite and math.isfinite(grad_norm):",
           "if math.isfinite(grad_norm):",
           (f"{T_ENG}::test_a_nonfinite_loss_with_a_finite_gradient_is_a_skipped_step",),
           "a NaN loss with a finite gradient norm still steps the optimizer"),
    Mutant("lr_warmup_off_by_one", "engine", "hybrid_rl/engine/optim.py",
           "return (step + 1) / cfg.warmup_steps",
           "return step / cfg.warmup_steps",
           ("tests/unit/test_optim.py",),
           "LR warm-up off by one: the first optimizer step runs at learning rate 0"),
    # ------------------------------------------------------------------ the switch
    Mutant("stale_guard_reads_engine_version", "switch", "hybrid_rl/hybrid/switch.py",
           "lag = self.weights_version - rollout_version",
           "lag = self.engine_version - rollout_version",
           (f"{T_CORR}::test_stale_weight_guard_fires_when_a_sync_is_skipped_or_fails",),
           "the version counter check compares the engine's version with itself: a skipped sync goes unnoticed"),
    Mutant("weight_sync_skipped", "switch", "hybrid_rl/hybrid/switch.py",
           'moved["sync.tensors"] = self._push()',
           'moved["sync.tensors"] = 0',
           (f"{T_ENG}::test_trainer_logprobs_match_vllm_sampler_logprobs_after_a_sync[1.0--1-1.0]",),
           "the weight push is dropped but the engine is still stamped with the new version: stale rollouts pass the guard"),
    Mutant("prefix_cache_not_reset", "switch", "hybrid_rl/hybrid/switch.py",
           "self.rollout.reset_prefix_cache()",
           "pass",
           ("tests/integration/test_hybrid.py::test_weight_push_resets_the_prefix_cache[float32]",),
           "the prefix cache survives a weight push: cached prompt KV from the old weights is reused"),
    # ------------------------------------------------------------------ LoRA
    Mutant("lora_reference_keeps_adapters", "lora", "hybrid_rl/engine/lora.py",
           "m._disable_adapters = True", "m._disable_adapters = False",
           (f"{T_LORA}::test_adapters_off_is_the_base_and_merge_is_peft_forward",),
           "the KL reference of a LoRA run keeps the adapters on: it is the policy itself and the KL is 0"),
    Mutant("lora_base_trains", "lora", "hybrid_rl/engine/lora.py",
           "p.requires_grad_(trainable)", "p.requires_grad_(True)",
           (f"{T_LORA}::test_only_adapters_train_and_the_model_starts_as_the_base",),
           "LoRA leaves the base trainable: a full fine-tune under the adapters, whose base updates never reach the engine"),
    Mutant("lora_merge_without_scale", "lora", "hybrid_rl/engine/lora.py",
           "scale * (b.float() @ a.float())", "(b.float() @ a.float())",
           (f"{T_LORA}::test_adapters_off_is_the_base_and_merge_is_peft_forward",),
           "the merged export adds B A without alpha / rank: the exported model is not the trained one"),
    Mutant("lora_push_keeps_old_adapter", "lora", "hybrid_rl/rollout/vllm_engine.py",
           "    slots.remove_adapter(lora_id)\n    slots.add_adapter(lora)", "    slots.add_adapter(lora)",
           ("tests/integration/test_lora_sync.py::test_engine_log_probs_with_the_in_memory_adapter_equal_the_trainers",),
           "the engine keeps the adapter it already holds under the slot's id: every push after the first is dropped"),
    # ------------------------------------------------------------------ rollout
    Mutant("tool_tokens_trained", "rollout", "hybrid_rl/rollout/agent.py",
           "traj.mask += [0] * len(ids)",
           "traj.mask += [1] * len(ids)",
           ("tests/unit/test_agent.py::test_agent_loop_token_in_token_out_and_mask",),
           "tool output tokens get loss mask 1: the policy is trained to imitate the tool"),
    Mutant("tool_logprobs_off_by_one", "rollout", "hybrid_rl/rollout/agent.py",
           "traj.logprobs += [0.0] * len(ids)",
           "traj.logprobs += [0.0] * (len(ids) - 1)",
           ("tests/unit/test_agent.py::test_agent_loop_token_in_token_out_and_mask",),
           "sampler log-probs shifted by one after a tool turn (one log-prob short per tool turn)"),
    Mutant("per_prompt_seeds_ignored", "rollout", "hybrid_rl/rollout/vllm_engine.py",
           "seed=spec.seed if seed is None else seed,",
           "seed=spec.seed,",
           (f"{T_ENG}::test_per_prompt_seeds_decorrelate_groups",),
           "sampling params: the per-prompt seeds are dropped (unseeded sampling, no exact resume)"),
    Mutant("greedy_baseline_wrong_prompt", "rollout", "hybrid_rl/trainer/collect.py",
           "s.baseline_score = greedy.samples[i // per_prompt].score",
           "s.baseline_score = greedy.samples[i % len(greedy.samples)].score",
           (f"{T_CORR}::test_remax_greedy_baseline_is_each_prompts_greedy_reward",),
           "ReMax's greedy baseline is taken from another prompt (index modulo instead of division)"),
    # ------------------------------------------------------------------ rewards
    Mutant("math_first_boxed", "rewards", "hybrid_rl/rewards/functions.py",
           "i = starts[-1]",
           "i = starts[0]",
           ("tests/unit/test_rewards.py::test_math_reward",),
           "the math verifier reads the first \\boxed{} instead of the last (the final answer)"),
    Mutant("math_boxed_expression_evaluated", "rewards", "hybrid_rl/rewards/functions.py",
           'if _INTEGER.fullmatch(digits := gt.replace(",", "")):',
           'if boxed is None and _INTEGER.fullmatch(digits := gt.replace(",", "")):',
           ("tests/unit/test_rewards.py::test_math_reward",),
           "boxed answers to integer questions go to math-verify, which evaluates \\boxed{41 + 35} to 76 (reward hacking)"),
    Mutant("overlong_penalty_sign", "rewards", FILTERS,
           "pen = ((start - lengths.float()) / buffer).clamp(min=-1.0, max=0.0)",
           "pen = ((lengths.float() - start) / buffer).clamp(min=-1.0, max=0.0)",
           (f"{T_ADV}::test_overlong_penalty_matches_dapo_formula",),
           "DAPO's soft overlong penalty with the sign flipped: short answers are punished"),
    Mutant("sandbox_memory_limit_units", "rewards", "hybrid_rl/rewards/sandbox.py",
           'f"--as={lim.memory_mb << 20}"',
           'f"--as={lim.memory_mb << 30}"',
           ("tests/integration/test_sandbox.py::test_memory_is_limited",),
           "sandbox limits: the address-space limit in GiB where MiB was meant (1024x too large)"),
    # ------------------------------------------------------------------ checkpointing
    Mutant("resume_from_oldest", "checkpointing", "hybrid_rl/resume.py",
           "return ckpts[-1] if ckpts else None",
           "return ckpts[0] if ckpts else None",
           (f"{T_CKPT}::test_unfinished_checkpoints_are_invisible",),
           "trainer.resume=auto picks the oldest checkpoint instead of the newest"),
    Mutant("manifest_any_file_present", "checkpointing", "hybrid_rl/resume.py",
           'if all((p / name).is_file() for name in manifest.get("files", [])):',
           'if any((p / name).is_file() for name in manifest.get("files", [])):',
           (f"{T_CKPT}::test_a_manifest_next_to_missing_shards_is_invisible",),
           "a checkpoint counts as whole when any of its files is there (a half-deleted one is resumed)"),
    Mutant("checkpoint_removed_in_place", "checkpointing", "hybrid_rl/trainer/checkpoint.py",
           "os.replace(ckpt_dir, hidden)",
           "shutil.rmtree(ckpt_dir)",
           (f"{T_CKPT}::test_a_kill_while_a_checkpoint_is_removed_leaves_the_newest_whole[same_step_saved_again]",),
           "a replaced checkpoint is deleted in place, not renamed out of sight first: a kill mid-delete leaves it torn"),
    Mutant("optimizer_state_not_saved", "checkpointing", "hybrid_rl/trainer/checkpoint.py",
           'return {"model": model_sd, "optim": optim_sd}',
           'return {"model": model_sd, "optim": {}}',
           ("tests/e2e/test_combinations.py::test_cell_fresh_and_resumed[1rank-full-fp32-killed_in_generate_step3_redone]",),
           "the optimizer state is left out of the checkpoint: a resume restarts AdamW's moments"),
    # ------------------------------------------------------------------ where features meet (nothing silent)
    Mutant("validation_uses_math_verifier", "nothing silent", "hybrid_rl/trainer/build.py",
           "    if reward.functions:\n        return train_pool",
           "    if any(f.name == \"math\" for f in reward.functions):\n        return train_pool",
           ("tests/e2e/test_no_silent_skips.py::test_steps_without_update_are_said_and_stop_the_run",),
           "validation scores with the math verifier whenever the run's reward has no 'math' function: val/accuracy measures another reward than training"),
    Mutant("skipped_update_silent", "nothing silent", "hybrid_rl/trainer/no_update.py",
           'log.warning("step %d: no update, the weights are unchanged: %s", step, reason)', "pass",
           ("tests/unit/test_no_update.py::test_watch_logs_every_skip_warns_once_and_resets",),
           "a step where dynamic sampling kept nothing passes without a word on the console"),
    Mutant("skipped_update_never_stops", "nothing silent", "hybrid_rl/trainer/no_update.py",
           'return bool(self.patience) and self.action == "stop" and self.streak >= self.patience', "return False",
           ("tests/unit/test_no_update.py::test_watch_stops_at_patience_and_never_with_zero",),
           "trainer.no_update_action=stop is ignored: a run that never updates 'finishes'"),
    Mutant("dapo_skip_not_a_skip", "nothing silent", "hybrid_rl/trainer/no_update.py",
           'if metrics.get("dapo/skipped_updates"):', "if False:",
           ("tests/unit/test_no_update.py::test_reason_names_the_cause",),
           "a step dynamic sampling left without a batch is not counted as a step without an update"),
    Mutant("eval_ignores_the_checkpoints_run", "nothing silent", "hybrid_rl/trainer/eval_setup.py",
           "taken = inherit_run_settings(cfg, model_path, given)", "taken = []",
           ("tests/unit/test_eval_setup.py::test_prepare_eval_takes_the_runs_settings_and_a_new_folder",),
           "evaluating a checkpoint uses the eval recipe's defaults (the builtin task, default lengths), not its run's files and reward"),
    Mutant("eval_overwrites_the_last_eval", "nothing silent", "hybrid_rl/trainer/eval_setup.py",
           'if "trainer.output_dir" in given:', "if True:",
           ("tests/unit/test_eval_setup.py::test_every_eval_gets_its_own_folder_unless_one_is_given",),
           "every eval writes outputs/eval_math/ and overwrites the one before"),
    Mutant("critic_nobody_reads_accepted", "nothing silent", "hybrid_rl/config/checks.py",
           '("critic" not in needs and cfg.critic.enable,', "(False,",
           ("tests/unit/test_config.py::test_contradictory_settings_are_named",),
           "critic.enable with GRPO is accepted: a second model is trained and its values thrown away"),
    Mutant("lora_over_wiped_base_accepted", "nothing silent", "hybrid_rl/config/checks.py",
           "(r.sleep_level == 2 and cfg.actor.lora.rank > 0,", "(False,",
           ("tests/unit/test_config.py::test_contradictory_settings_are_named",),
           "LoRA with sleep_level=2 is accepted: the engine's base weights are discarded and only adapters come back"),
    Mutant("short_dapo_batch_silent", "nothing silent", "hybrid_rl/trainer/collect.py",
           "elif used < batch * n and self.ctx.is_main:", "elif False:",
           ("tests/unit/test_reward_steps.py::test_dynamic_sampling_says_when_it_trains_a_short_batch_or_nothing",),
           "a step trains a short batch after max_gen_rounds with only dapo/used_samples to show"),
    Mutant("switch_notes_unsaid", "nothing silent", "hybrid_rl/trainer/step_metrics.py",
           'log.info("switch %s: %s", report.direction, note)', "pass",
           ("tests/unit/test_no_update.py::test_switch_notes_are_said_once",),
           "why a setting has no effect on this hardware (no sleep mode, host-resident optimizer) is recorded and never said"),
    Mutant("passk_ignores_top_p", "nothing silent", "hybrid_rl/trainer/validation.py",
           "spec = SamplingSpec(n=pass_k, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens)",
           "spec = SamplingSpec(n=pass_k, temperature=temperature, max_tokens=max_tokens)",
           ("tests/unit/test_validation.py::test_hits_are_in_record_order_for_every_shard",),
           "pass@k samples at the temperature alone while training samples from the nucleus: another policy is measured"),
    # export
    Mutant("export_non_empty_folder_not_refused", "nothing silent", "hybrid_rl/export.py",
           "    if entries and not overwrite:\n", "    if entries and False:\n",
           ("tests/unit/test_export.py::test_the_api_refuses_a_non_empty_folder_unless_overwrite",),
           "an export into a folder holding a model goes ahead: new shards sit beside the old model.safetensors and transformers loads the old weights"),
    Mutant("export_overwrite_keeps_stale_weights", "nothing silent", "hybrid_rl/export.py",
           "        (out / n).unlink()\n", "        pass\n",
           ("tests/unit/test_export.py::test_a_folder_holding_a_model_is_refused_and_overwrite_leaves_only_the_new_export",),
           "--overwrite leaves the old model.safetensors beside the new shards: the folder loads the old weights"),
    Mutant("export_config_dtype_from_source", "nothing silent", "hybrid_rl/export.py",
           '{**config, "dtype": dtype, "torch_dtype": dtype}', '{**config, "torch_dtype": dtype}',
           ("tests/unit/test_export.py::test_config_dtype_names_the_dtype_on_disk[full-bfloat16]",),
           "a bf16 export's config.json keeps the source's dtype float32: dtype='auto' and vLLM load it as fp32"),
    # rewards
    Mutant("reward_extras_not_logged", "nothing silent", "hybrid_rl/trainer/collect.py",
           "m.update(self.end_step(m))", "self.end_step(m)",
           ("tests/unit/test_reward_steps.py::test_a_rewards_extras_are_logged_per_step_as_the_mean_of_the_answers_that_reported_them",),
           "a reward function's numeric extras are computed and dropped: no reward/<key> in the step's metrics"),
    Mutant("reward_extras_not_gathered", "nothing silent", "hybrid_rl/trainer/collect.py",
           "for part in all_gather_objects(local):", "for part in [local]:",
           ("tests/unit/test_reward_steps.py::test_extras_are_one_global_mean_on_every_rank_and_never_summed",),
           "reward extras from this rank only: ranks hold different keys and reduce_metrics misaligns them"),
    Mutant("reward_extras_summed_over_ranks", "nothing silent", "hybrid_rl/trainer/step_metrics.py",
           '(k.endswith("_tokens") and not k.startswith("reward/"))', 'k.endswith("_tokens")',
           ("tests/unit/test_reward_steps.py::test_extras_are_one_global_mean_on_every_rank_and_never_summed",),
           "a reward extra named *_tokens is summed over ranks like a count (world_size x its mean)"),
    Mutant("reward_traceback_dropped", "nothing silent", "hybrid_rl/rewards/pool.py",
           'out.append(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))',
           'out.append(("error", f"{type(e).__name__}: {e}", ""))',
           ("tests/unit/test_rewards.py::test_a_reward_raising_on_some_answers_logs_one_traceback_then_counts",),
           "a reward's exception reaches the log without the worker's traceback"),
    Mutant("reward_failures_not_rate_limited", "nothing silent", "hybrid_rl/rewards/pool.py",
           "if (fn, kind) in self.seen:", "if False:",
           ("tests/unit/test_rewards.py::test_a_reward_raising_on_some_answers_logs_one_traceback_then_counts",),
           "every failing answer prints its full traceback (a reward failing on every answer floods the log)"),
    Mutant("reward_repeats_never_summarised", "nothing silent", "hybrid_rl/rewards/pool.py",
           "self.failures.summarize(force=True)", "self.failures.summarize()",
           ("tests/unit/test_rewards.py::test_a_reward_raising_on_some_answers_logs_one_traceback_then_counts",),
           "repeated reward failures still counted at the end of a run are never said"),
    Mutant("reward_timeouts_silent", "nothing silent", "hybrid_rl/rewards/pool.py",
           "        if timeouts:\n", "        if False:\n",
           ("tests/unit/test_rewards.py::test_a_timeout_is_said_with_the_function_and_the_setting_and_a_slow_wait_too",),
           "reward timeouts leave no line on the console (a run stalls for timeout_s per hung answer unexplained)"),
    Mutant("reward_failed_steps_counted_per_round", "nothing silent", "hybrid_rl/trainer/collect.py",
           "self.scored += results", "self.scored += results; self.reward_pool.check_failures(results)",
           ("tests/unit/test_reward_steps.py::test_the_failure_stop_counts_steps_not_dapo_generation_rounds",),
           "the reward failure stop counts DAPO generation rounds as steps: it stops inside the first step"),
    # LoRA, optimizer, sandbox
    Mutant("lora_push_hands_live_tensors", "nothing silent", "hybrid_rl/rollout/vllm_engine.py",
           'owned = {n: t.to(device="cpu", dtype=dtype, copy=True) for n, t in tensors.items()}', "owned = tensors",
           ("tests/integration/test_lora_sync.py::test_on_one_rank_a_push_leaves_the_trainers_adapters_unchanged",),
           "vLLM is handed the trainer's own adapter tensors on one rank and scales B by alpha / r in place on every push"),
    Mutant("bf16_moments_load_casts_fp32", "nothing silent", "hybrid_rl/engine/adamw_bf16.py",
           ".to(device=p.device, dtype=torch.bfloat16)", ".to(device=p.device, dtype=p.dtype)",
           ("tests/unit/test_adamw_bf16.py::test_a_loaded_state_keeps_its_moments_in_bf16",),
           "a loaded bf16-moment AdamW state comes back in fp32: double optimizer memory after every resume"),
    Mutant("sandbox_sweep_spares_dead", "nothing silent", "hybrid_rl/rewards/sandbox.py",
           "    except ProcessLookupError:\n        return True", "    except ProcessLookupError:\n        return False",
           ("tests/integration/test_sandbox.py::test_a_new_sandbox_sweeps_what_dead_processes_left_and_keeps_a_live_ones",
            "tests/integration/test_sandbox.py::test_a_process_killed_mid_call_leaves_nothing_after_the_next_sandbox_starts"),
           "what a killed process left (cgroups, scratch folder) is never swept"),
    Mutant("sandbox_sweep_takes_live", "nothing silent", "hybrid_rl/rewards/sandbox.py",
           "if not (_owner_gone(d.name) and d.is_dir()):", "if not d.is_dir():",
           ("tests/integration/test_sandbox.py::test_a_new_sandbox_sweeps_what_dead_processes_left_and_keeps_a_live_ones",),
           "the sweep removes a live run's sandbox folders and cgroups too"),
    # resume
    Mutant("fresh_start_writes_into_the_earlier_run", "nothing silent", "hybrid_rl/resume.py",
           "    if not found:\n        return None", "    if True:\n        return None",
           (f"{T_CKPT}::test_a_fresh_start_moves_the_earlier_run_aside_and_a_later_resume_continues_it",),
           "a run from step 0 writes into an earlier run's folder: a later resume=auto resumes the discarded run, steps logged twice"),
    Mutant("every_rank_moves_the_earlier_run", "nothing silent", "hybrid_rl/trainer/run_control.py",
           "        if self.ctx.is_main:\n            chosen = self.resume_point()", "        if True:\n            chosen = self.resume_point()",
           (f"{T_CKPT}::test_only_rank_0_moves_the_earlier_run_and_every_rank_waits_for_it",),
           "every rank moves the earlier run's files at once instead of rank 0 alone"),
    Mutant("rewound_run_keeps_newer_checkpoints", "nothing silent", "hybrid_rl/resume.py",
           "    for p in newer:\n        os.replace(p, dest / p.name)", "    for p in newer:\n        pass",
           (f"{T_CKPT}::test_resuming_an_older_checkpoint_of_the_run_moves_its_newer_ones_aside",),
           "resuming an older checkpoint of the run leaves the newer ones: the first save prunes the resumed run's own"),
    Mutant("launcher_leaves_the_earlier_run", "nothing silent", "hybrid_rl/main.py",
           "            start_clean_or_exit(composed)", "            pass",
           ("tests/e2e/test_resume_safety.py::test_starting_over_moves_the_earlier_run_aside_and_resuming_continues_the_new_one",),
           "the launching process does not move the earlier run aside: the new main.log continues the old run's"),
    Mutant("resume_accepts_max_prompt_length", "nothing silent", "hybrid_rl/resume.py",
           '"data.max_prompt_length": "it decides', '"data.max_prompt_length.": "it decides',
           (f"{T_CKPT}::test_resume_refuses_a_setting_that_changes_the_kept_rows[data.max_prompt_length]",),
           "resume accepts another max_prompt_length: the data position indexes other kept rows"),
    Mutant("resume_accepts_synth_split", "nothing silent", "hybrid_rl/resume.py",
           "and (synth or not k.startswith(SYNTH_KEYS))", "and (not k.startswith(SYNTH_KEYS))",
           (f"{T_CKPT}::test_resume_refuses_a_setting_that_changes_the_kept_rows[data.synth.n_train]",),
           "resume accepts another generated training split"),
    Mutant("resume_ignores_chat_template", "nothing silent", "hybrid_rl/resume.py",
           "if k in made_from and made_from[k] != here.get(k)", "if k in made_from and made_from[k] != made_from[k]",
           (f"{T_CKPT}::test_resume_refuses_another_chat_template_of_a_local_model",),
           "resume accepts a model folder whose chat template changed"),
    Mutant("changed_settings_not_in_main_log", "nothing silent", "hybrid_rl/main.py",
           "    for line in STARTUP_LINES:\n        log.warning(line)", "    for line in STARTUP_LINES:\n        print(line, file=sys.stderr)",
           (f"{T_CKPT}::test_the_changed_settings_a_resume_goes_on_with_reach_main_log",),
           "the changed settings a resume goes on with reach stderr only, not main.log"),
    Mutant("lr_schedule_not_restored", "nothing silent", "hybrid_rl/engine/fsdp.py",
           '            self.scheduler.load_state_dict(state["scheduler"])', "            pass",
           ("tests/e2e/test_combinations.py::test_cell_fresh_and_resumed[1rank-full-fp32-killed_in_generate_step3_redone]",),
           "a resume restarts the LR schedule: the warm-up/cosine LR differs from the second update after it"),
    # ------------------------------------------------------------------ the long-tailed task
    Mutant("longtail_train_lines_unfiltered", "data", "hybrid_rl/data/synth_math.py",
           "val_rule, train_rule = StepRule(marked=held_fact), StepRule(ok=lambda f: not held_fact(f))",
           "val_rule, train_rule = StepRule(marked=held_fact), None",
           ("tests/unit/test_longtail.py::test_the_split_is_by_fact_line_by_line_and_keeps_the_tail",),
           "level-7 train problems are rejected whole instead of drawn line by line: the long tail vanishes from train"),
    Mutant("longtail_val_unmarked", "data", "hybrid_rl/data/synth_math.py",
           "val_rule, train_rule = StepRule(marked=held_fact), StepRule(ok=lambda f: not held_fact(f))",
           "val_rule, train_rule = StepRule(), StepRule(ok=lambda f: not held_fact(f))",
           ("tests/unit/test_longtail.py::test_the_split_is_by_fact_line_by_line_and_keeps_the_tail",),
           "level-7 val problems get a held-out line by rejection: val is longer than train"),
    Mutant("longtail_tool_call_nested", "data", "hybrid_rl/data/synth_math.py",
           "f\"{expr} {step.split(' ', 1)[1]}\" if p.level == RUNNING_SUM_LEVEL else ", "",
           ("tests/unit/test_longtail.py::test_running_sums_add_the_question_operands_one_line_each",),
           "a running sum's tool call nests one bracket per operand (Python refuses 200 levels)"),
    Mutant("longtail_operands_unbounded", "data", "hybrid_rl/data/longtail.py",
           "if k <= MAX_OPERANDS:", "if True:",
           ("tests/unit/test_longtail.py::test_the_split_is_by_fact_line_by_line_and_keeps_the_tail",),
           "operand counts above 64 are kept: answers can exceed the 1,024-token budget"),
    # ------------------------------------------------------------------ launcher
    Mutant("launcher_exit_status_lost", "launcher", "hybrid_rl/launch.py",
           "return bad if bad > 0 else 128 - bad",
           "return 1",
           ("tests/e2e/test_grpo.py::test_a_reward_failure_on_one_rank_stops_every_rank_with_its_message",),
           "the launcher exits 1 whatever the ranks said (torchrun's habit), losing exit 2 for input errors"),
    Mutant("launcher_never_stops_the_others", "launcher", "hybrid_rl/launch.py",
           "failure_deadline = now + self.failure_grace_s",
           "failure_deadline = None",
           ("tests/unit/test_launcher.py",),
           "stop-the-other-ranks logic lost: after one rank fails the launcher waits for the others forever"),
    # ------------------------------------------------------------------ data
    Mutant("train_split_keeps_heldout_facts", "data", "hybrid_rl/data/synth_math.py",
           "keep=lambda p: not held(p), rule=train_rule)",
           "keep=None, rule=train_rule)",
           (f"{T_DATA}::test_held_out_problems_share_no_worked_fact_with_training",),
           "the held-out fact split is not applied to training: held-out problems' facts leak into SFT and RL"),
    Mutant("sampler_resumes_at_epoch_start", "data", "hybrid_rl/data/dataset.py",
           'self.epoch, self.pos = int(state["epoch"]), int(state["pos"])',
           'self.epoch, self.pos = int(state["epoch"]), 0',
           (f"{T_DATA}::test_sampler_is_deterministic_and_resumable",),
           "the prompt sampler's position is not restored: a resumed run repeats the epoch's first prompts"),
    Mutant("prompt_limit_over_all_files", "data", "hybrid_rl/data/dataset.py",
           "while not limit or len(records) < limit:",
           "while not limit or sum(report.rows_per_file.values()) < limit:",
           (f"{T_DATA}::test_load_prompts_parquet_and_jsonl",),
           "data.val_size counts over all files: the second validation set (val_seen) loads no rows"),
)  # fmt: skip

# Rough seconds per test on 2 cores (a 2-core avx2 machine's --durations: the kill-9 case 67 s for its
# references + 66 s, the dead-rank test 37 s; no vLLM engine start or other test here over 34 s): a
# guess for --list and planning, the run measures. First match wins, plus a pytest start-up per run.
EST_S = (
    ("tests/e2e/test_combinations.py::test_cell", 70),  # the fresh run, the killed run, the resume
    ("tests/e2e/test_reliability.py::test_a_dead_rank", 45),
    ("tests/e2e/", 40),
    ("tests/integration/test_ranks.py", 120),
    ("tests/integration/test_lora_sync.py", 60),  # a second torchrun with vLLM for the 1-rank case  # rank_checks.py on 1, then 2 torchrun ranks
    ("tests/integration/test_hybrid.py", 90),  # hybrid_checks.py on 2 torchrun ranks, fp32 and bf16
    (f"{T_ENG}::test_trainer_logprobs", 60),  # a vLLM engine start, a training step, a sync
    (f"{T_ENG}::test_per_prompt", 45),
    ("tests/integration/test_sandbox.py", 10),
    ("tests/integration/", 25),
    (f"{T_DATA}::test_held_out", 30),
    ("tests/unit/", 5),
)
STARTUP_S = 8
RESULT_COLOURS = {
    "killed": "tab:green",
    "survived": "tab:red",
    "error": "tab:orange",
    "timeout": "tab:purple",
    "skipped": "tab:gray",
}


def estimate_s(tests: tuple[str, ...] | list[str]) -> int:
    """A rough guess of one pytest run's seconds over ``tests`` (see :data:`EST_S`)."""
    return STARTUP_S + sum(next((s for prefix, s in EST_S if t.startswith(prefix)), 60) for t in tests)


def apply(text: str, m: Mutant) -> str:
    """``text`` with the mutant applied; ``old`` must occur exactly once."""
    n = text.count(m.old)
    if n != 1:
        raise ValueError(f"{m.name}: {m.old!r} occurs {n} times in {m.path} (must be exactly once)")
    return text.replace(m.old, m.new, 1)


def check(mutants: tuple[Mutant, ...] | list[Mutant], root: Path = ROOT) -> list[str]:
    """Problems of the catalogue, without running a test: names unique, each ``old`` exactly once in
    its file under hybrid_rl/, ``new`` different, the mutated file compiles, each test's function is in its file."""
    problems = []
    names = [m.name for m in mutants]
    problems += [f"duplicate mutant name {n!r}" for n in sorted({n for n in names if names.count(n) > 1})]
    for m in mutants:
        path = root / m.path
        if not m.path.startswith("hybrid_rl/") or not path.is_file():
            problems.append(f"{m.name}: {m.path} is not a file under hybrid_rl/")
            continue
        if m.old == m.new or not m.tests or not m.bug:
            problems.append(f"{m.name}: new equals old, or no tests, or no bug line")
        try:
            compile(apply(path.read_text(), m), str(path), "exec")
        except (ValueError, SyntaxError) as e:
            problems.append(f"{m.name}: {e}")
        problems += [f"{m.name}: {why}" for t in m.tests if (why := _missing_test(root, t))]
    return problems


def _missing_test(root: Path, node: str) -> str | None:
    """Why the test ``node`` (``file::function[params]``) cannot exist, read from the source; None if it can."""
    file, *rest = node.split("::")
    if not (root / file).is_file():
        return f"test file {file} does not exist"
    func = rest[-1].split("[")[0] if rest else None
    if func and not re.search(rf"^\s*(?:async )?def {re.escape(func)}\(", (root / file).read_text(), re.MULTILINE):
        return f"no function {func} in {file}"
    return None


def copy_tree(src: Path, dest: Path) -> int:
    """Copy the working tree's tracked and untracked-not-ignored files (as they are on disk) to ``dest``."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=src, capture_output=True, check=True).stdout
    n = 0
    for rel in sorted(set(out.decode().split("\0")) - {""}):
        s, d = src / rel, dest / rel
        if not s.exists() and not s.is_symlink():  # deleted in the working tree, still tracked
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.is_symlink():
            os.symlink(os.readlink(s), d)
        else:
            shutil.copy2(s, d)
        n += 1
    return n


def child_env(copy: Path) -> dict[str, str]:
    """The environment of every test run: the copy first on the import path, no bytecode written."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def imports_the_copy(copy: Path) -> None:
    """Fail unless ``import hybrid_rl`` in the copy's environment finds the copy (not the editable install)."""
    p = subprocess.run([sys.executable, "-c", "import hybrid_rl; print(hybrid_rl.__file__)"], cwd=copy, env=child_env(copy),
                       capture_output=True, text=True, check=False, timeout=120)  # fmt: skip
    found = Path(p.stdout.strip() or "/nonexistent").resolve()
    if copy.resolve() not in found.parents:
        raise SystemExit(f"the copy does not import its own hybrid_rl (got {p.stdout.strip() or p.stderr[-500:]})")


def run_pytest(tests: list[str], copy: Path, timeout: float, stop_first: bool = True) -> tuple[int | None, str, float]:
    """``(exit status or None on timeout, output, seconds)`` of pytest over ``tests`` in the copy. It
    runs in a session of its own, so that a timeout (or Ctrl-C here) kills its whole process group."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *(["-x"] if stop_first else []), *tests]
    start = time.perf_counter()
    code, out, _ = run_in_session(cmd, timeout, cwd=copy, env=child_env(copy), stderr=subprocess.STDOUT)
    return code, out, time.perf_counter() - start


FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def failing_ids(output: str) -> list[str]:
    """The node ids pytest's short summary reports as FAILED or ERROR, in order."""
    return FAILED_LINE.findall(output)


def classify(code: int | None, output: str, m: Mutant) -> tuple[str, str | None]:
    """``(result, killed_by)`` of one mutant's pytest run (see the module docstring)."""
    if code is None:
        return ("killed" if m.timeout_kills else "timeout"), "timeout"
    if code == 1:
        ids = failing_ids(output)
        return "killed", ids[0] if ids else "(a test failed)"
    if code == 0:
        return ("survived" if re.search(r"\d+ passed", output) else "skipped"), None
    return "error", None


def run_mutant(m: Mutant, copy: Path, timeout: float) -> dict:
    """Apply ``m`` in the copy, run its tests, restore the file; one result row."""
    path = copy / m.path
    original = path.read_text()
    try:
        path.write_text(apply(original, m))
        code, out, seconds = run_pytest(list(m.tests), copy, timeout)
    finally:
        path.write_text(original)
    result, killed_by = classify(code, out, m)
    row = {"mutant": m.name, "area": m.area, "path": m.path, "bug": m.bug, "tests": list(m.tests), "result": result,
           "killed_by": killed_by, "seconds": round(seconds, 1), "exit": code, "expected_survivor": m.expect_survivor_reason}  # fmt: skip
    if result != "killed":
        row["output_tail"] = out[-3000:]
    return row


def union_tests(mutants: list[Mutant]) -> list[str]:
    """Every named test once, unit tests first, then integration, then e2e (first-seen order within each)."""
    seen: dict[str, None] = {}
    for m in mutants:
        seen.update(dict.fromkeys(m.tests))
    kind = {"tests/unit/": 0, "tests/integration/": 1}
    return sorted(seen, key=lambda t: next((k for p, k in kind.items() if t.startswith(p)), 2))


def baseline(mutants: list[Mutant], copy: Path, timeout: float) -> dict:
    """Run every named test on the unmutated copy; stop the run (naming them) if any fails."""
    tests = union_tests(mutants)
    print(f"baseline: {len(tests)} tests, unmutated (rough guess {estimate_s(tests) / 60:.0f} min)", flush=True)
    code, out, seconds = run_pytest(tests, copy, timeout, stop_first=False)
    if code != 0:
        bad = failing_ids(out)
        why = "timed out" if code is None else f"exit {code}"
        raise SystemExit(f"baseline failed ({why}); every named test must pass unmutated first:\n  "
                         + "\n  ".join(bad or [out[-4000:]]))  # fmt: skip
    skipped = re.search(r"(\d+) skipped", out)
    if skipped:
        print(f"baseline: {skipped.group(1)} tests skipped on this machine (a mutant whose tests all skip is 'skipped')")
    print(f"baseline: passed in {seconds:.0f} s", flush=True)
    return {"tests": len(tests), "seconds": round(seconds, 1), "skipped": int(skipped.group(1)) if skipped else 0}


def plot(rows: list[dict]) -> Path:
    """results/mutants.png: seconds per mutant, coloured by result."""
    from matplotlib.patches import Patch

    fig, ax = figure((9, max(4.0, 0.26 * len(rows) + 1.2)))
    ys = range(len(rows))
    ax.barh(list(ys), [r["seconds"] for r in rows], color=[RESULT_COLOURS[r["result"]] for r in rows])
    ax.set_yticks(list(ys), [r["mutant"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (apply, run its tests, restore)")
    killed = sum(r["result"] == "killed" for r in rows)
    ax.set_title(f"Mutation run: {killed} of {len(rows)} mutants killed")
    present = [k for k in RESULT_COLOURS if any(r["result"] == k for r in rows)]
    ax.legend(handles=[Patch(color=RESULT_COLOURS[k], label=k) for k in present], fontsize=8, loc="lower right")
    return save_figure(fig, "mutants", grid_axis="x")


def _cell(text: str | None) -> str:
    return (text or "-").replace("|", "\\|").replace("\n", " ")


def markdown(payload: dict, image: bool) -> str:
    """The docs page: what a mutant is, how to run it, the machine, the table, the survivors."""
    rows, m = payload["rows"], payload["machine"]
    killed = sum(r["result"] == "killed" for r in rows)
    total = sum(r["seconds"] for r in rows) + payload["baseline"].get("seconds", 0.0)
    parts = [
        "<!-- written by benchmarks/mutants.py (make mutants); rerun it, do not edit this page -->\n",
        "# Mutation testing\n",
        "A *mutant* is one small, deliberate break in the source, of the kind a real bug makes: a flipped sign, an "
        "off-by-one, a missing normalisation, a step left out. Each is applied alone to a copy of the tree and the "
        "tests named for it are run: a failing test *kills* it; a mutant whose tests all pass *survives*, and a "
        "survivor is a missing test. The catalogue (the change, the tests, the bug it models) is "
        "`benchmarks/mutants.py`.\n",
        "Run it with `make mutants` (long, so not part of `make test`: roughly 30-40 min on 2 cores), or "
        "`python -m benchmarks.mutants --only NAME,...`; `--list` prints the catalogue and `--check` checks it "
        "without running a test. The named tests first run once unmutated (the baseline) and must all pass.\n",
        f"Measured on {m.get('cpu_count', '?')} cores ({m.get('processor') or m.get('platform', '?')}), torch "
        f"{m.get('torch', '?')}, vLLM {m.get('vllm', '?')}, commit {m.get('commit') or 'not recorded'}, "
        f"{m.get('time', '?')}: {killed} of {len(rows)} mutants killed in {total / 60:.1f} min "
        f"(baseline {payload['baseline'].get('seconds', 0.0):.0f} s).\n",
    ]
    if image:
        parts.append("![seconds per mutant](../plots/mutants.png)\n")
    parts += ["| mutant | area | the bug it models | killed by | seconds | result |", "|---|---|---|---|---|---|"]
    for r in rows:
        by = f"`{r['killed_by']}`" if r["killed_by"] else "-"
        parts.append(f"| `{r['mutant']}` | {r['area']} | {_cell(r['bug'])} | {by} | {r['seconds']:.0f} | {r['result']} |")
    left = [r for r in rows if r["result"] != "killed"]
    if left:
        parts.append("\n## Not killed\n")
        for r in left:
            why = (
                f"expected: {r['expected_survivor']}"
                if r["expected_survivor"]
                else "not expected: a test is missing or the run failed"
            )
            parts.append(f"- `{r['mutant']}` ({r['result']}, `{r['path']}`): {_cell(why)}")
    return "\n".join(parts) + "\n"


def write_outputs(rows: list[dict], base: dict, args: argparse.Namespace) -> None:
    """results/mutants.json and .png, the docs page, and the regenerated reference pages."""
    counts = {k: sum(r["result"] == k for r in rows) for k in RESULT_COLOURS}
    payload = {"benchmark": "mutants", "machine": machine_info(), "settings": {"only": args.only, "timeout_s": args.timeout},
               "baseline": base, "summary": counts, "rows": rows}  # fmt: skip
    print(f"wrote {write_json('mutants', payload)} and {plot(rows)}")
    redirected = bool(os.environ.get("HYBRID_RL_BENCH_RESULTS"))
    page = RESULTS / "mutants.md" if redirected else ROOT / "docs" / "reference" / "mutants.md"
    page.write_text(markdown(payload, image=not redirected))
    print(f"wrote {page}")
    if not redirected:  # the benchmark-results page lists every results/*.json
        subprocess.run([sys.executable, "scripts/gen_docs.py"], cwd=ROOT, check=True)


def select(only: str | None) -> list[Mutant]:
    if not only:
        return list(CATALOGUE)
    by_name = {m.name: m for m in CATALOGUE}
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def print_list(mutants: list[Mutant]) -> None:
    for m in mutants:
        flag = "  [expected survivor]" if m.expect_survivor_reason else ""
        print(f"{m.name:<34} {m.area:<13} {m.path}  ~{estimate_s(m.tests)} s{flag}\n    bug: {m.bug}")
        for t in m.tests:
            print(f"    test: {t}")
    runs = sum(estimate_s(m.tests) for m in mutants)
    base = estimate_s(union_tests(mutants))
    print(f"\n{len(mutants)} mutants; rough guess on 2 cores: baseline ~{base / 60:.0f} min + mutants ~{runs / 60:.0f} min")


def run_all(mutants: list[Mutant], args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Copy the tree, run the baseline, then every mutant: ``(baseline info, one row per mutant)``."""
    copy = Path(tempfile.mkdtemp(prefix="hybrid_rl-mutants-"))
    try:
        print(f"copied {copy_tree(ROOT, copy)} files to {copy}", flush=True)
        imports_the_copy(copy)
        base = baseline(mutants, copy, args.baseline_timeout) if not args.no_baseline else {"skipped_by_option": True}
        rows = []
        for i, m in enumerate(mutants, 1):
            row = run_mutant(m, copy, args.timeout)
            rows.append(row)
            print(
                f"[{i}/{len(mutants)}] {m.name:<34} {row['result']:<8} {row['seconds']:>6.0f} s  {row['killed_by'] or ''}",
                flush=True,
            )
        return base, rows
    finally:
        if args.keep:
            print(f"kept the copy at {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated mutant names (default: the whole catalogue)")
    ap.add_argument("--list", action="store_true", help="print the catalogue and rough times, run nothing")
    ap.add_argument("--check", action="store_true", help="check that every mutant applies once and compiles, run nothing")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant's test run (default 900)")
    ap.add_argument("--baseline-timeout", type=float, default=3600.0, help="seconds for the unmutated baseline run")
    ap.add_argument("--no-baseline", action="store_true", help="skip the baseline (only when the named tests are known to pass)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy of the tree")
    args = ap.parse_args()
    mutants = select(args.only)
    if args.list:
        print_list(mutants)
        return 0
    problems = check(mutants)
    if args.check or problems:
        print("\n".join(problems) if problems else f"{len(mutants)} mutants: each applies exactly once, compiles, and names existing tests")
        return 1 if problems else 0
    base, rows = run_all(mutants, args)
    write_outputs(rows, base, args)
    left = [r for r in rows if r["result"] != "killed"]
    for r in left:
        note = "expected" if r["expected_survivor"] else "NOT expected"
        print(f"not killed: {r['mutant']} ({r['result']}, {note})")
    for r in rows:
        if r["result"] == "killed" and r["expected_survivor"]:
            print(f"{r['mutant']} was killed by {r['killed_by']}: its expect_survivor_reason is out of date")
    print(f"{len(rows) - len(left)} of {len(rows)} mutants killed")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
