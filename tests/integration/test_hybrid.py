"""The hybrid engine on 2 real torchrun ranks (gloo): parity, staleness, aborts, memory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid") / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(HERE / "hybrid_checks.py"),
        str(out),
        "--switches",
        "50",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
    assert out.exists(), f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(out.read_text())


def by_dtype(report, dtype):
    return next(r for r in report["results"] if r["dtype"] == dtype)


def test_fp32_parity_after_sync(report):
    r = by_dtype(report, "float32")
    assert report["world_size"] == 2
    assert r["parity_max_abs_diff"] < 1e-4
    assert r["parity_after_step"] < 1e-4


def test_training_step_changes_vllm_outputs(report):
    r = by_dtype(report, "float32")
    assert r["stale_equals_before"], "the engine changed before the sync"
    assert r["change_after_step"] > 1e-3
    assert r["weights_version"] == 1  # one update, then one completed sync


def test_sync_after_aborted_generate(report):
    """An aborted generate, then a training step and a push: the engine takes the new weights
    (a push that does nothing after an abort leaves the change at 0 and the parity at its size)."""
    r = by_dtype(report, "float32")
    assert r["aborted_generate_raised"]
    assert r["generate_after_abort_ok"]
    assert r["change_after_abort_step"] > 1e-3
    assert r["parity_after_abort"] < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_push_resets_the_prefix_cache(report, dtype):
    """A prompt over three blocks, generated twice (the second from the prefix cache), then a
    training step and a push: the prompt is computed again, so the sampled tokens' log-probs are
    the new weights' (served from the stale cache they would be the old ones', off by the step's
    change, > 1e-3)."""
    r = by_dtype(report, dtype)
    assert r["prefix_full_blocks"] >= 64 and r["prefix_cached_warm"] >= r["prefix_full_blocks"] - 32, r
    assert r["prefix_cached_after_push"] == 0, r["prefix_cached_after_push"]
    if dtype == "float32":
        assert r["generated_parity_after_push"] < 1e-4


def test_fifty_switches_leave_memory_flat(report):
    for r in report["results"]:
        assert len(r["rss_mib"]) == 50
        assert r["rss_growth_mib_after_warmup"] < 32, r["rss_mib"]


def test_bf16_parity_holds_after_a_training_step(report):
    """bf16 engine weights against the trainer's bf16 compute: before any step both hold the
    initial weights whatever the sync does, so the figure that matters is after a step and a sync,
    which must be well under the step's own change (a skipped or wrong bf16 load is off by it)."""
    r = by_dtype(report, "bfloat16")
    print(f"bf16 max |logprob diff|: {r['parity_max_abs_diff']:.4f} after sync, {r['parity_after_step']:.4f} after a step "
          f"(the step changed the engine by {r['change_after_step']:.4f})")  # fmt: skip
    # measured 2026-12-03 (2 avx2-only cores): 0.0077 after the sync, 0.0079 after a step that
    # moved the engine by 2.26
    assert r["parity_max_abs_diff"] < 0.05
    assert r["change_after_step"] > 0.1
    assert r["parity_after_step"] < 0.05
