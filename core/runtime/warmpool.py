"""A warm supervisor: a job's supervisor started before its job, holding zygotes with TensorFlow imported.

Usage (tfdist.backends.pool only):
    [unshare --net ...] python -m tfdist.runtime.warmpool SIZE SERVER_PID STATEFILE

Why a whole supervisor and not loose processes: a local job's tasks live in the supervisor's network
namespace, as its children (death signal, oom_score_adj, cgroup). Zygotes started by the supervisor that
will run the job are in the right place from the start, so nothing has to enter a namespace later.

It starts SIZE zygotes (tfdist.runtime.zygote), writes STATEFILE (its PID and theirs, how many are ready),
and waits on stdin for one JSON line {"jobdir", "env"} from the kernel that started it. Then it is that
job's supervisor (tfdist.runtime.supervisor), with the kernel's environment of that moment, and each task
it starts takes a zygote when it can (`WarmPool.become`). It exits instead, ending its zygotes, when
stdin closes (the kernel is gone: the same lifeline as a job), or when the server's memory use crosses
DROP_SHARE of its limit: an idle pool is the first thing to go, well before a job is stopped
(memfit.GUARD_SHARE) or the kernel killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from tfdist import memfit
from tfdist.procid import ProcessId
from tfdist.runtime import zygote

DROP_SHARE = 0.80  # an idle pool ends itself above this share of the server's memory limit
MEMORY_CHECK_S = 1.0
# Read by the interpreter or by TensorFlow's import: a zygote started under other values cannot become
# a task that has these (it would differ from a fresh process), so such a task starts fresh.
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "TF_CPP_", "TF_ENABLE_", "KMP_", "MKL_", "OMP_")
IMPORT_TIME_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}  # what tasks set themselves
UNCHECKED = {"PYTHONUNBUFFERED"}  # both run with -u
# OMP_NUM_THREADS is set per task by taskenv; no OpenMP runtime is loaded by importing TensorFlow (CPU
# build, checked in tests/test_warm_pool.py), so it is read later, after the zygote became the task.
LATE_READ = {"OMP_NUM_THREADS"}


def import_time_mismatch(zygote_env: dict[str, str], task_env: dict[str, str]) -> list[str]:
    """Variables read at interpreter start or TensorFlow's import whose values differ between the two."""
    keys = {
        k
        for k in (*zygote_env, *task_env)
        if k.startswith(IMPORT_TIME_PREFIXES) and k not in UNCHECKED and k not in LATE_READ
    }
    keys |= set(IMPORT_TIME_DEFAULTS)
    return sorted(
        k
        for k in keys
        if zygote_env.get(k, IMPORT_TIME_DEFAULTS.get(k)) != task_env.get(k, IMPORT_TIME_DEFAULTS.get(k))
    )


def fresh_start_reason(zygote_env: dict[str, str], task_env: dict[str, str]) -> str | None:
    """Why a task cannot be a process that imported TensorFlow under `zygote_env` (None: it can)."""
    if task_env.get("CUDA_VISIBLE_DEVICES"):
        return "it has GPUs"  # CUDA's own start is not checked here
    if diff := import_time_mismatch(zygote_env, task_env):
        return "its environment differs where it is read at start: " + ", ".join(diff)
    return None


@dataclass
class Zygote:
    proc: asyncio.subprocess.Process
    sock: socket.socket
    ready: bool = False


@dataclass
class WarmPool:
    """Zygotes owned by this (supervisor) process, handed out once each."""

    size: int
    env: dict[str, str]
    preexec: Callable[[], None]
    on_change: Callable[[], None] = lambda: None
    free: list[Zygote] = field(default_factory=list)
    used: dict[str, int] = field(default_factory=dict)  # task -> pid of the zygote it became
    refused: dict[str, str] = field(default_factory=dict)  # task -> why it started fresh

    async def start(self) -> None:
        for _ in range(self.size):
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-u",
                    "-m",
                    "tfdist.runtime.zygote",
                    env=self.env,
                    stdin=child.fileno(),
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    preexec_fn=self.preexec,
                )
            finally:
                child.close()
            z = Zygote(proc, parent)
            self.free.append(z)
            asyncio.get_running_loop().add_reader(parent.fileno(), self._on_message, z)

    def _on_message(self, z: Zygote) -> None:
        try:
            data = z.sock.recv(16)
        except OSError:
            data = b""
        asyncio.get_running_loop().remove_reader(z.sock.fileno())
        z.ready = data == b"R"
        self.on_change()

    @property
    def pids(self) -> list[int]:
        return [z.proc.pid for z in self.free]

    @property
    def ready(self) -> int:
        return sum(1 for z in self.free if z.ready and z.proc.returncode is None)

    @property
    def alive(self) -> int:
        return sum(1 for z in self.free if z.proc.returncode is None)

    def become(
        self, task: str, module: str, argv: list[str], env: dict[str, str], cwd: str, fds: tuple[int, ...]
    ) -> asyncio.subprocess.Process | None:
        """Turn a zygote into `task` (as `python -u -m module argv` with env, cwd and fds would start);
        None when the task must start fresh (`fresh_start_reason`), or no zygote is left."""
        why = fresh_start_reason(self.env, env)
        proc = None if why else self._hand_out(task, module, argv, env, cwd, fds)
        if proc is None:
            self.refused[task] = why or "no pooled process was left"
            print(f"tfdist warm pool: {task} starts fresh: {self.refused[task]}", flush=True)
        else:
            print(f"tfdist warm pool: {task} is pooled process {proc.pid}", flush=True)
        if task == "chief-0":  # started last: the zygotes still free are not needed by this job
            self.close()
        return proc

    def _hand_out(
        self, task: str, module: str, argv: list[str], env: dict[str, str], cwd: str, fds: tuple[int, ...]
    ) -> asyncio.subprocess.Process | None:
        msg = json.dumps({"module": module, "argv": argv, "env": env, "cwd": cwd, "fds": list(fds)}).encode()
        while self.free:
            # a zygote that has finished importing first: one still importing makes its task wait for that
            z = next((z for z in self.free if z.ready and z.proc.returncode is None), self.free[0])
            self.free.remove(z)
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(z.sock.fileno())
            try:
                if z.proc.returncode is not None:
                    raise OSError("the zygote exited")
                socket.send_fds(z.sock, [msg], list(fds))
            except OSError:
                self._end(z)
                continue
            z.sock.close()  # the message stays queued for the zygote
            self.used[task] = z.proc.pid
            self.on_change()
            return z.proc
        return None

    def _end(self, z: Zygote) -> None:
        with contextlib.suppress(ProcessLookupError):
            z.proc.kill()
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            asyncio.get_running_loop().remove_reader(z.sock.fileno())
        z.sock.close()  # asyncio's child watcher reaps it: no zombie

    def close(self) -> None:
        """End every zygote not handed out."""
        while self.free:
            self._end(self.free.pop())
        self.on_change()


def zygote_env(environ: dict[str, str]) -> dict[str, str]:
    """What a zygote imports TensorFlow under: the supervisor's environment without a task's own."""
    from tfdist.taskenv import THREAD_VARS

    env = {k: v for k, v in environ.items() if k not in ("TF_CONFIG", "TFDIST_EVENTS_FD", *THREAD_VARS)}
    env.pop("JPY_PARENT_PID", None)
    env["TF_USE_LEGACY_KERAS"] = "1"
    return env


class _State:
    """STATEFILE: what the kernel side and the tests read (PIDs with start times, so never a reused PID)."""

    def __init__(self, path: str, pool: WarmPool):
        self.path, self.pool = path, pool

    def write(self, phase: str = "idle") -> None:
        if not self.path:
            return
        me = ProcessId.current()
        rec = {
            "pid": me.pid,
            "started": me.started,
            "boot": me.boot,
            "phase": phase,
            "size": self.pool.size,
            "zygotes": self.pool.pids,
            "ready": self.pool.ready,
        }
        tmp = self.path + ".tmp"
        with contextlib.suppress(OSError):
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, self.path)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def memory_short(server_pid: int | None) -> str | None:
    if server_pid is None:
        return None
    budget = memfit.server_budget(server_pid)
    if budget is None or budget.used < DROP_SHARE * budget.limit:
        return None
    return (
        f"the server's memory is {budget.used / budget.limit:.0%} used "
        f"({budget.used / memfit.GiB:.2f} of {budget.limit / memfit.GiB:.2f} GiB)"
    )


async def _wait_for_job(pool: WarmPool, server_pid: int | None) -> tuple[dict | None, str]:
    """The kernel's one line, or None and why the pool ends instead."""
    loop = asyncio.get_running_loop()
    line: asyncio.Future = loop.create_future()
    buf = bytearray()

    def readable() -> None:
        data = os.read(0, 65536)
        if line.done():
            return
        if not data:
            line.set_result(None)
            return
        buf.extend(data)
        if b"\n" in buf:
            line.set_result(json.loads(bytes(buf).split(b"\n", 1)[0]))

    loop.add_reader(0, readable)
    try:
        while not line.done():
            await asyncio.wait([line], timeout=MEMORY_CHECK_S)
            if line.done():
                break
            if why := memory_short(server_pid):
                return None, why
            if pool.alive == 0:
                return None, "no zygote is alive"
        req = line.result()
        return req, "" if req is not None else "its kernel is gone"
    finally:
        loop.remove_reader(0)


def _log_to(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


async def _main(size: int, server_pid: int | None, statefile: str) -> int:
    from tfdist.runtime import supervisor

    name = zygote.own_name()
    zygote.set_name(zygote.IDLE_NAME)  # an idle pool, not a job: see zygote.IDLE_NAME
    pool = WarmPool(size, zygote_env(dict(os.environ)), supervisor._die_with_parent)
    state = _State(statefile, pool)
    pool.on_change = state.write
    await pool.start()
    state.write()
    req, why = await _wait_for_job(pool, server_pid)
    state.remove()
    if req is None:
        print(f"tfdist warm pool: ended ({why})", flush=True)
        pool.close()
        await asyncio.sleep(0)
        return 0
    pool.on_change = lambda: None
    zygote.set_name(name)
    jobdir = req["jobdir"]
    os.environ.clear()
    os.environ.update(req["env"])  # the kernel's environment now, as a supervisor started now would have
    _log_to(os.path.join(jobdir, "supervisor.log"))
    return await supervisor.serve(jobdir, pool)


def main() -> int:
    size = int(sys.argv[1])
    server_pid = int(sys.argv[2]) if sys.argv[2].isdigit() else None
    statefile = sys.argv[3]
    if os.environ.get("TFDIST_NETNS") == "1":
        from tfdist.runtime.netns import bring_up_loopback

        bring_up_loopback()
    return asyncio.run(_main(size, server_pid, statefile))


if __name__ == "__main__":
    sys.exit(main())
