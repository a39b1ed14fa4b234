"""A rollout backend on transformers' own ``generate`` (``rollout.backend=hf``): no vLLM needed.

What it is for: the GPU check on machines without vLLM, a fallback where vLLM does not install,
and the proof that a backend is a few files (this module, one line in ``rollout/backends.py``, its
test). It is slower than vLLM (no paged KV cache, no prefix sharing: each of the ``n`` samples of a
prompt pre-fills its own copy) and says so in :class:`GenerateStats` (``cached_prompt_tokens=0``).

Semantics follow the vLLM backend so the trainer cannot tell them apart:

- log-probs are those of the distribution actually sampled from (vLLM's ``processed_logprobs``):
  ``log_softmax`` of the logits after temperature, top-k, then top-p (transformers' warpers, in
  that order), which is what the trainer's head computes (:func:`hybrid_rl.engine.heads.truncate_logits`);
- sampling defaults come from the :class:`SamplingSpec` only, never from the checkpoint's
  ``generation_config.json`` (Qwen's ships ``repetition_penalty=1.1`` and ``top_k=20``; vLLM also
  ignores them when it is handed explicit sampling parameters);
- the response ends with the EOS token (kept in ``token_ids``, as vLLM does) or at ``max_tokens``;
- seeds: one ``torch`` generator state per call, derived from the per-prompt seeds (each row
  draws its own noise, so no two prompts share a sample's noise); the global RNG is untouched.

Weights: :meth:`load_weights` copies HF-named tensors into the model in place (the parameter map
is built once); a tied LM head is skipped, it is the embedding. ``sleep`` on CUDA moves the
weights to host memory and ``wake_up`` brings them back; on CPU it frees nothing and says so.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import Tensor

from hybrid_rl.rollout.base import Completion, GenerateStats, GenerationResult, SamplingSpec, prompt_seed
from hybrid_rl.rollout.settings import EngineSettings


class HFRollout:
    """transformers' ``AutoModelForCausalLM.generate`` behind :class:`RolloutEngine`."""

    def __init__(
        self,
        model_path: str,
        cfg: EngineSettings,
        dtype: str,
        seed: int,
        device: torch.device,
        max_model_len: int,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from hybrid_rl.engine.fsdp import to_dtype

        start = time.perf_counter()
        self.device = device
        self.seed = seed
        self.max_model_len = max_model_len
        # Rows generated together; more prompts than this go in several calls (bounds the KV cache).
        self.max_batch = int(cfg.max_num_seqs or 256)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=to_dtype(dtype), attn_implementation="sdpa", trust_remote_code=trust_remote_code
        ).to(device)
        self.model.eval().requires_grad_(False)
        self._tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not self.eos_ids and self._tokenizer.eos_token_id is not None:
            self.eos_ids = [self._tokenizer.eos_token_id]
        pad = self._tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self._params = {n: p for n, p in self.model.named_parameters() if not (tied and n == "lm_head.weight")}
        self.supports_sleep = device.type == "cuda"
        self.sleeping = False
        self.last_stats = GenerateStats()
        self._queue: list[tuple[str, list[int], SamplingSpec]] = []
        self._calls = 0
        self.start_seconds = time.perf_counter() - start

    @property
    def tokenizer(self):
        return self._tokenizer

    # ---------------------------------------------------------------- generation
    def _generation_config(self, spec: SamplingSpec, n: int):
        from transformers import GenerationConfig

        greedy = spec.temperature <= 0
        eos = list(self.eos_ids) + list(spec.stop_token_ids or [])
        return GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else spec.temperature,
            top_k=None if greedy or spec.top_k is None or spec.top_k < 0 else spec.top_k,
            top_p=None if greedy else spec.top_p,
            max_new_tokens=spec.max_tokens,
            min_new_tokens=spec.max_tokens if spec.ignore_eos else None,
            eos_token_id=None if spec.ignore_eos else (eos or None),
            pad_token_id=self.pad_id,
            num_return_sequences=n,
            stop_strings=spec.stop or None,
            output_scores=spec.logprobs,
            return_dict_in_generate=True,
            use_cache=True,
        )

    def _seed(self, spec: SamplingSpec, n_prompts: int) -> int:
        if spec.seeds is not None:
            if len(spec.seeds) != n_prompts:
                raise ValueError(f"SamplingSpec.seeds has {len(spec.seeds)} seeds for {n_prompts} prompts")
            return prompt_seed(*spec.seeds)
        if spec.seed is not None:
            return int(spec.seed)
        self._calls += 1
        return prompt_seed(self.seed, self._calls)

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], spec: SamplingSpec, seed: int) -> list[list[Completion]]:
        """One ``generate`` call: left-padded prompts, ``spec.n`` rows each."""
        n = spec.n
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        config = self._generation_config(spec, n)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=config,
                tokenizer=self._tokenizer if spec.stop else None,
            )
        new = out.sequences[:, width:].cpu()
        if spec.logprobs and out.scores:
            scores = torch.stack(out.scores, 1).float()  # [rows, T, V], processed (after the warpers)
            lps = torch.log_softmax(scores, -1).gather(-1, new[:, : scores.shape[1]].unsqueeze(-1)).squeeze(-1).cpu()
        else:
            lps = torch.zeros(new.shape, dtype=torch.float32)
        eos = set(self.eos_ids) | set(spec.stop_token_ids or [])
        results: list[list[Completion]] = []
        for i in range(len(prompts)):
            comps = []
            for j in range(n):
                comps.append(self._completion(new[i * n + j].tolist(), lps[i * n + j].tolist(), spec, eos))
            results.append(comps)
        return results

    def _completion(self, tokens: list[int], lps: list[float], spec: SamplingSpec, eos: set[int]) -> Completion:
        """Cut one generated row where it ended and say why: at the first EOS / stop token (kept,
        as vLLM keeps it), or at the token that completed a stop string (the rows after it are
        padding), else at ``max_tokens``."""
        end, reason = len(tokens), "length"
        if not spec.ignore_eos:
            for t, tok in enumerate(tokens):
                if tok in eos:
                    end, reason = t + 1, "stop"
                    break
        stop_at = None
        if spec.stop:
            for t in range(end):
                text = self._tokenizer.decode(tokens[: t + 1], skip_special_tokens=True)
                hits = [(text.find(s), s) for s in spec.stop if s in text]
                if hits:
                    end, reason, stop_at = t + 1, "stop", min(hits)
                    break
        tokens, lps = tokens[:end], lps[:end]
        text = self._tokenizer.decode(tokens, skip_special_tokens=True)
        if stop_at is not None:
            at, s = stop_at
            text = text[: at + len(s)] if spec.include_stop_str_in_output else text[:at]
        return Completion(tokens, lps, reason, text)

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[GenerationResult]:
        """``spec.n`` samples per prompt, in calls of at most ``max_num_seqs`` rows."""
        if not prompts:
            self.last_stats = GenerateStats()
            return []
        for p in prompts:
            if len(p) + spec.max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt of {len(p)} tokens + max_tokens {spec.max_tokens} exceeds max_model_len {self.max_model_len}"
                )
        seed = self._seed(spec, len(prompts))
        start = time.perf_counter()
        per_call = max(1, self.max_batch // max(spec.n, 1))
        comps: list[list[Completion]] = []
        for k in range(0, len(prompts), per_call):
            comps.extend(self._generate_batch(prompts[k : k + per_call], spec, prompt_seed(seed, k)))
        seconds = time.perf_counter() - start
        results = [GenerationResult(list(p), c) for p, c in zip(prompts, comps, strict=True)]
        self.last_stats = GenerateStats(
            prompt_tokens=sum(len(p) for p in prompts) * spec.n,
            cached_prompt_tokens=0,
            generated_tokens=sum(len(c.token_ids) for cs in comps for c in cs),
            seconds=seconds,
            extra={"backend": "hf"},
        )
        return results

    # Multi-turn: requests queue up and the next poll generates them all in one batch (grouped
    # by sampling settings). No continuous batching: a turn waits for the slowest of its batch.
    def submit(self, request_id: str, prompt_ids: list[int], spec: SamplingSpec) -> None:
        if spec.n != 1:
            raise ValueError("submit takes one sample per request (spec.n == 1)")
        self._queue.append((request_id, list(prompt_ids), spec))

    def poll(self) -> list[tuple[str, Completion]]:
        queue, self._queue = self._queue, []
        groups: dict[str, list[tuple[str, list[int], SamplingSpec]]] = {}
        for item in queue:
            s = item[2]
            key = repr((s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop, s.stop_token_ids, s.include_stop_str_in_output))
            groups.setdefault(key, []).append(item)
        done = []
        for items in groups.values():
            spec = items[0][2]
            seeds = [s.seed if s.seed is not None else prompt_seed(self.seed, i) for i, (_, _, s) in enumerate(items)]
            batch_spec = SamplingSpec(**{**spec.__dict__, "n": 1, "seed": None, "seeds": seeds})
            out = self.generate([p for _, p, _ in items], batch_spec)
            done.extend((rid, g.completions[0]) for (rid, _, _), g in zip(items, out, strict=True))
        return done

    def has_pending(self) -> bool:
        return bool(self._queue)

    # ---------------------------------------------------------------- weights and memory
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named full tensors into the model in place (consumed lazily, one at a time)."""
        seen = set()
        for name, tensor in weights:
            param = self._params.get(name)
            if param is None:
                if name == "lm_head.weight":
                    continue  # tied to the embedding
                raise KeyError(f"load_weights: {name!r} is not a parameter of the rollout model")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, the model {tuple(param.shape)}")
            param.copy_(tensor)
            seen.add(name)
        missing = set(self._params) - seen
        if missing:
            raise KeyError(f"load_weights: no tensor for {sorted(missing)[:5]} ({len(missing)} parameters)")

    def reset_prefix_cache(self) -> None:
        """Nothing to reset: every generate pre-fills from scratch."""

    def sleep(self, level: int = 1) -> bool:
        """CUDA: weights to host memory (any level); returns whether device memory was freed."""
        if not self.supports_sleep:
            return False
        self.model.to("cpu")
        torch.cuda.empty_cache()
        self.sleeping = True
        return True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.supports_sleep and self.sleeping and (tags is None or "weights" in tags):
            self.model.to(self.device)
            self.sleeping = False

    def shutdown(self) -> None:
        """Nothing runs in the background."""

    def memory_report(self) -> dict[str, int]:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        report = {"kv_cache_bytes": 0, "weights_bytes": int(weights)}
        if self.device.type == "cuda":
            report["cuda_allocated_bytes"] = int(torch.cuda.memory_allocated(self.device))
        return report
