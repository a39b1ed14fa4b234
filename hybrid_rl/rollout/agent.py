"""Multi-turn agentic rollouts: generate -> parse tool calls -> run tools -> continue.

Token-in/token-out: a trajectory is the prompt ids, then for each turn the token ids the engine
generated (mask 1, with the sampler's log-probs) and the chat template's tokenised tool turn
(mask 0, log-prob 0). Text is decoded only to *parse* a turn; it is never re-tokenised.

Scheduling (``agent.scheduling``):

- ``continuous`` (default): every trajectory is its own request stream. When a turn finishes,
  its tool calls run on an asyncio loop in a background thread while the engine keeps stepping
  the other trajectories; the next turn is submitted as soon as *its* tools return. A slow tool
  call delays only its own trajectory.
- ``lockstep``: all live trajectories generate a turn together, then all their tools run, then
  the next turn — simple, but every turn waits for the slowest tool. Kept for comparison.

A trajectory ends with a turn that calls no tool (the answer), after ``max_turns`` model turns,
when the engine stops it for length, or when the response budget ``max_response_tokens`` is spent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from hybrid_rl.batch import Rollout, Sample
from hybrid_rl.rollout.base import Completion, RolloutEngine, SamplingSpec, prompt_seed
from hybrid_rl.rollout.chat import encode_tool_turn
from hybrid_rl.rollout.settings import AgentSettings
from hybrid_rl.rollout.tools import Tool, ToolCall, ToolResult


@dataclass
class Trajectory:
    record: Any
    group: int
    seed: int | None
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: str = ""
    done: bool = False

    def context(self) -> list[int]:
        return list(self.record.prompt_ids) + self.response_ids


class _AsyncRunner:
    """An asyncio loop in a daemon thread: tools' ``async execute`` run there concurrently."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class AgentLoop:
    def __init__(
        self,
        engine: RolloutEngine,
        tools: list[Tool],
        tokenizer: Any,
        settings: AgentSettings,
        parser: Callable[[str], list[ToolCall]],
    ) -> None:
        self.engine = engine
        self.tools = {t.name: t for t in tools}
        self.tokenizer = tokenizer
        self.s = settings
        self.parser = parser
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------ turn bookkeeping
    def _turn_spec(self, base: SamplingSpec, traj: Trajectory) -> SamplingSpec | None:
        budget = self.s.max_response_tokens - len(traj.response_ids)
        if budget <= 0:
            return None
        seed = None if traj.seed is None else traj.seed + 7919 * traj.turns
        return SamplingSpec(
            n=1,
            temperature=base.temperature,
            top_p=base.top_p,
            top_k=base.top_k,
            max_tokens=min(base.max_tokens, budget),
            seed=seed,
        )

    def _add_model_turn(self, traj: Trajectory, comp: Completion) -> list[ToolCall]:
        traj.response_ids += comp.token_ids
        traj.mask += [1] * len(comp.token_ids)
        traj.logprobs += comp.logprobs
        traj.turns += 1
        if comp.finish_reason != "stop":
            traj.done, traj.finish_reason = True, comp.finish_reason
            return []
        try:
            calls = self.parser(self.tokenizer.decode(comp.token_ids, skip_special_tokens=False))
        except Exception as e:  # one bad turn must not abort the batch: the model is told
            calls = [ToolCall("", {}, error=f"invalid tool call: {type(e).__name__}")]
        if not calls:
            traj.done, traj.finish_reason = True, "stop"
        elif traj.turns >= self.s.max_turns:
            traj.done, traj.finish_reason = True, "max_turns"
            calls = []
        return calls

    async def _run_calls(self, calls: list[ToolCall]) -> list[ToolResult]:
        async def one(call: ToolCall) -> ToolResult:
            if call.error:
                return ToolResult(f"error: {call.error}")
            tool = self.tools.get(call.name)
            if tool is None:
                return ToolResult(f"error: unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}")
            try:
                return await tool.execute(call.arguments)
            except Exception as e:
                return ToolResult(f"error: {type(e).__name__}: {e}")

        return list(await asyncio.gather(*(one(c) for c in calls)))

    def _truncate(self, text: str) -> str:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        limit = self.s.tool_response_max_tokens
        if len(ids) <= limit:
            return text
        keep = ids[:limit] if self.s.tool_response_keep == "head" else ids[-limit:]
        return self.tokenizer.decode(keep) + (" ...(truncated)" if self.s.tool_response_keep == "head" else "")

    def _add_tool_turn(self, traj: Trajectory, calls: list[ToolCall], results: list[ToolResult]) -> None:
        traj.tool_calls += len(calls)
        traj.tool_errors += sum(r.text.startswith("error:") for r in results)
        content = "\n".join(self._truncate(r.text) for r in results)
        # Tool output is data: text like "<|im_end|><|im_start|>user" stays text (no forged turns).
        ids = encode_tool_turn(self.tokenizer, "tool", content)
        traj.response_ids += ids
        traj.mask += [0] * len(ids)
        traj.logprobs += [0.0] * len(ids)
        if len(traj.response_ids) >= self.s.max_response_tokens:
            traj.done, traj.finish_reason = True, "length"

    @staticmethod
    def _seed(spec: SamplingSpec, i: int, k: int) -> int | None:
        """Sample k of prompt i: from the prompt's own seed when given (one request per sample)."""
        if spec.seeds is not None:
            return prompt_seed(spec.seeds[i], k)
        return None if spec.seed is None else spec.seed + 1013 * i + k

    # ------------------------------------------------------------------ schedulers
    def run(self, records: list[Any], spec: SamplingSpec, group_offset: int, weights_version: int) -> Rollout:
        trajs = [Trajectory(r, group_offset + i, self._seed(spec, i, k)) for i, r in enumerate(records) for k in range(spec.n)]
        start = time.perf_counter()
        runner = _AsyncRunner()
        try:
            if self.s.scheduling == "lockstep":
                self._lockstep(trajs, spec, runner)
            elif self.s.scheduling == "continuous":
                self._continuous(trajs, spec, runner)
            else:
                raise ValueError(f"agent scheduling {self.s.scheduling!r} must be continuous or lockstep")
        finally:
            runner.close()
        seconds = time.perf_counter() - start
        samples = [
            Sample(
                list(t.record.prompt_ids),
                t.response_ids,
                t.logprobs,
                t.mask,
                t.finish_reason,
                t.group,
                t.record.ground_truth,
                t.record.data_source,
                dict(t.record.extra_info),
            )
            for t in trajs
        ]
        n = max(len(trajs), 1)
        stats = {
            "agent/turns_mean": sum(t.turns for t in trajs) / n,
            "agent/tool_calls_mean": sum(t.tool_calls for t in trajs) / n,
            "agent/tool_call_rate": sum(t.tool_calls > 0 for t in trajs) / n,
            "agent/tool_error_rate": sum(t.tool_errors for t in trajs) / max(sum(t.tool_calls for t in trajs), 1),
            "agent/model_tokens": float(sum(sum(t.mask) for t in trajs)),
            "agent/tool_tokens": float(sum(len(t.mask) - sum(t.mask) for t in trajs)),
            "rollout/generate_s": seconds,
            "rollout/generated_tokens": float(sum(sum(t.mask) for t in trajs)),
        }
        return Rollout(samples, weights_version, stats)

    def _continuous(self, trajs: list[Trajectory], spec: SamplingSpec, runner: _AsyncRunner) -> None:
        tools_running: dict[Future, tuple[Trajectory, list[ToolCall]]] = {}
        by_id: dict[str, Trajectory] = {}

        def submit(traj: Trajectory) -> None:
            turn_spec = self._turn_spec(spec, traj)
            if turn_spec is None:
                traj.done, traj.finish_reason = True, "length"
                return
            rid = f"agent-{id(traj)}-{traj.turns}"
            by_id[rid] = traj
            self.engine.submit(rid, traj.context(), turn_spec)

        for t in trajs:
            submit(t)
        while by_id or tools_running:
            if by_id:
                for rid, comp in self.engine.poll():
                    traj = by_id.pop(rid)
                    calls = self._add_model_turn(traj, comp)
                    if calls:
                        tools_running[runner.submit(self._run_calls(calls))] = (traj, calls)
            else:
                wait_futures(list(tools_running), return_when="FIRST_COMPLETED")
            for fut in [f for f in tools_running if f.done()]:
                traj, calls = tools_running.pop(fut)
                self._add_tool_turn(traj, calls, fut.result())
                if not traj.done:
                    submit(traj)

    def _lockstep(self, trajs: list[Trajectory], spec: SamplingSpec, runner: _AsyncRunner) -> None:
        live = list(trajs)
        while live:
            specs = {id(t): self._turn_spec(spec, t) for t in live}
            for t in live:
                if specs[id(t)] is None:
                    t.done, t.finish_reason = True, "length"
            live = [t for t in live if not t.done]
            for i, t in enumerate(live):
                self.engine.submit(f"lock-{i}-{t.turns}", t.context(), specs[id(t)])
            finished: dict[str, Completion] = {}
            while self.engine.has_pending():
                finished.update(dict(self.engine.poll()))
            pending = []
            for i, t in enumerate(live):
                calls = self._add_model_turn(t, finished[f"lock-{i}-{t.turns}"])
                if calls:
                    pending.append((t, calls, runner.submit(self._run_calls(calls))))
            for t, calls, fut in pending:  # the whole turn waits for the slowest tool
                self._add_tool_turn(t, calls, fut.result())
            live = [t for t in live if not t.done]
