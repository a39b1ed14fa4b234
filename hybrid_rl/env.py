"""Process environment that vLLM's CPU backend, torch and the HF libraries need.

Call :func:`setup_process_env` before importing torch or vllm (``hybrid_rl.main`` and
``tests/conftest.py`` do), so a user sets nothing by hand. Every value is a default: a variable
the user already exported wins.

Why each one (measured on 2-core CPU machines, see FEASIBILITY.md in the design notes):

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine runs in the trainer's own process. Engine start
  drops from 15-26 s to 2.5-4.4 s, and weight pushes are plain function calls (tensors are passed
  by reference, no serialisation).
- ``OMP_NUM_THREADS``: one OpenMP thread per rank unless the user says otherwise; with several
  ranks on few cores oversubscription costs more than it gains.
- ``VLLM_CPU_KVCACHE_SPACE``: if unset vLLM reserves ~0.9 x RAM for the KV cache; we size the
  cache explicitly per engine (``rollout.kv_cache_gib``), this is only the fallback.
- ``VLLM_CACHE_ROOT`` / ``HF_HOME``: somewhere of ours, never a shared home directory.
- ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``: no hub is reachable; fail fast instead of
  retrying network calls for local folders.
- ``TOKENIZERS_PARALLELISM=false``: the tokenizer's thread pool deadlocks after ``fork``.

Preloaded libraries (:func:`preload_libraries`, ``trainer.preload``): vLLM's CPU backend asks for
tcmalloc and Intel's OpenMP runtime in ``LD_PRELOAD`` (it warns "libtcmalloc is not found in
LD_PRELOAD" otherwise). A library can only be preloaded before the process starts, so the
launcher that starts the ranks sets it: tcmalloc from Debian's ``libtcmalloc-minimal4``
(``scripts/setup_env.sh`` installs it), ``libiomp5.so`` from the ``intel-openmp`` wheel vLLM's
CPU build depends on (``<venv>/lib``). Measured with and without in the README's Benchmarks.

AMX tile permission (:func:`request_amx_permission`): on x86 CPUs with AMX (``amx_tile`` in
``/proc/cpuinfo``, Intel Sapphire Rapids and later) Linux hands a process the large AMX tile
register state only after it asks with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``;
the first AMX instruction of a process that did not ask dies with SIGILL. oneDNN (torch's bf16
GEMMs) asks for itself, vLLM's CPU kernels do not: a bf16 vLLM engine's first generate in a fresh
process crashed with signal 4 on such a machine. :func:`setup_process_env` and the vLLM engine
wrapper therefore ask, once per process, before any engine is built. Permission is per process
and inherited by threads and by children forked afterwards, so asking early covers all of them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

from hybrid_rl.errors import AMXPermissionError  # re-exported

# x86_64 arch_prctl(2): syscall number and the extended-state permission codes (asm/prctl.h).
_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags Linux reports (empty where there is no ``/proc/cpuinfo``)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_bf16_support(flags: frozenset[str] | None = None) -> str | None:
    """Which bf16 matrix unit the CPU has: ``"amx_bf16"``, ``"avx512_bf16"`` or None."""
    flags = cpu_flags() if flags is None else flags
    for name in ("amx_bf16", "avx512_bf16"):
        if name in flags:
            return name
    return None


def auto_dtype(device_type: str = "cpu", flags: frozenset[str] | None = None) -> str:
    """What ``auto`` precision means on this hardware: ``"bfloat16"`` where bf16 matrix math is
    native (CUDA devices that support it; CPUs with ``amx_bf16`` or ``avx512_bf16``), else
    ``"float32"`` (a CPU without those flags emulates bf16 GEMMs, slower than fp32)."""
    if device_type == "cuda":
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_bf16_support(flags) else "float32"


def _arch_prctl(code: int, arg: int) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_int(code), ctypes.c_ulong(arg))
    return int(rc), ctypes.get_errno()


@functools.cache
def request_amx_permission(cpuinfo: str = "/proc/cpuinfo") -> str:
    """Ask Linux for AMX tile state where the CPU has AMX; returns what happened.

    ``"granted"`` (asked and given, or already held), ``"not-needed"`` (no ``amx_tile`` flag, or
    not x86_64 Linux). Raises :class:`AMXPermissionError` (one line, with errno) if the kernel
    refuses: continuing would end in SIGILL inside vLLM's bf16 kernels. Cached per process.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return "not-needed"
    if "amx_tile" not in cpu_flags(cpuinfo):
        return "not-needed"
    rc, err = _arch_prctl(_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    if rc != 0:
        raise AMXPermissionError(
            f"the CPU has AMX but arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: {os.strerror(err)} "
            f"(errno {err}); bf16 vLLM kernels would die with SIGILL. Use a kernel >= 5.16 or rollout.dtype=float32"
        )
    return "granted"


# Where Debian and the usual distributions put them; the venv's own lib/ for Intel's OpenMP.
_TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def preload_libraries(
    mode: str = "auto", device: str = "auto", lib_dirs: tuple[str, ...] | None = None, prefix: str | None = None
) -> list[str]:
    """The shared libraries the launcher puts in the ranks' ``LD_PRELOAD``.

    ``mode``: ``auto`` (tcmalloc and Intel OpenMP on CPU, whichever is installed; nothing on
    CUDA, where vLLM asks for neither), ``none``, ``tcmalloc``, ``iomp``, or a colon-separated
    list of library paths (each must exist). ``device`` is ``trainer.device``; ``auto`` counts as
    CUDA where the NVIDIA driver's device node exists (torch is not imported here: the launcher
    stays small). Returns absolute paths, in preload order.
    """
    import sys

    from hybrid_rl.errors import ConfigError

    if mode in ("none", "", None):
        return []
    if mode not in ("auto", "tcmalloc", "iomp"):
        paths = [p for p in str(mode).split(":") if p]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise ConfigError(f"trainer.preload: no such library {missing[0]!r} (use auto, none, tcmalloc, iomp or paths)")
        return paths
    cuda = device == "cuda" or (
        device == "auto" and os.path.exists("/dev/nvidiactl") and os.environ.get("HYBRID_RL_FORCE_CPU") != "1"
    )
    if mode == "auto" and cuda:
        return []
    dirs = lib_dirs if lib_dirs is not None else _LIB_DIRS
    found: list[str] = []
    if mode in ("auto", "tcmalloc"):
        tc = next((os.path.join(d, n) for n in _TCMALLOC for d in dirs if os.path.isfile(os.path.join(d, n))), None)
        if tc:
            found.append(tc)
    if mode in ("auto", "iomp"):
        iomp = os.path.join(prefix if prefix is not None else sys.prefix, "lib", "libiomp5.so")
        if os.path.isfile(iomp):
            found.append(iomp)
    if mode != "auto" and not found:
        raise ConfigError(f"trainer.preload={mode}: the library is not installed (see scripts/setup_env.sh)")
    return found


def cache_root() -> Path:
    """Where hybrid_rl keeps generated models, datasets and library caches."""
    root = os.environ.get("HYBRID_RL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hybrid_rl"
    )
    return Path(root)


def setup_process_env(threads_per_rank: int | None = None) -> None:
    """Set the environment variables the stack needs, keeping any the user set."""
    root = cache_root()
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_CONFIGURE_LOGGING": "1",
        "HF_HOME": str(root / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "error",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if threads_per_rank is not None:
        defaults["OMP_NUM_THREADS"] = str(threads_per_rank)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    request_amx_permission()
