"""The kernel's warm pool for local jobs: one waiting supervisor whose fork server imported TensorFlow.

Why: a job's supervisor forks its tasks from one TensorFlow import (runtime.forkserver), but that import
still takes seconds at the job's start. When the extension loads (TFDIST_POOL_ON_LOAD, local backend) and
after each job of this kernel, a warm supervisor (tfdist.runtime.warmpool) is started with its fork server
(at most TFDIST_POOL_SIZE pooled processes per server, TFDIST_POOL_MEMORY bytes); the next `%%tfdist run`
of this kernel hands it the job instead of starting a supervisor, and its tasks are forked at once (or as
soon as the server's import is done).

Bounds and ownership: the pool is this kernel's alone (a child of the kernel, in the user's state
directory: never shared between users). Its stdin is the kernel's pipe, the same lifeline as a job's, and
its fork server dies with it (PR_SET_PDEATHSIG), so nothing of it outlives the kernel. It is started only when
the server's memory stays under START_SHARE of its limit with it, it ends itself while idle when the
server's use crosses warmpool.DROP_SHARE, and the magic counts it as free memory when it checks a job
(the job turns the pool's processes into its own, or the pool is dropped first).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from .. import memfit
from ..procid import ProcessId
from ..settings import ENV_POOL_MEMORY, ENV_POOL_SIZE, KernelSettings, groups

SIZE_ENV, MEMORY_ENV = ENV_POOL_SIZE, ENV_POOL_MEMORY  # pooled processes per server; bytes they may hold
DEFAULT_SIZE, DEFAULT_MEMORY = groups.DEFAULT_POOL_SIZE, groups.DEFAULT_POOL_MEMORY

# Idle RSS of one fork server (TensorFlow 2.21 CPU build with tf_keras imported, this project's CI machine,
# measured 591 MiB; much of it shared library pages, see README), rounded up.
FORKSERVER_BYTES = 600 * memfit.MiB
START_SHARE = 0.70  # a pool starts only if the server's memory use, with the pool, stays under this share
STATE_PREFIX = "warm-pool-"


def configured(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """(pooled processes, bytes) allowed per server; bad values fall back to the defaults."""
    ks = KernelSettings(environ)
    return ks.pool_size, ks.pool_memory


def live_pools(state_dir: str) -> list[dict]:
    """The pools of this state directory whose warm supervisor still runs and waits (any kernel); the
    records of pools that were killed without a word are removed, with their logs."""
    out = []
    with contextlib.suppress(OSError):
        for path in Path(state_dir).glob(STATE_PREFIX + "*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                rec = json.loads(path.read_text())
                if ProcessId(int(rec["pid"]), float(rec["started"]), str(rec["boot"])).alive():
                    out.append(rec)
                    continue
                path.unlink()
                path.with_suffix(".log").unlink(missing_ok=True)
    return out


def may_start(
    state_dir: str, server_pid: int | None, environ: dict[str, str] | None = None
) -> tuple[bool, str]:
    """Whether a new pool (one fork server) fits the server's bounds and memory, and why not."""
    size, memory = configured(environ)
    others = len(live_pools(state_dir))
    if min(size, memory // FORKSERVER_BYTES) - others < 1:
        return False, f"the server's pool is full ({SIZE_ENV}={size}, {MEMORY_ENV}={memory}, {others} pooled)"
    budget = memfit.server_budget(server_pid, environ) if server_pid else None
    if budget is not None and budget.used + FORKSERVER_BYTES > START_SHARE * budget.limit:
        return False, (
            f"the server's memory is short ({budget.used / memfit.GiB:.2f} of "
            f"{budget.limit / memfit.GiB:.2f} GiB in use)"
        )
    return True, ""


class PoolKeeper:
    """At most one waiting warm supervisor for this kernel."""

    def __init__(self, state_dir: str):
        self.state_dir = state_dir
        self.proc: subprocess.Popen | None = None
        self.statefile = os.path.join(state_dir, f"{STATE_PREFIX}{os.getpid()}.json")
        self.last_refusal = ""

    def start(self, prefix: list[str], launch_env: dict[str, str], env: dict[str, str]) -> bool:
        """Start a pool for the server named in `launch_env` (the job's launch environment), with `env`
        (a supervisor's), unless one waits already or the bounds say no."""
        pid = str(launch_env.get(memfit.SERVER_PID_ENV, ""))
        server_pid = int(pid) if pid.isdigit() else None
        if self.alive():
            return True
        self.drop()
        ok, why = may_start(self.state_dir, server_pid)
        self.last_refusal = why
        if not ok:
            return False
        log = open(os.path.join(self.state_dir, f"{STATE_PREFIX}{os.getpid()}.log"), "wb")  # the last one's
        self.proc = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "tfdist.runtime.warmpool",
                str(server_pid or ""),
                self.statefile,
            ],
            stdin=subprocess.PIPE,  # the lifeline, then the one line that hands it a job
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # the kernel's SIGINT is for the cell
            close_fds=True,
        )
        log.close()
        return True

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def state(self) -> dict | None:
        """The pool's own record (its PID, its fork server's, whether that imported TensorFlow), once it has
        written it."""
        if not self.alive():
            return None
        try:
            return json.loads(Path(self.statefile).read_text())
        except (OSError, ValueError):
            return None

    def take(self, jobdir: str, env: dict[str, str]) -> subprocess.Popen | None:
        """Hand the waiting pool the job in `jobdir`; the process now is that job's supervisor (its stdin
        stays the job's lifeline). None when no pool waits: the caller starts a fresh supervisor."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            self._reap(proc)
            return None
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps({"jobdir": jobdir, "env": env}).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            self._kill(proc)
            return None
        return proc

    def rss(self) -> int:
        """Resident bytes of the waiting pool (its supervisor and fork server), 0 without one."""
        return memfit.tree_rss(self.proc.pid) if self.alive() and self.proc else 0

    def drop(self) -> None:
        """End the waiting pool, if any, and everything of it."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self._kill(proc)
        with contextlib.suppress(OSError):
            os.unlink(self.statefile)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its fork server follows (death signal)
        PoolKeeper._reap(proc)

    @staticmethod
    def _reap(proc: subprocess.Popen | None) -> None:
        if proc is None:
            return
        if proc.stdin:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired, psutil.Error):
            proc.wait(5)
