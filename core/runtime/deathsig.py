"""Children that die with their parent: PR_SET_PDEATHSIG set between fork and exec.

Why: a job's processes must never outlive the process that owns them, even when that owner is SIGKILLed
and has no chance to clean up (the local supervisor, a pod's entry point run outside a container).
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded now: no dlopen between fork and exec


def die_with(parent: int) -> None:
    """The calling process gets SIGKILL when its parent dies; it exits now if `parent` is no longer its
    parent (it died before the prctl took effect)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def die_with_parent(oom_score_adj: bytes | None = None) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGKILL when the calling process dies; optionally it also raises
    its own oom_score_adj (no privilege needed), so the OOM killer and the hub's watchdog take it first."""
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec: no imports, no allocation-heavy work
        die_with(parent)
        if oom_score_adj is not None:
            try:
                fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
                try:
                    os.write(fd, oom_score_adj)
                finally:
                    os.close(fd)
            except OSError:
                pass

    return preexec
