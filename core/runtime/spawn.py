"""Starting a local job's task processes: their ports, environments and GPUs, forked or fresh, and their
output read into the job's log.

Why apart from the supervisor: how a task is started (fork server, death signal, oom_score_adj, log pipe)
does not depend on why (first start, a worker's restart, a PS's comeback); the supervisor decides why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tfdist import taskenv, tf_config
from tfdist.job.events import Event, ProgressEvent, TaskEvent, parse
from tfdist.job.vocab import TaskState
from tfdist.jobspec import JobSpec, split_gpus
from tfdist.runtime import allreduce, events
from tfdist.runtime.deathsig import die_with_parent
from tfdist.runtime.forked import ForkServer, import_env
from tfdist.runtime.ports import PortTaken, allocate_ports
from tfdist.runtime.tasklog import LineSplitter, RollingLog
from tfdist.sampler import TaskProcess, TaskSampler, sampler_gpus
from tfdist.settings import ENV_EVENTS_FD
from tfdist.taskenv import THREAD_VARS

TASK_OOM_SCORE_ADJ = b"800"
PENDING_LOG_MAX = 2000  # log lines held between two ticks
SERVER_MODULE = "tfdist.runtime.task"
COORDINATOR_MODULE = "tfdist.runtime.coordinator"

# Out of memory, a task goes first, not the kernel: the kernel's OOM killer and the hub's watchdog both
# prefer a higher oom_score_adj. Every task dies with the supervisor, even a SIGKILLed one.
die_with_task_parent = die_with_parent(TASK_OOM_SCORE_ADJ)


class StartupError(Exception):
    pass


class StartupTimeout(StartupError):
    pass


@dataclass
class Task:
    """One task of the job and its current process (a restart gives it a new one, same port and env)."""

    name: str
    port: int
    env: dict[str, str]
    gpus: list[str] = field(default_factory=list)
    proc: Any = None  # an asyncio.subprocess.Process, or a runtime.forked.ForkedProcess
    restarts: int = 0
    log: Any = None
    reader: asyncio.Task | None = None
    killed_for: str | None = None  # why the supervisor killed it, for the messages that follow

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


def ended(task: Task, code: int | None) -> str:
    """How a task ended, in words: our own kill says why; a SIGKILL from elsewhere is most often memory."""
    if task.killed_for:
        return f"was killed: {task.killed_for}"
    if code == -signal.SIGKILL:
        return "was killed (SIGKILL: most often the server's memory limit)"
    return f"exited with code {code}"


class PendingLines:
    """Log lines held between two ticks of the supervisor; a flood keeps the newest."""

    def __init__(self, cap: int = PENDING_LOG_MAX) -> None:
        self.cap = cap
        self.lines: list[tuple[str, str]] = []

    def add(self, task: str, line: str) -> None:
        self.keep(task, [line], filter_noise=False)

    def keep(self, task: str, lines: Iterable[str], filter_noise: bool = True) -> None:
        self.lines += [(task, line) for line in lines if not (filter_noise and events.is_noise(line))]
        if len(self.lines) > self.cap:
            del self.lines[: len(self.lines) - self.cap]

    def take(self) -> list[tuple[str, str]]:
        lines, self.lines = self.lines, []
        return lines

    def __bool__(self) -> bool:
        return bool(self.lines)


class Spawner:
    """Starts a job's tasks as children of this process and reads their output."""

    def __init__(
        self,
        jobdir: str,
        spec: JobSpec,
        launch: dict[str, Any],
        sampler: TaskSampler,
        emit: Callable[[Event], None],
        pending: PendingLines,
    ) -> None:
        self.jobdir, self.spec, self.launch = jobdir, spec, launch
        self.sampler, self.emit, self.pending = sampler, emit, pending
        # the job's fork server (runtime.forked) until chief-0 starts: a warm pool's, or its own
        self.forks: ForkServer | None = None

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES", ENV_EVENTS_FD, "JPY_PARENT_PID", *THREAD_VARS):
            env.pop(k, None)
        env.update(self.launch.get("env", {}))
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers GPUs as NVML does
        return env

    def build_tasks(self, coordinator_env: dict[str, str]) -> dict[str, Task]:
        """Every task of the job with its port, environment and GPUs, announced as pending."""
        spec, strategy = self.spec, self.spec.strategy
        names = tf_config.task_names(spec.workers, spec.ps, strategy)
        try:
            ports = allocate_ports(len(names), spec.base_port)
        except PortTaken as exc:
            raise StartupError(str(exc)) from None
        addresses = tf_config.local_addresses(spec.workers, spec.ps, ports, strategy=strategy)
        cluster = tf_config.cluster(addresses, strategy)
        gpu_ids: list[str] = self.launch.get("gpus", [])
        per_worker = split_gpus(gpu_ids, spec.workers, spec.gpus_per_worker)
        cores = taskenv.usable_cores()  # the server's share of the machine (the local hub pins it)
        tasks: dict[str, Task] = {}
        for name, port in zip(names, ports, strict=True):
            role, idx = tf_config.split_task(name)
            if strategy == "allreduce":  # every task is a replica, chief-0 included
                gpus = per_worker[allreduce.replica_index(name)]
            else:
                gpus = per_worker[idx] if role == "worker" else []
            env = self.base_env() | taskenv.tf_env(
                tf_config=tf_config.tf_config(cluster, name),
                task=name,
                cpu=spec.cpu,
                cores=cores,
                strategy=strategy,
            )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            if name == "chief-0":
                env |= coordinator_env
            tasks[name] = Task(name=name, port=port, env=env, gpus=gpus)
            self.emit(TaskEvent(task=name, state=TaskState.PENDING, gpus=gpus))
        return tasks

    async def spawn(self, task: Task, module: str, extra_fds: tuple[int, ...] = ()) -> None:
        task.log = task.log or RollingLog(os.path.join(self.jobdir, "logs", f"{task.name}.log"))
        argv = [self.jobdir] if module == COORDINATOR_MODULE else []
        cwd = self.launch.get("cwd") or self.jobdir
        # forked from the job's fork server (TensorFlow imported once) when it can be, else started fresh
        forked = None
        if self.forks is not None:
            forked = await self.forks.spawn(task.name, module, argv, task.env, cwd, extra_fds)
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
            preexec_fn=die_with_task_parent,
            pass_fds=extra_fds,
            cwd=cwd,
        )
        task.reader = asyncio.ensure_future(self._read_log(task, task.proc))
        self.sampler.track(TaskProcess(task.name, task.proc.pid, sampler_gpus(task.gpus)))
        self.emit(
            TaskEvent(
                task=task.name,
                state=TaskState.STARTING,
                pid=task.proc.pid,
                restarts=task.restarts,
                gpus=task.gpus,
            )
        )

    async def start_forks(self) -> None:
        """Import TensorFlow once for the job's tasks, from the first moment (a warm pool's server has)."""
        if self.forks is None:
            self.forks = await ForkServer.start(import_env(self.base_env()), die_with_task_parent)

    def close_forks(self) -> None:
        if self.forks is not None:
            self.forks.close()
            self.forks = None

    async def _read_log(self, task: Task, proc: Any) -> None:
        """Chunks, not lines: output of any shape flows, so a task never blocks writing it."""
        assert proc.stdout is not None
        lines = LineSplitter()
        while chunk := await proc.stdout.read(65536):
            task.log.write(chunk)
            self.pending.keep(task.name, lines.feed(chunk))
        self.pending.keep(task.name, lines.flush())

    async def spawn_coordinator(self, chief: Task) -> tuple[asyncio.Future, asyncio.Future]:
        """Start the coordinator with its events pipe; what to await for its end and for its events."""
        r, w = os.pipe()
        chief.env = chief.env | {ENV_EVENTS_FD: str(w)}
        await self.spawn(chief, COORDINATOR_MODULE, extra_fds=(w,))
        os.close(w)
        ev_reader = asyncio.ensure_future(self._coordinator_events(r))
        assert chief.proc is not None
        return asyncio.ensure_future(chief.proc.wait()), ev_reader

    async def _coordinator_events(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb"))
        async for line in reader:
            with contextlib.suppress(ValueError):  # EventError included: a malformed line is dropped
                ev = parse(events.loads(line))
                if isinstance(ev, ProgressEvent):  # the coordinator reports progress, nothing else
                    self.emit(ev)

    async def wait_listening(
        self, task: Task, deadline: float, output: Callable[[str], Iterable[str]]
    ) -> None:
        """Until the task's server accepts connections; `output(name)`: its lines so far, for the error."""
        while True:
            if task.proc is not None and task.proc.returncode is not None:
                await asyncio.sleep(0.2)
                tail = "\n".join(output(task.name))
                raise StartupError(
                    f"{task.name} exited with code {task.proc.returncode} while starting:\n" + tail[-1500:]
                )
            try:
                _, w = await asyncio.open_connection("127.0.0.1", task.port)
                w.close()
                self.emit(TaskEvent(task=task.name, state=TaskState.RUNNING))
                return
            except OSError:
                pass
            if time.time() > deadline:
                raise StartupTimeout(
                    f"{task.name} did not start listening within --timeout {self.spec.timeout_s:g}s"
                )
            await asyncio.sleep(0.1)
