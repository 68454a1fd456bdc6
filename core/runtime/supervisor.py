"""The local job supervisor: one process per job that owns every task process of it.

Usage: [unshare --net ...] python -m tfdist.runtime.supervisor JOBDIR

It starts the PS and worker servers and the coordinator, streams their state, logs and metrics to
whoever watches JOBDIR/control.sock, and ends them all when the coordinator finishes, on a `stop`
request, on SIGTERM/SIGINT, or when its standard input closes (the kernel that launched it died:
its end of that pipe is the job's lifeline). A detached job (`--detach`) has no lifeline: it runs to its
end without the kernel and leaves its results in JOBDIR for `%tfdist attach`. Every child is also bound to
this process with PR_SET_PDEATHSIG, so even a SIGKILL of the supervisor leaves nothing running.

This module is the orchestration: the order of things, from the first task's start to the job's last
event. Its parts: the control socket (runtime.control), starting tasks (runtime.spawn), the memory guards
and the lifeline (runtime.guards), the restart policy applied to a server that ended (runtime.serverwatch),
a PS's comeback (runtime.psrestart), stopping the tasks and the outcome of a run that raised
(runtime.jobend), state.json (runtime.statefile).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

from tfdist import memfit
from tfdist.job.events import (
    Event,
    LogEvent,
    MetricsEvent,
    StateEvent,
    TaskEvent,
    error_info,
    parse,
    to_wire,
)
from tfdist.job.restart import RestartPolicy
from tfdist.job.view import JobView, final_task_state, reason_for
from tfdist.job.vocab import JobState, Reason, TaskState
from tfdist.jobspec import JobSpec
from tfdist.procid import ProcessId
from tfdist.runtime import events, psrestart
from tfdist.runtime.control import ControlServer
from tfdist.runtime.forked import ForkServer
from tfdist.runtime.guards import Lifeline, MemoryGuard
from tfdist.runtime.jobend import Outcome, end_tasks, raised
from tfdist.runtime.outcome import coordinator_outcome
from tfdist.runtime.serverwatch import ServerWatch
from tfdist.runtime.spawn import COORDINATOR_MODULE, SERVER_MODULE, PendingLines, Spawner, Task, ended
from tfdist.runtime.statefile import write_state
from tfdist.sampler import TaskSampler
from tfdist.settings import TaskSettings

TICK_S = 1.0
SERVER_CHECK_S = 2.0  # a detached job checks that its notebook server is still there


class Supervisor:
    """One local job from its first task's start to its last one's end; PsRestart's `TaskHost`."""

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
        self.pending_logs = PendingLines()
        self.stop_reason: str | None = None
        self.stop_code: Reason | None = None  # why, in the shared vocabulary (jobview.Reason)
        self.failure: dict[str, str] | None = None  # what ended the job, when it was not the cell
        self.policy = RestartPolicy.for_spec(self.spec)
        pid = str(self.launch.get("env", {}).get(memfit.SERVER_PID_ENV, ""))
        self.memory = MemoryGuard(
            self.spec.memory_bytes, int(pid) if pid.isdigit() else None, self.pending_logs
        )
        # the notebook server, as it is now (a PID alone may name another process later)
        self.server = ProcessId.of(int(pid)) if pid.isdigit() and int(pid) > 1 else None
        self.lifeline = Lifeline()
        self.stopping = asyncio.Event()
        self.sampler = TaskSampler()
        self.spawner = Spawner(jobdir, self.spec, self.launch, self.sampler, self.emit, self.pending_logs)
        self.control = ControlServer(
            os.path.join(jobdir, "control.sock"),
            view=self.view.to_dict,
            finished=lambda: self.view.finished,
            stop=lambda code: self.request_stop(code.sentence(), code),
        )
        self.recovery = psrestart.PsRestart(self.spec, jobdir)  # --checkpoint-every: a lost PS comes back
        self.servers = ServerWatch(self.spec, jobdir, self.policy, self.recovery, self, self._stop_for)

    @property
    def forks(self) -> ForkServer | None:
        return self.spawner.forks

    @forks.setter
    def forks(self, forks: ForkServer | None) -> None:
        self.spawner.forks = forks

    # ------------------------------------------------------------------ what PsRestart uses (TaskHost)
    def emit(self, ev: Event | dict[str, Any]) -> None:
        """Fold a record into the job's view, send it to every watcher, and keep state.json current."""
        ev = parse(ev)
        self.view.apply(ev)
        self.control.broadcast(events.dumps(to_wire(ev)))
        if isinstance(ev, StateEvent):
            write_state(self.jobdir, self.view, os.getpid())

    def log(self, task: str, line: str) -> None:
        self.pending_logs.add(task, line)

    async def respawn(self, task: Task) -> None:
        await self.spawner.spawn(task, SERVER_MODULE)

    def forget(self, task: str) -> None:
        self.sampler.forget(task)

    # ------------------------------------------------------------------ lifecycle
    async def _server_watch(self) -> None:
        """A detached job outlives its kernel, not its notebook server. Where the hub gives each server a
        cgroup, the server's stop ends everything in it; without one (the hub's watchdog, which knows only
        the server's process tree as last seen, or a server the hub does not run) nothing else would end
        this job, which runs in a session of its own and holds the server's GPUs after they were handed
        out again."""
        if self.server is None:
            return
        while True:
            await asyncio.sleep(SERVER_CHECK_S)
            if not self.server.alive():
                self.request_stop(
                    f"{Reason.SIGNALLED.sentence()}: the notebook server that started it is gone "
                    "(a detached job outlives its kernel, not its server)",
                    Reason.SIGNALLED,
                )
                return

    def request_stop(self, reason: str, code: Reason = Reason.STOPPED) -> None:
        if self.stop_reason is None:
            self.stop_reason, self.stop_code = reason, code
        self.stopping.set()

    def _stop_for(self, why: str, code: Reason, failure: dict[str, str] | None) -> None:
        """A guard's verdict: stop the job, with the failure record when it was not the cell's doing."""
        if failure is not None:
            self.failure = failure
        self.request_stop(why, code)

    def _flush_logs(self) -> None:
        if self.pending_logs:
            self.emit(LogEvent(lines=self.pending_logs.take()))

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._flush_logs()
            # the sampler's dict is the wire form (the pods post it as is): read back as a record
            try:
                sample = MetricsEvent.model_validate(self.sampler.sample())
            except ValueError:  # an unreadable sample is skipped, never the ticker
                continue
            self.emit(sample)
            self.memory.check(sample, self.tasks, self.stopping.is_set(), self._stop_for)

    def _deaths(self) -> int:
        """Our tasks that died so far (each may have been an OOM kill of its own)."""
        return sum(t.restarts for t in self.tasks.values()) + sum(
            1 for t in self.view.tasks.values() if t.get("state") == TaskState.FAILED
        )

    async def run(self) -> int:
        os.makedirs(os.path.join(self.jobdir, "logs"), exist_ok=True)
        await self.spawner.start_forks()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(
                sig,
                self.request_stop,
                f"{Reason.SIGNALLED.sentence()} ({signal.Signals(sig).name})",
                Reason.SIGNALLED,
            )
        await self.control.start()
        detached = self.spec.detach  # no kernel holds it: no lifeline to watch
        bg = [asyncio.ensure_future(self._ticker())]
        if not detached:
            budget = lambda: self.memory.last_budget  # noqa: E731
            bg.append(asyncio.ensure_future(self.lifeline.watch(self._deaths, budget, self._stop_for)))
        else:
            bg.append(asyncio.ensure_future(self._server_watch()))
        self.emit(StateEvent(state=JobState.STARTING, message="starting tasks"))
        outcome: Outcome
        try:
            outcome = await self._run_job()
        except Exception as exc:  # a task that could not start, or a bug of ours: still clean up and say so
            outcome = raised(exc)
        await self._teardown(outcome[0])
        self._flush_logs()
        state, message, error = outcome
        if state == JobState.SUCCEEDED:
            memfit.save_footprint(os.path.dirname(os.path.abspath(self.jobdir)), self.memory.peaks_mib)
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
        await self.control.close()
        for t in bg:
            t.cancel()
        self.sampler.gpus.close()
        return 0 if state == JobState.SUCCEEDED else 1

    def _stopped(self) -> Outcome:
        if self.failure:
            return (JobState.FAILED, self.failure["message"], self.failure)
        return (JobState.STOPPED, self.stop_reason or "stopped", None)

    def _output(self, task: str) -> list[str]:
        """A task's lines so far: those already sent and those waiting for the next tick."""
        return [line for t, line in list(self.view.logs) + self.pending_logs.lines if t == task]

    async def _run_job(self) -> Outcome:
        self.tasks = self.spawner.build_tasks(self.recovery.coordinator_env())
        stop_wait = asyncio.ensure_future(self.stopping.wait())
        deadline = time.time() + self.spec.timeout_s
        servers = [t for n, t in self.tasks.items() if n != "chief-0"]
        # all-reduce: every worker runs the cell (the coordinator program), not a bare server
        module = COORDINATOR_MODULE if self.spec.strategy == "allreduce" else SERVER_MODULE
        chief = self.tasks["chief-0"]

        async def launch() -> tuple[asyncio.Future, asyncio.Future]:
            # The coordinator starts first: its way to the fit (payload, model, strategy) is the job's
            # longest, and it waits for the servers' ports itself before it connects (runtime.strategy).
            started = await self.spawner.spawn_coordinator(chief)
            for t in servers:
                await self.spawner.spawn(t, module)
            self.spawner.close_forks()  # the job's later restarts start fresh
            return started

        # Spawning waits for the fork server's TensorFlow import (seconds, tens under load): a kernel that
        # dies meanwhile (the lifeline) or a stop must end the job now, not once the import is done.
        launching = asyncio.ensure_future(launch())
        await asyncio.wait({launching, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not launching.done():
            launching.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await launching
            return self._stopped()
        chief_wait, ev_reader = launching.result()
        starting = asyncio.ensure_future(
            asyncio.gather(*(self.spawner.wait_listening(t, deadline, self._output) for t in servers))
        )
        done, _ = await asyncio.wait({starting, stop_wait, chief_wait}, return_when=asyncio.FIRST_COMPLETED)
        if stop_wait in done:
            starting.cancel()
            return self._stopped()
        if starting in done:
            starting.result()  # raises StartupError
            self.emit(TaskEvent(task="chief-0", state=TaskState.RUNNING))
            self.emit(StateEvent(state=JobState.RUNNING, message="training"))
            watcher = asyncio.ensure_future(self.servers.watch())
            while True:
                done, _ = await asyncio.wait({chief_wait, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if chief_wait not in done or not await self.recovery.should_resume(self):
                    break
                chief_wait, ev_reader = await self.spawner.spawn_coordinator(
                    chief
                )  # resumes from its checkpoint
            watcher.cancel()
            if chief_wait not in done:
                return self._stopped()
        else:  # the coordinator ended before the servers were up: its error says why
            starting.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ev_reader, 2)
        if chief.reader:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(chief.reader, 2)
        code = chief.proc.returncode
        self.emit(
            TaskEvent(
                task="chief-0", state=TaskState.EXITED_OK if code == 0 else TaskState.FAILED, exit_code=code
            )
        )
        out = coordinator_outcome(self.jobdir, code, ended(chief, code), self.spec.strategy)
        return (out.state, out.message, out.error)

    async def _teardown(self, state: str) -> None:
        self.spawner.close_forks()
        for t in await end_tasks(self.tasks.values()):
            # ended by us: "exited" after a success, "stopped" otherwise (never "running")
            self.emit(TaskEvent(task=t.name, state=final_task_state(state, TaskState.RUNNING)))


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
