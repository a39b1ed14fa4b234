"""LoRA pieces without engines: injection, the adapter-off base, the merge, names, init, checks."""

import json
from types import SimpleNamespace

import pytest
import torch

from hybrid_rl.config.groups import LoraConfig
from hybrid_rl.engine.lora import (
    adapter_config,
    adapters_disabled,
    engine_rank,
    inject,
    is_lora,
    merged,
    missing_inits,
    peft_name,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def _schema():
    from hybrid_rl.config import register_configs

    register_configs()


@pytest.fixture
def adapted(tiny_path):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    return inject(lm, LoraConfig(rank=4, alpha=12.0), seed=0, base_dtype=None), base


def test_only_adapters_train_and_the_model_starts_as_the_base(adapted):
    lm, base = adapted
    names = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert names and all(is_lora(n) for n in names)
    assert all(p.dtype == torch.float32 for n, p in lm.named_parameters() if is_lora(n))
    ids = torch.arange(3, 23).view(2, 10)
    with torch.no_grad():
        assert torch.equal(lm(ids).logits, base(ids).logits)  # B = 0


def test_adapters_off_is_the_base_and_merge_is_peft_forward(adapted):
    lm, base = adapted
    with torch.no_grad():
        for n, p in lm.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    ids = torch.arange(3, 23).view(2, 10)
    with torch.no_grad():
        on = lm(ids).logits
        with adapters_disabled(lm):
            off = lm(ids).logits
        assert (on - off).abs().max() > 1e-2
        assert torch.equal(off, base(ids).logits)
        assert all(p.requires_grad for n, p in lm.named_parameters() if is_lora(n))  # the flag only, not requires_grad
        # W + (alpha / r) B A in place of every adapted layer reproduces PEFT's forward
        sd = base.state_dict()
        adapters = {n: p for n, p in lm.named_parameters() if is_lora(n)}
        for n in [n for n in adapters if ".lora_A." in n]:
            stem = n.split(".lora_A.")[0]
            key = stem + ".weight"
            sd[key] = merged(sd[key], adapters[n], adapters[stem + ".lora_B.default.weight"], 12.0 / 4)
        base.load_state_dict(sd)
        assert (base(ids).logits - on).abs().max() < 1e-5


def test_base_held_in_the_compute_dtype(tiny_path):
    from transformers import AutoModelForCausalLM

    lm = inject(AutoModelForCausalLM.from_pretrained(tiny_path), LoraConfig(rank=4), seed=0, base_dtype=torch.bfloat16)
    assert {p.dtype for n, p in lm.named_parameters() if is_lora(n)} == {torch.float32}
    assert {p.dtype for n, p in lm.named_parameters() if not is_lora(n)} == {torch.bfloat16}


def test_target_modules_that_match_nothing_are_an_error(tiny_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="matched no"):
        inject(AutoModelForCausalLM.from_pretrained(tiny_path), LoraConfig(rank=4, target_modules=["nope_proj"]), 0, None)


def test_sharded_init_of_adapters_is_seeded_and_b_is_zero(adapted):
    lm, _ = adapted
    inits = missing_inits(lm, seed=7)
    a_name = next(n for n in inits if ".lora_A." in n)
    b_name = next(n for n in inits if ".lora_B." in n)
    a1, a2 = inits[a_name](a_name, torch.Size([4, 64])), missing_inits(lm, seed=7)[a_name](a_name, torch.Size([4, 64]))
    assert torch.equal(a1, a2) and a1.abs().max() <= 1 / 8 and a1.std() > 0.01
    assert not torch.equal(a1, missing_inits(lm, seed=8)[a_name](a_name, torch.Size([4, 64])))
    assert torch.count_nonzero(inits[b_name](b_name, torch.Size([64, 4]))) == 0


def test_names_ranks_and_adapter_config():
    assert peft_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert [engine_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError):
        engine_rank(513)
    cfg = adapter_config(SimpleNamespace(rank=16, alpha=32, dropout=0.0, target_modules=["v_proj", "q_proj"]), "/m")
    assert cfg["r"] == 16 and cfg["lora_alpha"] == 32 and cfg["target_modules"] == ["q_proj", "v_proj"] and cfg["peft_type"] == "LORA"


def test_lora_config_checks():
    from hybrid_rl.config.checks import problems
    from hybrid_rl.config.compose import compose_recipe

    cfg = compose_recipe("grpo_math_lora", "tiny")
    assert cfg.actor.lora.rank == 16 and problems(cfg, 2) == []
    cfg.actor.lora.rank, cfg.actor.lora.alpha, cfg.actor.lora.dropout, cfg.rollout.backend = 600, 0, 1.0, "hf"
    found = "; ".join(problems(cfg, 2))
    for key in ("actor.lora.rank=600 is above", "actor.lora.alpha=0", "actor.lora.dropout=1.0", "needs rollout.backend=vllm"):
        assert key in found, found
    sft = compose_recipe("sft_math", "tiny")
    sft.actor.lora.rank = 8
    assert any("LoRA trains the RL policy only" in p for p in problems(sft, 2))


def test_resume_refuses_another_lora_rank(tmp_path):
    from hybrid_rl.config.compose import compose_recipe
    from hybrid_rl.resume import REFUSED, config_changes

    assert "actor.lora.rank" in REFUSED and "actor.lora.target_modules" in REFUSED
    a, b = compose_recipe("grpo_math_lora", "tiny"), compose_recipe("grpo_math", "tiny")
    from omegaconf import OmegaConf

    changes = config_changes(OmegaConf.to_container(a), OmegaConf.to_container(b))
    assert changes["actor.lora.rank"] == (16, 0)


def test_full_fine_tune_key_of_builtin_models_ignores_the_lora_section():
    """Models cached before the LoRA section existed keep their key (no rebuild of warm starts)."""
    from omegaconf import OmegaConf

    from hybrid_rl.config.compose import compose_recipe
    from hybrid_rl.trainer.build import recipe_cache_key

    cfg = compose_recipe("sft_math_short", "tiny")
    key = recipe_cache_key(cfg)
    plain = OmegaConf.create(OmegaConf.to_container(cfg))
    del plain.actor["lora"]
    assert recipe_cache_key(plain) == key
    cfg2 = compose_recipe("sft_math_short", "tiny")
    cfg2.actor.lora.rank = 8
    assert recipe_cache_key(cfg2) != key


def test_settings_that_do_not_change_the_model_keep_the_warm_start_key():
    """actor.reshard_after_forward (when FSDP2 frees gathered weights) and actor.prefix_attention
    (which kernel computes the shared-prefix segment attention) build the same model, so they
    keep the cached warm start. The default recipe's key is pinned: a new field in model, data or
    actor changes it and rebuilds every user's warm start (minutes), so a change here must be
    meant (then update the pin)."""
    from hybrid_rl.config.compose import compose_recipe
    from hybrid_rl.trainer.build import recipe_cache_key

    cfg = compose_recipe("sft_math_short", "tiny")
    assert recipe_cache_key(cfg) == "d0e6069d2b"
    cfg.actor.reshard_after_forward = False
    assert recipe_cache_key(cfg) == "d0e6069d2b"
    cfg.actor.prefix_attention = "sdpa"
    assert recipe_cache_key(cfg) == "d0e6069d2b"


def test_adapter_export_of_a_full_fine_tune_is_refused(tmp_path, tiny_path):
    from hybrid_rl.export import export_checkpoint

    (tmp_path / "manifest.json").write_text(json.dumps({"model_dir": tiny_path, "config": {"actor": {"lora": {"rank": 0}}}}))
    with pytest.raises(ValueError, match="no adapter"):
        export_checkpoint(tmp_path, tmp_path / "out", adapter_only=True)


def test_resume_refuses_another_train_size_but_not_a_key_the_checkpoint_predates(tmp_path):
    """A checkpoint written before ``data.train_size`` existed resumes (the key is new, at its
    default); one written with another row limit is refused (its data position indexes other rows)."""
    from omegaconf import OmegaConf

    from hybrid_rl.config.compose import compose_recipe
    from hybrid_rl.resume import model_identity, resume_problems

    cfg = compose_recipe("grpo_math", "tiny")
    cfg.trainer.output_dir = str(tmp_path)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    for saved_size, refused in ((None, False), (1024, True)):
        saved = OmegaConf.to_container(cfg, resolve=True)
        if saved_size is None:
            del saved["data"]["train_size"]
        else:
            saved["data"]["train_size"] = saved_size
        manifest = {"model": model_identity(cfg.model), "config": saved, "files": []}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        problems, notes = resume_problems(cfg, resolved)
        assert bool(problems) == refused, (problems, notes)
        want = f"data.train_size: {saved_size!r} -> 0"
        assert want in (problems[0] if refused else "; ".join(notes))
