"""The local backend: each job is a supervisor process (tfdist.runtime.supervisor) on this machine, in
its own network namespace, reached over a Unix socket in the job's directory.

Job directories live under the user's state dir (0700), so the Unix permissions are the access control:
only this user's processes (their kernels and their Jupyter server) can watch or stop their jobs.

A job started with `--detach` has no lifeline: its supervisor does not watch the kernel's pipe, so it runs
on after the kernel is gone, and its results stay in the job's directory until one `attach` takes them
(`%tfdist attach NAME`, from any later kernel with this state directory) or until the retention time after
its end (TFDIST_RESULT_RETENTION_S, set by the admin, default 24 h) has passed; the next use of the backend
then deletes the job's directory. Results come back once, as on Kubernetes: a second attach is told so.
Those rules and their sentences are `tfdist.job.detach`'s, shared with the Kubernetes backend; the files
that carry them (record, retention, attach, results once) are `backends.localdetach`'s, mixed in here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .. import tf_config
from ..errors import BackendUnavailable, JobFailed, JobSpecError, NoSuchJob
from ..job.events import Event, Reader, SnapshotEvent, StateEvent, decode, dumps
from ..job.vocab import TERMINAL, JobState, Reason
from ..jobrecords import JobSummary
from ..jobspec import JobSpec, validate
from ..jobview import JobView
from ..procid import ProcessId
from ..runtime.netns import IsolationUnavailable, isolation_prefix
from ..runtime.ports import PortTaken, allocate_ports
from ..runtime.tasklog import tail_lines
from ..runtime.unixsock import short_path
from ..settings import ENV_NETNS, KernelSettings
from .base import Backend, Launch
from .localdetach import DETACHED_FILE, DetachedJobs, NoSuchDetachedJob
from .pool import PoolKeeper

__all__ = ["DETACHED_FILE", "LocalBackend", "NoSuchDetachedJob"]  # the detached half: backends.localdetach

KEEP_FINISHED = 20  # finished job directories kept for `%tfdist logs`


def _read_logs(logdir: str, task: str | None, tail: int | None) -> dict[str, str]:
    out = {}
    for fn in sorted(os.listdir(logdir)):
        if not fn.endswith(".log"):  # NAME.log.1: what rolled over (tasklog.RollingLog)
            continue
        t = fn.removesuffix(".log")
        if task is None or t == task:
            path = os.path.join(logdir, fn)
            out[t] = tail_lines(path, tail) if tail is not None else Path(path).read_text(errors="replace")
    return out


class LocalBackend(DetachedJobs, Backend):
    name = "local"

    def __init__(self, state_dir: str, isolation: str | None = None):
        self.state_dir = state_dir
        self.isolation = isolation or KernelSettings().isolation
        self._lifelines: dict[str, subprocess.Popen] = {}
        self._wrapper: list[str] | None = None
        self._pool = PoolKeeper(state_dir)  # this kernel's warm pool for its next job (backends.pool)
        self._pool_next: tuple | None = None  # (launch env, prefix, env) of its last job

    # ------------------------------------------------------------------ paths
    def jobdir(self, name: str) -> str:
        """Names become paths: one that could leave the state directory is no job."""
        if not name or "/" in name or "\0" in name or name.startswith("."):
            raise NoSuchJob(name)
        return os.path.join(self.state_dir, name)

    def _supervisor(self, name: str) -> ProcessId | None:
        """The job's supervisor as it recorded itself (PID and start time), while it may be running."""
        try:
            with open(os.path.join(self.jobdir(name), "supervisor.pid")) as f:
                return ProcessId.loads(f.read())
        except (OSError, NoSuchJob):
            return None

    def is_running(self, name: str) -> bool:
        sup = self._supervisor(name)
        return sup is not None and sup.alive()

    def _isolation_prefix(self) -> list[str]:
        if self._wrapper is None:
            try:
                self._wrapper = isolation_prefix(self.isolation, "the job")
            except ValueError as exc:
                raise JobSpecError(str(exc)) from None
            except IsolationUnavailable as exc:
                raise BackendUnavailable(str(exc)) from None
        return self._wrapper

    # ------------------------------------------------------------------ submit
    async def submit(self, spec: JobSpec, payload: bytes, launch: Launch) -> None:
        self.unclaim(spec.name)
        validate(spec, None)  # the magic checked it (with this server's GPUs); a direct caller gets the same
        prefix = self._isolation_prefix()
        if not prefix and spec.base_port is not None:
            # no namespace of its own: the job's ports are this machine's. A taken one is refused here,
            # before its directory exists (the supervisor checks again: a program may take one meanwhile)
            names = tf_config.task_names(spec.workers, spec.ps, spec.strategy)
            try:
                allocate_ports(len(names), spec.base_port)
            except PortTaken as exc:
                raise JobSpecError(str(exc)) from None
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        d = self.jobdir(spec.name)
        if os.path.exists(d):
            if self.is_running(spec.name):
                raise JobSpecError(
                    f"a job named {spec.name!r} is already running: pick another --name or "
                    f"`%tfdist stop {spec.name}`"
                )
            if self._results_waiting(spec.name):  # a detached job's results: never deleted unasked
                raise JobSpecError(
                    f"the detached job {spec.name!r} has results nobody has taken yet: `%tfdist attach "
                    f"{spec.name}` takes them; or pick another --name (they are kept until then, or until "
                    "their retention has passed)"
                )
            shutil.rmtree(d)
        self._claim(spec.name)
        self._prune()
        os.makedirs(os.path.join(d, "logs"), mode=0o700)
        with open(os.path.join(d, "spec.json"), "w") as f:
            f.write(spec.to_json())
        with open(os.path.join(d, "launch.json"), "w") as f:
            json.dump({"gpus": launch.gpus, "cwd": launch.cwd, "env": launch.env}, f)
        with open(os.path.join(d, "payload.bin"), "wb") as f:
            f.write(payload)
        detach = spec.detach
        if detach:  # the rule it was started under, whatever the environment says later
            keep = self.retention().seconds
            self._write_detached(d, {"retention_s": keep, "uid": os.getuid(), "user": spec.user})
        with open(os.path.join(d, "state.json"), "w") as f:  # until the supervisor writes its own
            json.dump(
                {
                    "state": JobState.PENDING,
                    "message": "launching",
                    "created": time.time(),
                    "tasks_total": spec.task_count,
                },
                f,
            )
        env = self._supervisor_env(prefix)
        # a waiting warm pool of this kernel becomes the job's supervisor; a detached job starts fresh
        warm = None if detach else self._pool.take(d, env)
        self._pool_next = None if detach else (launch.env, prefix, env)
        proc = warm or self._start_supervisor(d, prefix, env, detach)
        if not detach:
            self._lifelines[spec.name] = proc
        try:
            await self._wait_up(spec.name, proc)
        except BaseException:  # interrupted or failed while it came up: nothing may stay behind
            if proc.poll() is None:
                self._kill(proc)
            self._lifelines.pop(spec.name, None)
            raise
        if detach:  # this kernel reaps it if it outlives the job: no zombie left behind
            threading.Thread(target=proc.wait, name=f"tfdist-reap-{spec.name}", daemon=True).start()

    @staticmethod
    def _start_supervisor(
        jobdir: str, prefix: list[str], env: dict[str, str], detach: bool
    ) -> subprocess.Popen:
        """A fresh supervisor for the job in `jobdir`. Its log is opened (truncated) here only: a taken
        pool appends to the same file at once, and a truncation after the take would cut its first lines."""
        with open(os.path.join(jobdir, "supervisor.log"), "wb") as errlog:
            return subprocess.Popen(
                [*prefix, sys.executable, "-m", "tfdist.runtime.supervisor", jobdir],
                # the lifeline: we never write, we only keep it open; a detached job has none
                stdin=subprocess.DEVNULL if detach else subprocess.PIPE,
                stdout=errlog,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # the kernel's SIGINT is for the cell, not for the job's processes
                close_fds=True,
            )

    async def _wait_up(self, name: str, proc: subprocess.Popen) -> None:
        d = self.jobdir(name)
        sock = os.path.join(d, "control.sock")
        deadline = time.time() + 60
        while not os.path.exists(sock):
            if proc.poll() is not None:
                self._lifelines.pop(name, None)
                view = self._offline_view(name)
                if view.error:  # it ran, and refused (e.g. a port in use): the job's own words
                    raise JobFailed(view.error.get("message") or view.message, job=name)
                try:
                    with open(os.path.join(d, "supervisor.log"), errors="replace") as f:
                        tail = f.read()[-2000:]
                except FileNotFoundError:  # a taken pool that ended before its first line
                    tail = "(it wrote nothing)"
                raise BackendUnavailable(
                    f"the job's supervisor exited at start (code {proc.returncode}):\n{tail}"
                )
            if time.time() > deadline:
                self._kill(proc)
                raise BackendUnavailable("the job's supervisor did not come up within 60 s")
            await asyncio.sleep(0.05)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def _names(self) -> list[str]:
        try:
            entries = os.listdir(self.state_dir)
        except FileNotFoundError:
            return []
        return sorted(n for n in entries if not n.startswith(".") and os.path.isdir(self.jobdir(n)))

    def _prune(self) -> None:
        self.expire()
        names = [n for n in self._names() if not self._results_waiting(n)]
        finished = [n for n in names if not self.is_running(n)]
        finished.sort(key=lambda n: os.path.getmtime(self.jobdir(n)))
        for n in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            shutil.rmtree(self.jobdir(n), ignore_errors=True)

    # ------------------------------------------------------------------ control socket
    async def _request(
        self, name: str, op: str, **extra: Any
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        with short_path(os.path.join(self.jobdir(name), "control.sock")) as sock:
            reader, writer = await asyncio.open_unix_connection(sock, limit=64 * 2**20)
        writer.write(dumps({"op": op, **extra}))
        await writer.drain()
        return reader, writer

    async def watch(self, name: str) -> AsyncIterator[Event]:
        try:
            reader, writer = await self._request(name, "watch")
        except (FileNotFoundError, ConnectionRefusedError):
            yield SnapshotEvent(view=(await self.status(name)).to_dict())
            return
        said = Reader("the job's supervisor")
        try:
            async for line in reader:
                for ev in said.line(line):
                    yield ev
        finally:
            writer.close()
            self._release(name)
            self._warm_up()

    def _warm_up(self) -> None:
        """After a job of this kernel, a warm pool for its next one, as the pool's bounds allow."""
        if self._pool_next is not None:
            launch_env, prefix, env = self._pool_next
            self._pool.start(prefix, launch_env, env)

    def warm_up_first(self, launch_env: dict[str, str]) -> bool:
        """A warm pool for this kernel's first job, started before there is one (the extension's load):
        TensorFlow imports while the user prepares the cell. False, and nothing started, where the
        pool's bounds or this server's isolation say no (the job then says why, if it cannot start)."""
        try:
            prefix = self._isolation_prefix()
        except (JobSpecError, BackendUnavailable):
            return False
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self._pool_next = (launch_env, prefix, self._supervisor_env(prefix))
        self._warm_up()
        return self._pool.alive()

    @staticmethod
    def _supervisor_env(prefix: list[str]) -> dict[str, str]:
        env = dict(os.environ)
        env[ENV_NETNS] = "1" if prefix else "0"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def idle_bytes(self) -> int:
        """Memory held by this kernel's waiting pool: free for the next job, which takes it over."""
        return self._pool.rss()

    def release_idle(self) -> None:
        self._pool.drop()

    def _release(self, name: str) -> None:
        """Once the supervisor has ended, drop our end of its lifeline and reap it."""
        proc = self._lifelines.get(name)
        if proc is not None and proc.poll() is not None:
            self._lifelines.pop(name, None)
            if proc.stdin:
                proc.stdin.close()

    async def stop(self, name: str, reason: str = Reason.STOPPED) -> bool:
        if not self.is_running(name):
            return False
        try:
            reader, writer = await self._request(name, "stop", reason=reason)
            await asyncio.wait_for(reader.readline(), 5)
            writer.close()
        except (OSError, asyncio.TimeoutError):
            sup = self._supervisor(name)
            if sup:
                sup.signal(signal.SIGTERM)
        deadline = time.time() + 10
        while self.is_running(name) and time.time() < deadline:
            await asyncio.sleep(0.1)
        if self.is_running(name):  # last resort: the whole session of the supervisor
            sup = self._supervisor(name)
            if sup:
                sup.signal(signal.SIGKILL, group=True)
        proc = self._lifelines.get(name)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            self._release(name)
        return True

    async def status(self, name: str) -> JobView:
        d = self.jobdir(name)
        if not os.path.isdir(d):
            raise NoSuchJob(name)
        if self.is_running(name):
            with contextlib.suppress(OSError, ValueError):
                reader, writer = await self._request(name, "status")
                line = await asyncio.wait_for(reader.readline(), 5)
                writer.close()
                ev = decode(line) if line else None  # EventError: a ValueError
                if isinstance(ev, SnapshotEvent):
                    return JobView.from_dict(ev.view)
        return self._offline_view(name)

    def _offline_view(self, name: str) -> JobView:
        d = self.jobdir(name)
        view = JobView(name=name, backend="local")
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(d, "spec.json")) as f:
                view.spec = json.load(f)
            view.user = view.spec.get("user", "")
        try:
            with open(os.path.join(d, "state.json")) as f:
                st = json.load(f)
            for k in (
                "state",
                "message",
                "created",
                "ended",
                "epoch",
                "epochs",
                "error",
                "tasks",
                "epoch_logs",
                "reason",
            ):
                if k in st:
                    setattr(view, k, st[k])
            view.total_tasks = st.get("tasks_total", 0)
            view.metrics.extend(
                m for m in st.get("metrics") or [] if isinstance(m, dict) and isinstance(m.get("tasks"), dict)
            )
        except (OSError, ValueError):
            view.state = JobState.FAILED
            view.message = "the job ended without recording its state"
        launching = self._supervisor(name) is None and time.time() - view.created < 60
        # a supervisor that runs but did not answer (its socket not bound yet, busy) is not gone
        if view.state not in TERMINAL and not launching and not self.is_running(name):
            # died without a word: say so, and no task of it may look alive
            gone = "the job's supervisor is gone"
            view.apply(StateEvent(state=JobState.FAILED, message=gone, reason=Reason.LOST))
        return view

    async def list_jobs(self) -> list[JobSummary]:
        self.expire()
        out = []
        for n in self._names():
            with contextlib.suppress(NoSuchJob):
                summary = (await self.status(n)).summary() | self.detach_summary(n).fields()
                out.append(JobSummary.model_validate(summary))
        out.sort(key=lambda s: s.created or 0, reverse=True)
        return out

    async def logs(self, name: str, task: str | None = None, tail: int | None = None) -> dict[str, str]:
        logdir = os.path.join(self.jobdir(name), "logs")
        if not os.path.isdir(logdir):
            raise NoSuchJob(name)
        # file reads off the event loop: the Jupyter server's loop serves every tab
        return await asyncio.to_thread(_read_logs, logdir, task, tail)

    async def close(self) -> None:
        for name in list(self._lifelines):
            await self.stop(name)
        self._pool.drop()
