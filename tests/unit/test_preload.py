"""trainer.preload: which libraries the launcher puts in the ranks' LD_PRELOAD, and that a rank
started with that environment really runs on them (tcmalloc's malloc, Intel's OpenMP)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybrid_rl.env import preload_libraries
from hybrid_rl.errors import ConfigError
from hybrid_rl.launch import rank_env
from tests.conftest import need

pytestmark = pytest.mark.unit


def _fake_libs(tmp_path, tcmalloc=True, iomp=True):
    libdir, prefix = tmp_path / "usr_lib", tmp_path / "venv"
    (prefix / "lib").mkdir(parents=True)
    libdir.mkdir()
    if tcmalloc:
        (libdir / "libtcmalloc_minimal.so.4").write_bytes(b"")
    if iomp:
        (prefix / "lib" / "libiomp5.so").write_bytes(b"")
    return (str(libdir),), str(prefix)


def test_auto_finds_tcmalloc_then_iomp_on_cpu(tmp_path):
    dirs, prefix = _fake_libs(tmp_path)
    found = preload_libraries("auto", "cpu", lib_dirs=dirs, prefix=prefix)
    assert [os.path.basename(p) for p in found] == ["libtcmalloc_minimal.so.4", "libiomp5.so"]
    assert preload_libraries("tcmalloc", "cpu", lib_dirs=dirs, prefix=prefix) == found[:1]
    assert preload_libraries("iomp", "cpu", lib_dirs=dirs, prefix=prefix) == found[1:]


def test_auto_is_nothing_on_cuda_or_when_off(tmp_path):
    dirs, prefix = _fake_libs(tmp_path)
    assert preload_libraries("auto", "cuda", lib_dirs=dirs, prefix=prefix) == []
    assert preload_libraries("none", "cpu", lib_dirs=dirs, prefix=prefix) == []


def test_auto_takes_what_is_installed_and_a_named_one_must_be(tmp_path):
    dirs, prefix = _fake_libs(tmp_path, tcmalloc=False)
    assert [os.path.basename(p) for p in preload_libraries("auto", "cpu", lib_dirs=dirs, prefix=prefix)] == ["libiomp5.so"]
    with pytest.raises(ConfigError, match=r"trainer.preload=tcmalloc: the library is not installed"):
        preload_libraries("tcmalloc", "cpu", lib_dirs=dirs, prefix=prefix)
    with pytest.raises(ConfigError, match=r"trainer.preload: no such library '/nope/libx.so'"):
        preload_libraries("/nope/libx.so", "cpu")


def test_rank_env_puts_the_libraries_first_and_keeps_the_users():
    env = rank_env(1, 2, 12345, base={"LD_PRELOAD": "/user/libfoo.so"}, preload=["/a/liba.so", "/user/libfoo.so"])
    assert env["LD_PRELOAD"] == "/a/liba.so:/user/libfoo.so"
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert "LD_PRELOAD" not in rank_env(0, 2, 1, base={}, preload=[])


def test_a_rank_started_with_the_preload_runs_on_tcmalloc_and_intel_openmp():
    """The real libraries of this machine (installed by scripts/setup_env.sh): a child started with
    the launcher's environment maps both, and torch's OpenMP GEMM and vLLM's import still work."""
    found = preload_libraries("auto", "cpu")
    names = {os.path.basename(p) for p in found}
    need("tcmalloc", {"libtcmalloc_minimal.so.4", "libiomp5.so"} <= names,
         f"libraries not installed here (found {sorted(names)}); scripts/setup_env.sh installs them")  # fmt: skip
    code = (
        "import torch, vllm\n"
        "a = torch.randn(256, 256); assert torch.allclose((a @ a.T), (a @ a.T).T, atol=1e-3)\n"
        "print(open('/proc/self/maps').read())\n"
    )
    env = rank_env(0, 1, 1, preload=found)
    env["OMP_NUM_THREADS"] = "2"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "libtcmalloc_minimal.so.4" in p.stdout and "libiomp5.so" in p.stdout
