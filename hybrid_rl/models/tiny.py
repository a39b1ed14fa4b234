"""The project's own tiny causal LM, built locally in Hugging Face format.

No model hub is reachable from our machines, so hybrid_rl builds its default model itself: a
Qwen2-architecture decoder (so vLLM and transformers both load it natively), a byte-level BPE
tokenizer trained with ``tokenizers`` on the synthetic math corpus (digits split one per token,
which arithmetic needs), a Qwen-style chat template with tool-call tokens, ``config.json``,
``model.safetensors`` and ``generation_config.json``.

Shapes are named presets; ``tiny`` (~3.3M parameters) is the default because on 2 CPU cores the
training step dominates an RL step. Larger presets exist for benchmarks. A built model is cached
under ``$HYBRID_RL_CACHE/models/<preset>-<hash>`` and rebuilt only when the recipe changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from hybrid_rl.env import cache_root

BUILDER_VERSION = 2
# Positions a builtin model has unless its preset says otherwise (``max_positions``).
DEFAULT_MAX_POSITIONS = 1024

# Chat markup follows Qwen2.5 so that a user's real Qwen checkpoint and the tiny model share the
# agent loop's tool-call format. Tool results go back as a user turn wrapped in <tool_response>.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(', ') }}. "
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not "special": they must survive decoding so tool calls can be parsed from text.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ~3.3M params: the default; learns the synthetic task in minutes on 2 CPU cores.
TINY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
PRESETS: dict[str, dict[str, int]] = {
    "tiny": TINY,
    # The tiny shape with 2,048 positions: a 1,024-token answer budget after a long prompt (the
    # running-sum task of grpo_longtail); rotary positions, so no parameter more.
    "tiny-long": {**TINY, "max_positions": 2048},
    # ~0.1M params: unit tests that only need the plumbing.
    "micro": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
    # ~18M and ~100M params: benchmark shapes for the switch and the step.
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2),
    "base": dict(hidden_size=896, intermediate_size=3072, num_hidden_layers=10, num_attention_heads=14, num_key_value_heads=2),
    # ~390M params: the largest switch-benchmark shape that fits 2 ranks in 24 GiB with room to spare.
    "large": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=2),
    # Random-init models in the shape of Qwen2.5-0.5B / -1.5B (151,936-row embedding; the tokenizer
    # uses the first rows): GPU benchmark shapes, no download needed.
    "qwen0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
}


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """Train the byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hybrid_rl.data.synth_math import corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Chat markup and tool-call JSON in the corpus so role names and JSON keys get merged.
    extra = [f"{r}\n" for r in ("user", "assistant", "system", "tool")] * 200
    extra += ['<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'] * 50
    tok.train_from_iterator(list(corpus(seed)) + extra, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=4096,
    )
    fast.add_tokens(TOOL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _spec_hash(preset: str, vocab_size: int, seed: int, max_len: int) -> str:
    spec = json.dumps([BUILDER_VERSION, preset, PRESETS[preset], vocab_size, seed, max_len])
    return hashlib.sha256(spec.encode()).hexdigest()[:10]


def max_positions(preset: str) -> int:
    """The positions a builtin model of ``preset`` is built with (what prompt + response must fit)."""
    return PRESETS.get(preset, {}).get("max_positions", DEFAULT_MAX_POSITIONS)


def build_model(
    out_dir: str | Path, preset: str = "tiny", vocab_size: int = 512, seed: int = 0, max_len: int | None = None
) -> Path:
    """Build a randomly initialised model + tokenizer in HF format at ``out_dir`` (atomically);
    ``max_len``: its positions (default: the preset's)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown tiny-model preset {preset!r}; known: {', '.join(PRESETS)}")
    out = Path(out_dir)
    tok = build_tokenizer(vocab_size, seed)
    shape = dict(PRESETS[preset])
    positions = shape.pop("max_positions", DEFAULT_MAX_POSITIONS)
    config = Qwen2Config(
        vocab_size=max(len(tok), shape.pop("vocab_size", 0)),
        max_position_embeddings=max_len or positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        use_cache=False,
        dtype="float32",
        **shape,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    gen = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None, do_sample=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        gen.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "hybrid_rl_model.json").write_text(
            json.dumps({"preset": preset, "params": sum(p.numel() for p in model.parameters()), "seed": seed})
        )
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def tiny_model_path(preset: str = "tiny", vocab_size: int = 512, seed: int = 0, max_len: int | None = None) -> Path:
    """The cached folder for a preset, building it on first use (``max_len``: positions, default the preset's)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny-model preset {preset!r}; known: {', '.join(PRESETS)}")
    max_len = max_len or max_positions(preset)
    path = cache_root() / "models" / f"{preset}-{_spec_hash(preset, vocab_size, seed, max_len)}"
    if not (path / "model.safetensors").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        build_model(path, preset, vocab_size, seed, max_len)
    return path


def main() -> None:
    """CLI: ``python -m hybrid_rl.models.tiny --out DIR [--preset tiny]``."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(build_model(args.out, args.preset, seed=args.seed))


if __name__ == "__main__":
    main()
