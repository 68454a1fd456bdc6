"""How the plan's probe starts its helpers (the layouts' trial processes, the collective's workers): forked
from one TensorFlow import where it can, fresh where it cannot.

Why: `%%tfdist plan --workers 2` starts nine helpers (four servers, three PS coordinators, two all-reduce
workers). Fresh, each imports TensorFlow (~4.5 CPU-seconds here): on 2 cores ~20 s of the plan. The probe
starts the fork server local jobs use (runtime.forkserver) before its own import, so the two imports share
the cores, and forks every helper from it in milliseconds once the cell's first step ran. A helper forks
as a local job's task does: where its environment differs where TensorFlow's import reads it, it has GPUs,
or forking is off (TFDIST_FORK_TASKS=0) or impossible here, it starts fresh as before, and says why on its
stderr file.

A forked helper is the probe's child (the probe is a child subreaper, as a job's supervisor is) and dies
with it; `ForkedHelper` is the part of `subprocess.Popen` the probe uses (stdin, poll, wait, kill), held by a
pidfd so no signal reaches a later process that took its PID.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import IO

from tfdist.runtime import forkserver
from tfdist.runtime.deathsig import die_with_parent
from tfdist.runtime.forked import become_subreaper, fresh_start_reason
from tfdist.settings import KernelSettings

FORK_READY_S = 120.0  # the fork server's TensorFlow import, on a loaded machine


def helper_env() -> dict[str, str]:
    """The helpers' environment: the job's (the probe's thread pools), TensorFlow quiet, and a lost peer
    failing the closure at once."""
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", GRPC_FAIL_FAST="use_caller")


class ForkedHelper:
    """A helper forked from the probe's fork server: Popen's stdin, pid, poll, wait and kill."""

    def __init__(self, pid: int, stdin: IO[str]) -> None:
        self.pid, self.stdin = pid, stdin
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                got, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                got, status = self.pid, 255 << 8
            if got:
                self.returncode = os.waitstatus_to_exitcode(status)
                os.close(self._pidfd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"helper {self.pid}", timeout or 0)
            select.select([self._pidfd], [], [], left)  # readable once it exited
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:  # reaped: the PID may be another process's by now
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


class HelperLauncher:
    """Starts the probe's helpers: `start` the fork server (importing now), then `spawn` each helper."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._env: dict[str, str] = {}
        self._ready: bool | None = None

    def start(self, env: dict[str, str]) -> None:
        """Begin importing TensorFlow under `env` (the helpers' environment); nothing where forking is off or
        this process cannot adopt the forked helpers."""
        if self._server is not None or not KernelSettings(env).fork_tasks:
            return
        if fresh_start_reason(env, env) is not None or not become_subreaper():  # GPUs: CUDA starts fresh
            return
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._server = subprocess.Popen(
                [sys.executable, "-u", "-m", "tfdist.runtime.forkserver"],
                env=env,
                stdin=child.fileno(),
                stdout=subprocess.DEVNULL,
                preexec_fn=die_with_parent(),
            )
        finally:
            child.close()
        self._sock, self._env = parent, dict(env)

    def _imported(self) -> bool:
        if self._ready is None and self._sock is not None:
            self._sock.settimeout(FORK_READY_S)
            try:
                self._ready = self._sock.recv(16) == forkserver.READY
            except OSError:
                self._ready = False
            self._sock.settimeout(None)
        return bool(self._ready)

    def _fork(self, module: str, argv: list[str], env: dict[str, str], out: int, stdin: int) -> int | str:
        """The forked helper's PID, or why it starts fresh."""
        if self._sock is None:
            return "forking is off here"
        why = fresh_start_reason(self._env, env)
        if why is None and not self._imported():
            why = "the fork server could not import TensorFlow"
        if why is not None:
            return why
        try:
            data, passed = forkserver.request(module, argv, env, os.getcwd(), out, stdin=stdin)
            socket.send_fds(self._sock, [data], passed)
            return forkserver.answer(self._sock.recv(4096))
        except (OSError, ValueError) as exc:
            return str(exc) or type(exc).__name__

    def spawn(
        self, module: str, argv: list[str], env: dict[str, str], stderr_path: str
    ) -> ForkedHelper | subprocess.Popen:
        """`python -m module argv...` with `env`, a text pipe on its stdin and its output in `stderr_path`:
        forked, or else a fresh process."""
        with open(stderr_path, "w") as err:  # a file: a pipe nobody reads would fill
            r, w = os.pipe()
            try:
                got = self._fork(module, argv, env, err.fileno(), r)
            finally:
                os.close(r)
            if isinstance(got, int):
                return ForkedHelper(got, os.fdopen(w, "w"))
            os.close(w)
            if self._sock is not None:
                print(
                    f"tfdist probe: {module} {' '.join(argv[:2])} starts fresh: {got}", file=err, flush=True
                )
            return subprocess.Popen(
                [sys.executable, "-m", module, *argv],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                text=True,
                preexec_fn=die_with_parent(),
            )

    def close(self) -> None:
        """No more helpers: the fork server ends (the forked ones end with the probe)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        if self._server is not None:
            if not self._ready:  # still importing (the cell was refused early): nothing to wait for
                self._server.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._server.wait(5)
            if self._server.poll() is None:
                self._server.kill()
                self._server.wait()
            self._server = None
