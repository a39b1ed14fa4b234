"""1 rank vs 2 ranks on the same batch: the same gradient for every loss aggregation mode, and
one KL coefficient on every rank (rank_checks.py does the work under real torchrun)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_rl.config import LOSS_AGG_MODES

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "rank_checks.py"


def run(out: Path, ranks: int) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd = [*(launcher if ranks > 1 else [sys.executable]), str(SCRIPT), str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
    assert out.exists(), f"rank checks failed ({p.returncode}):\n{p.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("ranks")
    return run(d / "one.json", 1), run(d / "two.json", 2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_one_and_two_ranks_give_the_same_gradient(reports, mode):
    one, two = reports[0]["grads"][mode], reports[1]["grads"][mode]
    assert reports[1]["world_size"] == 2 and one.keys() == two.keys()
    worst = max(abs(a - b) for k in one for a, b in zip(one[k], two[k], strict=True))
    assert worst < 1e-5, f"{mode}: max |grad_1 - grad_2| = {worst}"
    assert max(abs(v) for k in one for v in one[k]) > 1e-4  # a real, non-zero gradient


def test_kl_controller_is_the_same_on_every_rank(reports):
    coefs = reports[1]["kl_coef_per_rank"]
    assert len(coefs) == 2 and coefs[0] == coefs[1]
    assert coefs[0] != 0.1  # it did adapt
