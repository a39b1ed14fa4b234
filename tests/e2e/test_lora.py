"""A LoRA run through the main entry point on 2 ranks: its checkpoints hold the adapters and their
optimizer only, a resumed run continues exactly, and the checkpoint exports both as a PEFT adapter
folder (which PEFT loads onto the base) and merged into the base (which transformers loads alone),
the two computing the same logits."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "+recipe=grpo_math_lora",
    "+overlay=ci_tiny",
    "algorithm.filter_groups.enable=false",
    "trainer.nproc_per_node=2",
    "trainer.save_every=1",
    "actor.lr=2e-2",
    "algorithm.kl_loss.enable=true",
    "algorithm.kl_loss.coef=0.01",
    f"reward.functions=[{{name: custom, weight: 1.0, path: {ROOT / 'tests' / 'learning' / 'digit_reward.py'}, function: score}}]",
]
COMPARED = ["critic/score/mean", "actor/loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "weights_version"]


def run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybrid_rl.main", *BASE, f"trainer.output_dir={out}", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-5000:]
    return p


def rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "critic/score/mean" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_full")
    run(out, "trainer.total_steps=3", "trainer.export_hf=true")
    return out


def test_resumed_lora_run_matches_the_uninterrupted_one(uninterrupted, tmp_path):
    run(tmp_path, "trainer.total_steps=2")
    p = run(tmp_path, "trainer.total_steps=3")
    assert "at step 2" in p.stderr + p.stdout
    got, want = rows(tmp_path), rows(uninterrupted)
    assert sorted(got) == [1, 2, 3] and want[3]["actor/grad_norm"] > 0
    for step in got:
        for key in COMPARED:
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])


def test_checkpoint_holds_adapters_and_their_optimizer_only(uninterrupted):
    ckpt = uninterrupted / "checkpoints" / "step_000003"
    saved = sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
    model = sum(f.stat().st_size for f in (uninterrupted / "hf").glob("*.safetensors"))
    # rank-16 adapters of the tiny model: 1.2 MiB, x3 with AdamW's two moments; the model is 13 MiB
    assert 0 < saved < model / 2, (saved, model)


def test_adapter_and_merged_exports_compute_the_same_logits(uninterrupted, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = uninterrupted / "checkpoints" / "step_000003"
    p = subprocess.run([sys.executable, "-m", "hybrid_rl.export", str(ckpt), str(tmp_path / "adapter"), "--adapter"],
                       capture_output=True, text=True, cwd=ROOT, check=False)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 16
    base_dir = json.loads((ckpt / "manifest.json").read_text())["model_dir"]
    ids = torch.arange(5, 45).view(2, 20)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(uninterrupted / "hf", dtype=torch.float32)(ids).logits  # the end-of-run export
    assert (adapted - plain).abs().max() > 0.1  # the adapters were trained
    assert (adapted - merged).abs().max() < 1e-4, (adapted - merged).abs().max()
