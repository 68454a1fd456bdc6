"""The local job supervisor: one process per job that owns every task process of it.

Usage: [unshare --net ...] python -m tfdist.runtime.supervisor JOBDIR

It starts the PS and worker servers and the coordinator, streams their state, logs and metrics to
whoever watches JOBDIR/control.sock, and ends them all when the coordinator finishes, on a `stop`
request, on SIGTERM/SIGINT, or when its standard input closes (the kernel that launched it died:
its end of that pipe is the job's lifeline). A detached job (`--detach`) has no lifeline: it runs to its
end without the kernel and leaves its results in JOBDIR for `%tfdist attach`. Every child is also bound to
this process with PR_SET_PDEATHSIG, so even a SIGKILL of the supervisor leaves nothing running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tfdist import memfit, taskenv, tf_config
from tfdist.events import (
    Event,
    LogEvent,
    MetricsEvent,
    ProgressEvent,
    SnapshotEvent,
    StateEvent,
    TaskEvent,
    error_info,
    parse,
    to_wire,
)
from tfdist.jobspec import JobSpec, split_gpus
from tfdist.jobview import JobView, Reason, final_task_state, reason_for
from tfdist.procid import ProcessId
from tfdist.runtime import allreduce, events, history, lifeline, psrestart
from tfdist.runtime.deathsig import die_with_parent
from tfdist.runtime.forked import ForkServer, import_env
from tfdist.runtime.outcome import coordinator_outcome
from tfdist.runtime.tasklog import LineSplitter, RollingLog
from tfdist.runtime.unixsock import short_path
from tfdist.sampler import TaskProcess, TaskSampler
from tfdist.settings import ENV_EVENTS_FD, TaskSettings
from tfdist.taskenv import THREAD_VARS
from tfdist.tf_config import TaskId

MAX_WORKER_RESTARTS = 3
KILL_GRACE_S = 3.0
TICK_S = 1.0
WATCHER_BUFFER_MAX = 8 * 2**20
TASK_OOM_SCORE_ADJ = b"800"
PENDING_LOG_MAX = 2000  # log lines held between two ticks


class StartupError(Exception):
    pass


class StartupTimeout(StartupError):
    pass


# Out of memory, a task goes first, not the kernel: the kernel's OOM killer and the hub's watchdog both
# prefer a higher oom_score_adj. Every task dies with the supervisor, even a SIGKILLed one.
_die_with_parent = die_with_parent(TASK_OOM_SCORE_ADJ)


@dataclass
class Task:
    name: str
    port: int
    env: dict[str, str]
    gpus: list[str] = field(default_factory=list)
    proc: Any = None  # an asyncio.subprocess.Process, or a runtime.forked.ForkedProcess
    restarts: int = 0
    log: Any = None
    reader: asyncio.Task | None = None
    killed_for: str | None = None  # why the supervisor killed it, for the messages that follow


def _ended(task: Task, code: int | None) -> str:
    """How a task ended, in words: our own kill says why; a SIGKILL from elsewhere is most often memory."""
    if task.killed_for:
        return f"was killed: {task.killed_for}"
    if code == -signal.SIGKILL:
        return "was killed (SIGKILL: most often the server's memory limit)"
    return f"exited with code {code}"


def allocate_ports(n: int, base: int | None) -> list[int]:
    """Free ports on 127.0.0.1 (in this namespace), or base..base+n-1 checked free."""
    if base is not None:
        ports = list(range(base, base + n))
        for p in ports:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    raise StartupError(
                        f"port {p} is already in use (--base-port {base} needs ports {base}-{base + n - 1})"
                    ) from None
        return ports
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Supervisor:
    def __init__(self, jobdir: str):
        self.jobdir = jobdir
        with open(os.path.join(jobdir, "spec.json")) as f:
            self.spec = JobSpec.from_json(f.read())
        with open(os.path.join(jobdir, "launch.json")) as f:
            self.launch = json.load(f)
        self.view = JobView(
            name=self.spec.name,
            user=self.spec.user,
            backend="local",
            total_tasks=self.spec.task_count,
            spec=json.loads(self.spec.to_json()),
        )
        self.tasks: dict[str, Task] = {}
        self.watchers: set[asyncio.StreamWriter] = set()
        self.pending_logs: list[tuple[str, str]] = []
        self.stop_reason: str | None = None
        self.stop_code: Reason | None = None  # why, in the shared vocabulary (jobview.Reason)
        self.last_budget: memfit.Budget | None = None  # the server's memory as last sampled
        self.oom_base = lifeline.oom_kills()
        self.failure: dict[str, str] | None = None  # what ended the job, when it was not the cell
        self.peaks_mib: dict[str, float] = {}  # per role, remembered for the next job's memory estimate
        pid = str(self.launch.get("env", {}).get(memfit.SERVER_PID_ENV, ""))
        self.server_pid = int(pid) if pid.isdigit() else None
        self.stopping = asyncio.Event()
        self.sampler = TaskSampler()
        self.events_r: int | None = None
        self.recovery = psrestart.PsRestart(self.spec, jobdir)  # --checkpoint-every: a lost PS comes back
        # the job's fork server (runtime.forked) until chief-0 starts: a warm pool's, or its own
        self.forks: ForkServer | None = None

    # ------------------------------------------------------------------ events
    def emit(self, ev: Event | dict[str, Any]) -> None:
        """Fold a record into the job's view, send it to every watcher, and keep state.json current.
        A wire dict (runtime.psrestart still builds those) is read as a record first."""
        ev = parse(ev)
        self.view.apply(ev)
        data = events.dumps(to_wire(ev))
        for w in list(self.watchers):
            try:
                if w.transport.get_write_buffer_size() > WATCHER_BUFFER_MAX:  # a stalled reader
                    self.watchers.discard(w)
                    w.close()
                    continue
                w.write(data)
            except Exception:
                self.watchers.discard(w)
        if isinstance(ev, StateEvent):
            self._write_state()

    def _write_state(self) -> None:
        tmp = os.path.join(self.jobdir, "state.json.tmp")
        with open(tmp, "w") as f:
            # what `%tfdist status` and the lab panel show once this process is gone
            extra = {
                "error": self.view.error,
                "pid": os.getpid(),
                "tasks": self.view.tasks,
                "epoch_logs": self.view.epoch_logs,
                "metrics": history.downsample(list(self.view.metrics)),  # the panel's charts after the end
            }
            json.dump(self.view.summary() | extra, f)
        os.replace(tmp, os.path.join(self.jobdir, "state.json"))

    async def serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            req = json.loads(line or b"{}")
            op = req.get("op")
            if op == "stop":
                writer.write(events.dumps({"type": "ack"}))
                await writer.drain()
                # the kernel says "interrupted" when its cell was; %tfdist stop and the panel say nothing
                code = Reason.parse(req.get("reason"), Reason.STOPPED)
                code = code if code in (Reason.INTERRUPTED, Reason.STOPPED) else Reason.STOPPED
                self.request_stop(code.sentence(), code)
                return
            # its own view, folded from checked records: sent without checking it again (one per poll)
            writer.write(events.dumps(to_wire(SnapshotEvent.model_construct(view=self.view.to_dict()))))
            await writer.drain()
            if op == "watch" and not self.view.finished:
                self.watchers.add(writer)
                await reader.read()  # until the client goes away
        except Exception:
            pass
        finally:
            self.watchers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    # ------------------------------------------------------------------ processes
    async def _spawn(self, task: Task, module: str, extra_fds: tuple[int, ...] = ()) -> None:
        task.log = task.log or RollingLog(os.path.join(self.jobdir, "logs", f"{task.name}.log"))
        argv = [self.jobdir] if module.endswith("coordinator") else []
        cwd = self.launch.get("cwd") or self.jobdir
        # forked from the job's fork server (TensorFlow imported once) when it can be, else started fresh
        forked = None
        if self.forks is not None:
            forked = await self.forks.spawn(task.name, module, argv, task.env, cwd, extra_fds)
        if task.name == "chief-0":
            self._close_forks()  # started last: the job's later restarts start fresh
        task.proc = forked or await asyncio.create_subprocess_exec(
            sys.executable,
            "-u",
            "-m",
            module,
            *argv,
            env=task.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            pass_fds=extra_fds,
            cwd=cwd,
        )
        task.reader = asyncio.ensure_future(self._read_log(task, task.proc))
        self.sampler.track(TaskProcess(task.name, task.proc.pid, [int(g) for g in task.gpus if g.isdigit()]))
        self.emit(
            TaskEvent(
                task=task.name, state="starting", pid=task.proc.pid, restarts=task.restarts, gpus=task.gpus
            )
        )

    async def _start_forks(self) -> None:
        """Import TensorFlow once for the job's tasks, from the first moment (a warm pool's server has)."""
        if self.forks is None:
            self.forks = await ForkServer.start(import_env(self._base_env()), _die_with_parent)

    def _close_forks(self) -> None:
        if self.forks is not None:
            self.forks.close()
            self.forks = None

    async def _read_log(self, task: Task, proc: Any) -> None:
        """Chunks, not lines: output of any shape flows, so a task never blocks writing it."""
        assert proc.stdout is not None
        lines = LineSplitter()
        while chunk := await proc.stdout.read(65536):
            task.log.write(chunk)
            self._keep_lines(task.name, lines.feed(chunk))
        self._keep_lines(task.name, lines.flush())

    def _keep_lines(self, task: str, lines: list[str]) -> None:
        for line in lines:
            if not events.is_noise(line):
                self.pending_logs.append((task, line))
        if len(self.pending_logs) > PENDING_LOG_MAX:  # a flood between two ticks: keep the newest
            del self.pending_logs[: len(self.pending_logs) - PENDING_LOG_MAX]

    async def _spawn_coordinator(self, chief: Task) -> tuple[asyncio.Future, asyncio.Future]:
        """Start the coordinator with its events pipe; what to await for its end and for its events."""
        r, w = os.pipe()
        chief.env = chief.env | {ENV_EVENTS_FD: str(w)}
        await self._spawn(chief, "tfdist.runtime.coordinator", extra_fds=(w,))
        os.close(w)
        ev_reader = asyncio.ensure_future(self._coordinator_events(r))
        assert chief.proc is not None
        return asyncio.ensure_future(chief.proc.wait()), ev_reader

    async def _wait_listening(self, task: Task, deadline: float) -> None:
        while True:
            if task.proc is not None and task.proc.returncode is not None:
                await asyncio.sleep(0.2)
                tail = "\n".join(
                    line for t, line in list(self.view.logs) + self.pending_logs if t == task.name
                )
                raise StartupError(
                    f"{task.name} exited with code {task.proc.returncode} while starting:\n" + tail[-1500:]
                )
            try:
                _, w = await asyncio.open_connection("127.0.0.1", task.port)
                w.close()
                self.emit(TaskEvent(task=task.name, state="running"))
                return
            except OSError:
                pass
            if time.time() > deadline:
                raise StartupTimeout(
                    f"{task.name} did not start listening within --timeout {self.spec.timeout_s:g}s"
                )
            await asyncio.sleep(0.1)

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES", ENV_EVENTS_FD, "JPY_PARENT_PID", *THREAD_VARS):
            env.pop(k, None)
        env.update(self.launch.get("env", {}))
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers GPUs as NVML does
        return env

    def build_tasks(self) -> None:
        strategy = self.spec.strategy
        names = tf_config.task_names(self.spec.workers, self.spec.ps, strategy)
        ports = allocate_ports(len(names), self.spec.base_port)
        addresses = tf_config.local_addresses(self.spec.workers, self.spec.ps, ports, strategy=strategy)
        cluster = tf_config.cluster(addresses, strategy)
        gpu_ids: list[str] = self.launch.get("gpus", [])
        per_worker = split_gpus(gpu_ids, self.spec.workers, self.spec.gpus_per_worker)
        cores = taskenv.usable_cores()  # the server's share of the machine (the local hub pins it)
        for name, port in zip(names, ports, strict=True):
            role, idx = tf_config.split_task(name)
            if strategy == "allreduce":  # every task is a replica, chief-0 included
                gpus = per_worker[allreduce.replica_index(name)]
            else:
                gpus = per_worker[idx] if role == "worker" else []
            env = self._base_env() | taskenv.tf_env(
                tf_config=tf_config.tf_config(cluster, name),
                task=name,
                cpu=self.spec.cpu,
                cores=cores,
                strategy=strategy,
            )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            if name == "chief-0":
                env |= self.recovery.coordinator_env()
            self.tasks[name] = Task(name=name, port=port, env=env, gpus=gpus)
            self.emit(TaskEvent(task=name, state="pending", gpus=gpus))

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self, reason: str, code: Reason = Reason.STOPPED) -> None:
        if self.stop_reason is None:
            self.stop_reason, self.stop_code = reason, code
        self.stopping.set()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if self.pending_logs:
                lines, self.pending_logs = self.pending_logs, []
                self.emit(LogEvent(lines=lines))
            # the sampler's dict is the wire form (the pods post it as is): read back as a record
            try:
                sample = MetricsEvent.model_validate(self.sampler.sample())
            except ValueError:  # an unreadable sample is skipped, never the ticker
                continue
            self.emit(sample)
            self._enforce_memory(sample)

    def _enforce_memory(self, sample: MetricsEvent) -> None:
        for name, rec in sample.tasks.items():
            rss = rec.get("rss (MiB)")
            if rss is not None:
                role = tf_config.split_task(name)[0]
                self.peaks_mib[role] = max(self.peaks_mib.get(role, 0.0), float(rss))
        self._guard_server_memory()
        limit = self.spec.memory_bytes
        if not limit:
            return
        for name, rec in sample.tasks.items():
            rss = rec.get("rss (MiB)")
            task = self.tasks.get(name)
            if (
                rss is not None
                and rss * 2**20 > limit
                and task
                and task.proc
                and task.proc.returncode is None
            ):
                task.killed_for = f"it used {rss:.0f} MiB, over --memory {limit / 2**20:.0f} MiB"
                self.pending_logs.append((name, f"tfdist: {name} killed: {task.killed_for}"))
                with contextlib.suppress(ProcessLookupError):
                    task.proc.kill()

    def _guard_server_memory(self) -> None:
        """Stop the job before the server's limit: at the limit the kernel may be the one killed."""
        if self.server_pid is None or self.stopping.is_set():
            return
        budget = self.last_budget = memfit.server_budget(self.server_pid)
        if budget is None or budget.used < budget.limit * memfit.GUARD_SHARE:
            return
        why = (
            f"the notebook server's memory is nearly full ({budget.used / 2**30:.2f} of its "
            f"{budget.limit / 2**30:.2f} GiB limit, kernel and job together): the job was stopped so that "
            "the kernel survives; use fewer tasks or start your server with more memory"
        )
        self.pending_logs.append(("tfdist", "tfdist: " + why))
        self.failure = {"type": "OutOfMemory", "message": why, "traceback": ""}
        self.request_stop(why)

    async def _lifeline(self) -> None:
        """Stdin is a pipe from the launching kernel: EOF means the kernel is gone."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        with contextlib.suppress(Exception):
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
            await reader.read()
            deaths = sum(t.restarts for t in self.tasks.values()) + sum(
                1 for t in self.view.tasks.values() if t.get("state") == "failed"
            )
            code, why = lifeline.kernel_gone(self.oom_base, lifeline.oom_kills(), deaths, self.last_budget)
            self.request_stop(why, code)

    async def _watch_servers(self) -> None:
        """Restart a worker that dies mid-fit (the coordinator re-sends its work); a PS loss is fatal unless
        --checkpoint-every lets it come back (runtime.psrestart)."""
        while True:
            await asyncio.sleep(0.2)
            for task in self.tasks.values():
                if task.name == "chief-0" or task.proc is None or task.proc.returncode is None:
                    continue
                code = task.proc.returncode
                self.sampler.forget(task.name)
                if self.spec.strategy == "allreduce":
                    self._allreduce_worker_ended(task, code)
                    continue
                if TaskId.parse(task.name).role == "ps" and self.recovery.can_restart():
                    await self.recovery.ps_lost(self, task, _ended(task, code))
                    continue
                if TaskId.parse(task.name).role == "worker" and task.restarts < MAX_WORKER_RESTARTS:
                    task.restarts += 1
                    self.pending_logs.append(
                        (
                            task.name,
                            f"tfdist: {task.name} {_ended(task, code)}; "
                            f"restarting ({task.restarts}/{MAX_WORKER_RESTARTS})",
                        )
                    )
                    self.emit(
                        TaskEvent(task=task.name, state="restarting", exit_code=code, restarts=task.restarts)
                    )
                    task.killed_for = None
                    await self._spawn(task, "tfdist.runtime.task")
                else:
                    self.emit(TaskEvent(task=task.name, state="failed", exit_code=code))
                    task.proc = None
                    if TaskId.parse(task.name).role == "ps":
                        why = (
                            f"parameter server {task.name} {_ended(task, code)}; the fit cannot go on "
                            "without it (restart from a checkpoint)"
                        )
                        self.pending_logs.append((task.name, "tfdist: " + why))
                        self.failure = {"type": "ParameterServerLost", "message": why, "traceback": ""}
                        self.request_stop(why)

    def _allreduce_worker_ended(self, task: Task, code: int) -> None:
        """All-reduce workers run the cell to its end: 0 is done; anything else stalls every collective
        (MWMS cannot take one worker back mid-step), so the job ends with that worker named."""
        task.proc = None
        if code == 0:
            self.emit(TaskEvent(task=task.name, state="exited-ok", exit_code=0))
            return
        self.emit(TaskEvent(task=task.name, state="failed", exit_code=code))
        self.failure = allreduce.worker_failure(self.jobdir, task.name, _ended(task, code))
        self.pending_logs.append((task.name, "tfdist: " + self.failure["message"]))
        self.request_stop(self.failure["message"])

    async def _coordinator_events(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb"))
        async for line in reader:
            with contextlib.suppress(ValueError):  # EventError included: a malformed line is dropped
                ev = parse(events.loads(line))
                if isinstance(ev, ProgressEvent):  # the coordinator reports progress, nothing else
                    self.emit(ev)

    async def run(self) -> int:
        os.makedirs(os.path.join(self.jobdir, "logs"), exist_ok=True)
        await self._start_forks()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(
                sig,
                self.request_stop,
                f"{Reason.SIGNALLED.sentence()} ({signal.Signals(sig).name})",
                Reason.SIGNALLED,
            )
        sock_path = os.path.join(self.jobdir, "control.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock_path)
        with short_path(sock_path) as bindable:  # long homes and job names pass AF_UNIX's 107 bytes
            server = await asyncio.start_unix_server(self.serve_client, path=bindable)
        os.chmod(sock_path, 0o600)
        detached = bool(self.spec.extra.get("detach"))  # no kernel holds it: no lifeline to watch
        bg = [asyncio.ensure_future(c) for c in ([] if detached else [self._lifeline()]) + [self._ticker()]]
        self.emit(StateEvent(state="starting", message="starting tasks"))
        outcome: tuple[str, str, dict | None]
        try:
            outcome = await self._run_job()
        except StartupError as exc:
            outcome = (
                "failed",
                str(exc).splitlines()[0],
                {"type": type(exc).__name__, "message": str(exc), "traceback": ""},
            )
        except Exception as exc:  # a bug of ours: still clean up and say so
            outcome = (
                "failed",
                f"supervisor error: {exc}",
                {
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "traceback": "",
                    "reason": Reason.INTERNAL.value,
                },
            )
        await self._teardown(outcome[0])
        if self.pending_logs:
            lines, self.pending_logs = self.pending_logs, []
            self.emit(LogEvent(lines=lines))
        state, message, error = outcome
        if state == "succeeded":
            memfit.save_footprint(os.path.dirname(os.path.abspath(self.jobdir)), self.peaks_mib)
        with contextlib.suppress(FileNotFoundError):  # the model and data: may be hundreds of MB
            os.unlink(os.path.join(self.jobdir, "payload.bin"))
        self.emit(
            StateEvent(
                state=state,  # type: ignore[arg-type]
                message=message,
                t=time.time(),
                reason=reason_for(state, error, self.stop_code).value,
                error=error_info(error),
            )
        )
        for w in list(self.watchers):
            with contextlib.suppress(Exception):
                await w.drain()
                w.close()
        for t in bg:
            t.cancel()
        server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock_path)
        self.sampler.gpus.close()
        return 0 if state == "succeeded" else 1

    async def _run_job(self) -> tuple[str, str, dict | None]:
        self.build_tasks()
        stop_wait = asyncio.ensure_future(self.stopping.wait())
        deadline = time.time() + self.spec.timeout_s
        servers = [t for n, t in self.tasks.items() if n != "chief-0"]
        # all-reduce: every worker runs the cell (the coordinator program), not a bare server
        module = "tfdist.runtime.coordinator" if self.spec.strategy == "allreduce" else "tfdist.runtime.task"
        for t in servers:
            await self._spawn(t, module)
        # The coordinator starts at once, not after the servers: importing TensorFlow takes seconds and
        # overlaps with theirs; TF's own connect retries wait for servers that are still coming up.
        chief = self.tasks["chief-0"]
        chief_wait, ev_reader = await self._spawn_coordinator(chief)
        starting = asyncio.ensure_future(
            asyncio.gather(*(self._wait_listening(t, deadline) for t in servers))
        )
        done, _ = await asyncio.wait({starting, stop_wait, chief_wait}, return_when=asyncio.FIRST_COMPLETED)
        if stop_wait in done:
            starting.cancel()
            if self.failure:
                return ("failed", self.failure["message"], self.failure)
            return ("stopped", self.stop_reason or "stopped", None)
        if starting in done:
            starting.result()  # raises StartupError
            self.emit(TaskEvent(task="chief-0", state="running"))
            self.emit(StateEvent(state="running", message="training"))
            watcher = asyncio.ensure_future(self._watch_servers())
            while True:
                done, _ = await asyncio.wait({chief_wait, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if chief_wait not in done or not await self.recovery.should_resume(self):
                    break
                chief_wait, ev_reader = await self._spawn_coordinator(chief)  # resumes from its checkpoint
            watcher.cancel()
            if chief_wait not in done:
                if self.failure:
                    return ("failed", self.failure["message"], self.failure)
                return ("stopped", self.stop_reason or "stopped", None)
        else:  # the coordinator ended before the servers were up: its error says why
            starting.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ev_reader, 2)
        if chief.reader:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(chief.reader, 2)
        self.emit(
            TaskEvent(
                task="chief-0",
                state="exited-ok" if chief.proc.returncode == 0 else "failed",
                exit_code=chief.proc.returncode,
            )
        )
        code = chief.proc.returncode
        out = coordinator_outcome(self.jobdir, code, _ended(chief, code))
        return (out.state, out.message, out.error)

    async def _teardown(self, state: str) -> None:
        self._close_forks()
        alive = [t for t in self.tasks.values() if t.proc is not None and t.proc.returncode is None]
        procs = [t.proc for t in alive if t.proc is not None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        if procs:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=KILL_GRACE_S)
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await asyncio.gather(*(p.wait() for p in procs), return_exceptions=True)
        for t in self.tasks.values():
            if t.reader is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(t.reader, 1)
            if t.log is not None:
                t.log.close()
        for t in alive:  # ended by us: "exited" after a success, "stopped" otherwise (never "running")
            self.emit(TaskEvent(task=t.name, state=final_task_state(state, "running")))


async def serve(jobdir: str, forks: ForkServer | None = None) -> int:
    """Run the job in JOBDIR to its end; `forks`: the warm pool's fork server, if it was started warm."""
    pidfile = os.path.join(jobdir, "supervisor.pid")
    with open(pidfile, "w") as f:
        f.write(ProcessId.current().dumps())  # the PID alone could name another process later
    try:
        sup = Supervisor(jobdir)
        sup.forks = forks
        return await sup.run()
    finally:
        if forks is not None:
            forks.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pidfile)


def main() -> int:
    jobdir = sys.argv[1]
    if TaskSettings().netns:
        from tfdist.runtime.netns import bring_up_loopback

        bring_up_loopback()
    return asyncio.run(serve(jobdir))


if __name__ == "__main__":
    sys.exit(main())
