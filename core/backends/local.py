"""The local backend: each job is a supervisor process (tfdist.runtime.supervisor) on this machine, in
its own network namespace, reached over a Unix socket in the job's directory.

Job directories live under the user's state dir (0700), so the Unix permissions are the access control:
only this user's processes (their kernels and their Jupyter server) can watch or stop their jobs.
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
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable, JobFailed, JobSpecError, NoSuchJob
from ..jobspec import JobSpec
from ..jobview import JobView
from ..procid import ProcessId
from ..runtime import events
from ..runtime.netns import wrapper_command
from ..runtime.unixsock import short_path
from .base import Backend, Launch

KEEP_FINISHED = 20  # finished job directories kept for `%tfdist logs`
ISOLATION_ENV = "TFDIST_ISOLATION"  # "netns" (default) or "none"


def _read_logs(logdir: str, task: str | None, tail: int | None) -> dict[str, str]:
    out = {}
    for fn in sorted(os.listdir(logdir)):
        if not fn.endswith(".log"):  # NAME.log.1: what rolled over (tasklog.RollingLog)
            continue
        t = fn.removesuffix(".log")
        if task is None or t == task:
            path = os.path.join(logdir, fn)
            out[t] = _tail_lines(path, tail) if tail is not None else Path(path).read_text(errors="replace")
    return out


def _tail_lines(path: str, lines: int, chunk: int = 64 * 1024) -> str:
    """The last `lines` lines of a file, reading only its end (a log may be many MB)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = pos = f.tell()
        data = b""
        while pos > 0 and data.count(b"\n") <= lines:
            pos = max(0, pos - chunk)
            f.seek(pos)
            data = f.read(end - pos)
    text = data.decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:]) + ("\n" if text.endswith("\n") else "")


class LocalBackend(Backend):
    name = "local"

    def __init__(self, state_dir: str, isolation: str | None = None):
        self.state_dir = state_dir
        self.isolation = isolation or os.environ.get(ISOLATION_ENV, "netns")
        self._lifelines: dict[str, subprocess.Popen] = {}
        self._wrapper: list[str] | None = None

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
        if self.isolation == "none":
            return []
        if self.isolation != "netns":
            raise JobSpecError(f"{ISOLATION_ENV}={self.isolation!r} is unknown: use 'netns' or 'none'")
        if self._wrapper is None:
            self._wrapper = wrapper_command() or []
        if not self._wrapper:
            raise BackendUnavailable(
                "cannot give this job its own network namespace (`unshare --net` is not permitted here). "
                "TensorFlow's servers listen on every interface and run any graph sent to them, so the job "
                f"was not started. If this machine's network is trusted, set {ISOLATION_ENV}=none."
            )
        return self._wrapper

    # ------------------------------------------------------------------ submit
    async def submit(self, spec: JobSpec, payload: bytes, launch: Launch) -> None:
        prefix = self._isolation_prefix()
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        d = self.jobdir(spec.name)
        if os.path.exists(d):
            if self.is_running(spec.name):
                raise JobSpecError(
                    f"a job named {spec.name!r} is already running: pick another --name or "
                    f"`%tfdist stop {spec.name}`"
                )
            shutil.rmtree(d)
        self._prune()
        os.makedirs(os.path.join(d, "logs"), mode=0o700)
        with open(os.path.join(d, "spec.json"), "w") as f:
            f.write(spec.to_json())
        with open(os.path.join(d, "launch.json"), "w") as f:
            json.dump({"gpus": launch.gpus, "cwd": launch.cwd, "env": launch.env}, f)
        with open(os.path.join(d, "payload.bin"), "wb") as f:
            f.write(payload)
        with open(os.path.join(d, "state.json"), "w") as f:  # until the supervisor writes its own
            json.dump(
                {
                    "state": "pending",
                    "message": "launching",
                    "created": time.time(),
                    "tasks_total": spec.task_count,
                },
                f,
            )
        env = dict(os.environ)
        env["TFDIST_NETNS"] = "1" if prefix else "0"
        env["PYTHONUNBUFFERED"] = "1"
        errlog = open(os.path.join(d, "supervisor.log"), "wb")
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tfdist.runtime.supervisor", d],
            stdin=subprocess.PIPE,  # the lifeline: we never write, we only keep it open
            stdout=errlog,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # the kernel's SIGINT is for the cell, not for the job's processes
            close_fds=True,
        )
        errlog.close()
        self._lifelines[spec.name] = proc
        try:
            await self._wait_up(spec.name, proc)
        except BaseException:  # interrupted or failed while it came up: nothing may stay behind
            if proc.poll() is None:
                self._kill(proc)
            self._lifelines.pop(spec.name, None)
            raise

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
                with open(os.path.join(d, "supervisor.log"), errors="replace") as f:
                    tail = f.read()[-2000:]
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

    def _prune(self) -> None:
        try:
            names = [n for n in os.listdir(self.state_dir) if os.path.isdir(self.jobdir(n))]
        except FileNotFoundError:
            return
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
        writer.write(events.dumps({"op": op, **extra}))
        await writer.drain()
        return reader, writer

    async def watch(self, name: str) -> AsyncIterator[dict[str, Any]]:
        try:
            reader, writer = await self._request(name, "watch")
        except (FileNotFoundError, ConnectionRefusedError):
            yield {"type": "snapshot", "view": (await self.status(name)).to_dict()}
            return
        try:
            async for line in reader:
                yield events.loads(line)
        finally:
            writer.close()
            self._release(name)

    def _release(self, name: str) -> None:
        """Once the supervisor has ended, drop our end of its lifeline and reap it."""
        proc = self._lifelines.get(name)
        if proc is not None and proc.poll() is not None:
            self._lifelines.pop(name, None)
            if proc.stdin:
                proc.stdin.close()

    async def stop(self, name: str, reason: str = "stopped") -> bool:
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
                if line:
                    return JobView.from_dict(events.loads(line)["view"])
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
            view.state = "failed"
            view.message = "the job ended without recording its state"
        launching = self._supervisor(name) is None and time.time() - view.created < 60
        if view.state not in ("succeeded", "failed", "stopped") and not launching:
            # died without a word: say so, and no task of it may look alive
            gone = "the job's supervisor is gone"
            view.apply({"type": "state", "state": "failed", "message": gone, "reason": "lost"})
        return view

    async def list_jobs(self) -> list[dict[str, Any]]:
        try:
            names = sorted(n for n in os.listdir(self.state_dir) if os.path.isdir(self.jobdir(n)))
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            with contextlib.suppress(NoSuchJob):
                out.append((await self.status(n)).summary())
        out.sort(key=lambda s: s.get("created") or 0, reverse=True)
        return out

    async def logs(self, name: str, task: str | None = None, tail: int | None = None) -> dict[str, str]:
        logdir = os.path.join(self.jobdir(name), "logs")
        if not os.path.isdir(logdir):
            raise NoSuchJob(name)
        # file reads off the event loop: the Jupyter server's loop serves every tab
        return await asyncio.to_thread(_read_logs, logdir, task, tail)

    async def fetch_result(self, name: str) -> bytes | None:
        d = self.jobdir(name)
        path = os.path.join(d, "result.bin")
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            data = f.read()
        for fn in ("result.bin", "payload.bin"):  # may be hundreds of MB: not kept once delivered
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, fn))
        return data

    async def close(self) -> None:
        for name in list(self._lifelines):
            await self.stop(name)
