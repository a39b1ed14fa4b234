"""AMX tile permission: a bf16 vLLM engine must generate in a fresh process on any CPU.

On CPUs with AMX, vLLM's CPU bf16 kernels die with SIGILL in a process that never asked Linux for
the AMX tile state (issue: `make test` failed on such a machine). The engine wrapper asks; these
tests check it in a process where nothing else (no torch bf16 matmul, no conftest) asked first.
"""

import subprocess
import sys
import textwrap

import pytest

from hybrid_rl.env import AMXPermissionError, cpu_bf16_support, cpu_flags, request_amx_permission

FRESH_BF16_ENGINE = textwrap.dedent(
    """
    import sys
    import torch
    from hybrid_rl.config import RolloutConfig
    from hybrid_rl.rollout.base import SamplingSpec
    from hybrid_rl.rollout.vllm_engine import VLLMRollout

    # No setup_process_env and no torch bf16 op here: the wrapper alone must ask for AMX.
    eng = VLLMRollout(sys.argv[1], RolloutConfig(block_size=32, kv_cache_gib=0.05), "bfloat16",
                      seed=0, device=torch.device("cpu"), max_model_len=128)
    res = eng.generate([[1, 2, 3, 4, 5]], SamplingSpec(n=2, max_tokens=8, temperature=1.0, seed=3))
    n = sum(len(c.token_ids) for c in res[0].completions)
    print("GENERATED", n)
    """
)


@pytest.mark.unit
def test_no_amx_flag_means_nothing_to_ask(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse2 avx512f avx512_bf16\n")
    assert request_amx_permission.__wrapped__(str(info)) == "not-needed"
    assert cpu_bf16_support(cpu_flags(str(info))) == "avx512_bf16"
    assert cpu_bf16_support(frozenset({"amx_bf16", "avx512_bf16"})) == "amx_bf16"
    assert cpu_bf16_support(frozenset({"sse2"})) is None


@pytest.mark.unit
def test_amx_request_is_granted_or_fails_with_one_clear_line(tmp_path):
    """A CPU claiming AMX: the real syscall runs. On real AMX hardware it is granted; elsewhere
    the kernel refuses (EOPNOTSUPP) and the error names arch_prctl and the way out."""
    info = tmp_path / "cpuinfo"
    info.write_text("flags : fpu amx_tile amx_bf16\n")
    real_amx = "amx_tile" in cpu_flags()
    try:
        assert request_amx_permission.__wrapped__(str(info)) == "granted"
        assert real_amx
    except AMXPermissionError as err:
        assert not real_amx
        msg = str(err)
        assert "\n" not in msg and "arch_prctl" in msg and "rollout.dtype=float32" in msg


@pytest.mark.integration
@pytest.mark.skipif(
    cpu_bf16_support() is None, reason="CPU has neither amx_bf16 nor avx512_bf16: vLLM CPU runs bf16 slowly or not at all"
)
def test_bf16_vllm_engine_generates_in_a_fresh_process(micro_path):
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_BF16_ENGINE, micro_path], check=False, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (-4/132 is SIGILL)\n{proc.stderr[-3000:]}"
    assert "GENERATED" in proc.stdout and int(proc.stdout.split("GENERATED")[1].split()[0]) > 0
