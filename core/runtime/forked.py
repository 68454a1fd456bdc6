"""The supervisor's side of its job's fork server (runtime.forkserver): start it, fork tasks from it, and
hold each forked task as the supervisor holds a task it started itself.

A forked task is the supervisor's child (the supervisor is a child subreaper; the fork server's double
fork hands each task to it), so the supervisor waits for it, reads its exit status and signals it as it
does an `asyncio.subprocess.Process`; `ForkedProcess` offers the part of that interface it uses. The PID
is held as a pidfd: no signal can reach another process that took the PID later.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from tfdist.runtime import forkserver
from tfdist.settings import ENV_EVENTS_FD, KernelSettings

PR_SET_CHILD_SUBREAPER = 36
# Read by the interpreter or by TensorFlow's import: a fork server started under other values cannot fork
# a task that has these (it would differ from a fresh process), so such a task starts fresh.
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "TF_CPP_", "TF_ENABLE_", "KMP_", "MKL_", "OMP_")
IMPORT_TIME_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}  # what tasks set themselves
UNCHECKED = {"PYTHONUNBUFFERED"}  # both run with -u
# OMP_NUM_THREADS is set per task by taskenv; no OpenMP runtime is loaded by importing TensorFlow (CPU
# build, checked in tests/test_warm_pool.py), so it is read later, after the fork became the task. So are
# Intel OpenMP's KMP_* (scikit-learn and joblib set two at their import, in the kernel: without this, a
# pool started before the notebook imported them would start every task of its job fresh).
LATE_READ = {"OMP_NUM_THREADS"}
LATE_READ_PREFIXES = ("KMP_",)


def import_time_mismatch(server_env: dict[str, str], task_env: dict[str, str]) -> list[str]:
    """Variables read at interpreter start or TensorFlow's import whose values differ between the two."""
    keys = {
        k
        for k in (*server_env, *task_env)
        if k.startswith(IMPORT_TIME_PREFIXES)
        and not k.startswith(LATE_READ_PREFIXES)
        and k not in UNCHECKED
        and k not in LATE_READ
    }
    keys |= set(IMPORT_TIME_DEFAULTS)
    return sorted(
        k
        for k in keys
        if server_env.get(k, IMPORT_TIME_DEFAULTS.get(k)) != task_env.get(k, IMPORT_TIME_DEFAULTS.get(k))
    )


def fresh_start_reason(server_env: dict[str, str], task_env: dict[str, str]) -> str | None:
    """Why a task cannot be forked from a process that imported TensorFlow under `server_env` (None: it
    can)."""
    if task_env.get("CUDA_VISIBLE_DEVICES"):
        return "it has GPUs"  # CUDA's own start is not checked here
    if diff := import_time_mismatch(server_env, task_env):
        return "its environment differs where it is read at start: " + ", ".join(diff)
    return None


def import_env(environ: dict[str, str]) -> dict[str, str]:
    """What a fork server imports TensorFlow under: the supervisor's environment without a task's own."""
    from tfdist.taskenv import THREAD_VARS

    env = {k: v for k, v in environ.items() if k not in ("TF_CONFIG", ENV_EVENTS_FD, *THREAD_VARS)}
    env.pop("JPY_PARENT_PID", None)
    env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (the forked tasks): False where the kernel refuses, or
    has no pidfds (Linux < 5.3) to hold them by."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (OSError, AttributeError):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


class ForkedProcess:
    """A forked task, waited for and signalled through a pidfd (it is this process's child)."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader):
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        loop.add_reader(self._pidfd, self._reap)

    @classmethod
    async def attach(cls, pid: int, stdout_fd: int) -> ForkedProcess:
        reader = asyncio.StreamReader(limit=2**20)
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(stdout_fd, "rb"))
        return cls(pid, reader)

    def _reap(self) -> None:
        try:
            got, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: its status is lost
            got, status = self.pid, 255 << 8
        if got == 0:
            return
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self.returncode = os.waitstatus_to_exitcode(status)
        if not self._exited.done():
            self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return  # reaped: the PID may be another process's by now
        signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def _ready(sock: socket.socket) -> bool:
    try:
        return await asyncio.get_running_loop().sock_recv(sock, 16) == forkserver.READY
    except OSError:
        return False


@dataclass
class ForkServer:
    """A job's fork server (its own, or its warm pool's): its tasks are forked from one TensorFlow import
    (until `close`)."""

    proc: asyncio.subprocess.Process
    sock: socket.socket
    env: dict[str, str]
    ready: asyncio.Task[bool]  # TensorFlow imported (False: it could not be, or the server is gone)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    async def start(
        cls, env: dict[str, str], preexec: Callable[[], None], idle: bool = False
    ) -> ForkServer | None:
        """Start importing TensorFlow now; None where tasks must start fresh (disabled, no subreaper).
        `idle`: a warm pool's, named forkserver.IDLE_NAME until a task comes."""
        if not KernelSettings(env).fork_tasks or not become_subreaper():
            return None
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-u",
                "-m",
                "tfdist.runtime.forkserver",
                *(["idle"] if idle else []),
                env=env,
                stdin=child.fileno(),
                preexec_fn=preexec,
            )
        finally:
            child.close()
        parent.setblocking(False)
        return cls(proc, parent, env, asyncio.ensure_future(_ready(parent)))

    @property
    def imported(self) -> bool:
        """TensorFlow is imported (it said so)."""
        return self.ready.done() and not self.ready.cancelled() and self.ready.result()

    async def spawn(
        self, task: str, module: str, argv: list[str], env: dict[str, str], cwd: str, fds: tuple[int, ...]
    ) -> ForkedProcess | None:
        """`task` forked, as `python -u -m module argv` with env, cwd and fds would start; None when it
        must start fresh (its environment differs where TensorFlow's import reads it, it has GPUs, or the
        server is gone)."""
        why = fresh_start_reason(self.env, env)
        if why is None and (self.ready.cancelled() or not await self.ready):
            why = "the fork server could not import TensorFlow"
        if why is not None:
            print(f"tfdist fork server: {task} starts fresh: {why}", flush=True)
            return None
        async with self.lock:
            r, w = os.pipe()
            try:
                loop = asyncio.get_running_loop()
                try:
                    data, passed = forkserver.request(module, argv, env, cwd, w, fds)
                    socket.send_fds(self.sock, [data], passed)
                    got = forkserver.answer(await loop.sock_recv(self.sock, 4096))
                except (OSError, ValueError) as exc:
                    got = str(exc) or type(exc).__name__
            finally:
                os.close(w)
            if isinstance(got, str):
                os.close(r)
                print(f"tfdist fork server: {task} starts fresh: {got}", flush=True)
                return None
            print(f"tfdist fork server: {task} is forked process {got}", flush=True)
            return await ForkedProcess.attach(got, r)

    def close(self) -> None:
        """No more tasks: the server exits (its copy of TensorFlow's pages is no longer needed)."""
        self.ready.cancel()
        with contextlib.suppress(OSError):
            self.sock.close()
