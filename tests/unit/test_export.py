"""``python -m hybrid_rl.export`` on tiny distributed checkpoints written here (the micro model's
tensors, shifted so they differ from the model folder's): what lands on disk, read back from the
safetensors headers and through ``transformers``.

- An export into a folder that already holds a model is refused (exit 2, nothing read or touched)
  unless ``--overwrite``, which leaves exactly the new export: new shard names never replace an
  old ``model.safetensors``, and ``transformers`` would load the old weights beside them.
- ``config.json``'s ``dtype`` and ``torch_dtype`` both name the dtype the shards hold, so
  ``dtype="auto"`` (and vLLM's default) loads what was written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

PREFIX = "app.model.lm."
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def save_dcp(state: dict[str, torch.Tensor], ckpt: Path, model_dir: str, lora: dict | None) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt)), no_dist=True)
    config = {"actor": {"lora": lora or {"rank": 0}}}
    (ckpt / "manifest.json").write_text(json.dumps({"model_dir": model_dir, "step": 3, "config": config}))


def base_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


@pytest.fixture(scope="module")
def full_ckpt(tmp_path_factory, micro_path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A full fine-tune's checkpoint (fp32, tied head saved as the trainer saves it) and its tensors."""
    ckpt = tmp_path_factory.mktemp("full") / "step_000003"
    tensors = {k: t + 0.25 for k, t in base_tensors(micro_path).items()}
    state = {PREFIX + k: t.clone() for k, t in tensors.items()}
    state[PREFIX + "lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_dcp(state, ckpt, micro_path, None)
    return ckpt, tensors


@pytest.fixture(scope="module")
def lora_ckpt(tmp_path_factory, micro_path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A LoRA run's checkpoint (adapters only) and the merged tensors it stands for."""
    from hybrid_rl.engine.lora import merged

    ckpt = tmp_path_factory.mktemp("lora") / "step_000003"
    base = base_tensors(micro_path)
    gen = torch.Generator().manual_seed(0)
    state, want = {}, dict(base)
    for key, w in base.items():
        if key.endswith(("q_proj.weight", "v_proj.weight")):
            stem = key.removesuffix(".weight")
            a = torch.randn(LORA["rank"], w.shape[1], generator=gen)
            b = torch.randn(w.shape[0], LORA["rank"], generator=gen)
            state[f"{PREFIX}{stem}.lora_A.default.weight"], state[f"{PREFIX}{stem}.lora_B.default.weight"] = a, b
            want[key] = merged(w, a, b, LORA["alpha"] / LORA["rank"])
    save_dcp(state, ckpt, micro_path, LORA)
    return ckpt, want


def export(ckpt: Path, out: Path, *flags: str) -> int:
    from hybrid_rl.export import main

    return main([str(ckpt), str(out), *flags])


def digest(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def stored_dtypes(folder: Path) -> set[str]:
    """The dtype of every tensor in every safetensors file, from the file headers (no load, no cast)."""
    from safetensors import safe_open

    found = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            found |= {ST_DTYPES[f.get_slice(k).get_dtype()] for k in f.keys()}
    return found


def assert_loads(out: Path, want: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for key, t in want.items():
        assert torch.equal(sd[key], t), key


def test_a_folder_holding_a_model_is_refused_and_overwrite_leaves_only_the_new_export(
    full_ckpt, micro_path, tmp_path, capsys, monkeypatch
):
    """The stale-weights case: an older single-file model where the export writes shards."""
    import torch.distributed.checkpoint as dcp

    ckpt, tensors = full_ckpt
    out = tmp_path / "model"
    shutil.copytree(micro_path, out)  # model.safetensors holds the base weights, not the checkpoint's
    before = digest(out)

    def no_read(*a, **k):
        raise AssertionError("a refused export read tensors")

    with monkeypatch.context() as m:
        m.setattr(dcp, "load", no_read)
        assert export(ckpt, out) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(out) in err and "--overwrite" in err and "model.safetensors" in err, err
    assert digest(out) == before

    assert export(ckpt, out, "--overwrite", "--shard-mb", "0") == 0  # one shard per tensor
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {f.name for f in out.glob("*.safetensors")} == set(index["weight_map"].values())
    assert_loads(out, tensors)

    # again, into its own earlier export, now one shard: none of the earlier shards remain
    assert export(ckpt, out, "--overwrite") == 0
    assert sorted(f.name for f in out.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert_loads(out, tensors)


def test_overwrite_swaps_a_merged_export_and_an_adapter_folder_without_a_mix(lora_ckpt, tmp_path):
    ckpt, want = lora_ckpt
    out = tmp_path / "out"
    assert export(ckpt, out) == 0
    assert export(ckpt, out, "--adapter") == 2
    assert export(ckpt, out, "--adapter", "--overwrite") == 0
    left = {f.name for f in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= left
    assert not left & {"config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors"}, left
    assert export(ckpt, out, "--overwrite") == 0
    assert not {f.name for f in out.iterdir()} & {"adapter_model.safetensors", "adapter_config.json"}
    assert_loads(out, want)


def test_the_api_refuses_a_non_empty_folder_unless_overwrite(full_ckpt, tmp_path):
    """How the end of a run and the eval call it, into their own folder."""
    from hybrid_rl.export import export_checkpoint

    ckpt, tensors = full_ckpt
    export_checkpoint(ckpt, tmp_path / "hf")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_checkpoint(ckpt, tmp_path / "hf")
    info = export_checkpoint(ckpt, tmp_path / "hf", overwrite=True)
    assert "model-00001-of-00001.safetensors" in info["removed"]
    assert_loads(tmp_path / "hf", tensors)
    with pytest.raises(ValueError, match="reads from"):  # never the source folder, even with overwrite
        export_checkpoint(ckpt, ckpt, overwrite=True)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
@pytest.mark.parametrize("kind", ["full", "merged", "adapter"])
def test_config_dtype_names_the_dtype_on_disk(kind, dtype, full_ckpt, lora_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = (full_ckpt if kind == "full" else lora_ckpt)[0]
    out = tmp_path / "out"
    assert export(ckpt, out, *(["--dtype", dtype] if dtype else []), *(["--adapter"] if kind == "adapter" else [])) == 0
    want = dtype or "float32"  # as saved: fp32 masters, and the micro model's fp32 base
    assert stored_dtypes(out) == {want}
    if kind == "adapter":  # PEFT's config has no dtype field; nothing there may contradict the file
        config = json.loads((out / "adapter_config.json").read_text())
        assert {v for k, v in config.items() if "dtype" in k} <= {want}, config
        return
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == want, config
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {getattr(torch, want)}


def test_an_eval_of_a_checkpoint_exports_again_into_its_own_folder(full_ckpt, tmp_path):
    """A second eval into the same output_dir replaces ``output_dir/model`` instead of failing."""
    from types import SimpleNamespace

    from hybrid_rl.trainer.evaluate import model_folder

    ckpt, tensors = full_ckpt
    for _ in range(2):
        assert model_folder(str(ckpt), tmp_path, SimpleNamespace(is_main=True)) == str(tmp_path / "model")
    assert_loads(tmp_path / "model", tensors)
