"""The sandbox's seccomp filter: a deny-list built with libseccomp (``pyseccomp``), exported as the
BPF program bubblewrap loads with ``--seccomp FD`` just before it execs the sandboxed command."""

from __future__ import annotations

import functools
import tempfile

# Syscalls a test program never needs, refused with EPERM (deny-list: an allow-list breaks on
# every new libc). Keyring: a channel between calls and a per-uid quota; io_uring and
# userfaultfd: kernel attack surface; ptrace/process_vm_*: other processes' memory; the rest:
# mounts, namespaces, modules, kexec, perf, bpf and system-wide state.
DENIED_SYSCALLS = (
    "add_key", "keyctl", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "userfaultfd", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "perf_event_open", "bpf", "fanotify_init", "open_by_handle_at", "name_to_handle_at",
    "mount", "umount2", "pivot_root", "chroot", "setns", "unshare", "move_mount", "open_tree", "fsopen", "fsmount",
    "fsconfig", "fspick", "mount_setattr",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "adjtimex",
    "sethostname", "setdomainname", "lookup_dcookie", "vhangup", "personality",
)  # fmt: skip
ALLOWED_SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6


@functools.cache
def seccomp_filter() -> bytes:
    """The seccomp BPF program (native arch; other ABIs are killed by libseccomp's default)."""
    import errno

    import pyseccomp as sc

    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError, OSError):  # not a syscall on this arch / kernel headers
            continue
    for call in ("socket", "socketpair"):
        for family in range(64):
            if family not in ALLOWED_SOCKET_FAMILIES:
                f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.EQ, family))
        f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.GE, 64))
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.seek(0)
        return fh.read()
