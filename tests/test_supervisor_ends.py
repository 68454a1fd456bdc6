"""The local supervisor's ending parts on their own, without a job: the restart policy read against a
server's exit (runtime.serverwatch) and the tasks stopped at the job's end (runtime.jobend, real
processes: one that ends on SIGTERM, one that ignores it and is killed after the grace)."""

from __future__ import annotations

import asyncio
import signal
import sys

from tfdist.job.events import Event, TaskEvent
from tfdist.job.restart import WORKER_RESTARTS, RestartPolicy
from tfdist.job.vocab import FailureKind, JobState, Reason, TaskState
from tfdist.jobspec import JobSpec
from tfdist.runtime import jobend
from tfdist.runtime.psrestart import PsRestart
from tfdist.runtime.serverwatch import ServerWatch
from tfdist.runtime.spawn import StartupError, Task


class Host:
    """The supervisor as the watch sees it (psrestart.TaskHost): what it was told, in order."""

    def __init__(self, tasks: dict[str, Task]) -> None:
        self.tasks = tasks
        self.events: list[Event] = []
        self.lines: list[tuple[str, str]] = []
        self.respawned: list[str] = []
        self.forgotten: list[str] = []
        self.stops: list[tuple[str, Reason, dict | None]] = []

    def emit(self, ev: Event) -> None:
        self.events.append(ev)

    def log(self, task: str, line: str) -> None:
        self.lines.append((task, line))

    async def respawn(self, task: Task) -> None:
        self.respawned.append(task.name)

    def forget(self, task: str) -> None:
        self.forgotten.append(task)

    def stop(self, why: str, code: Reason, failure: dict | None) -> None:
        self.stops.append((why, code, failure))


def _watch(tmp_path, spec: JobSpec, *names: str) -> tuple[ServerWatch, Host]:
    host = Host({n: Task(name=n, port=0, env={}) for n in ("chief-0", *names)})
    policy = RestartPolicy.for_spec(spec)
    watch = ServerWatch(spec, str(tmp_path), policy, PsRestart(spec, str(tmp_path)), host, host.stop)
    return watch, host


def test_a_lost_worker_comes_back_until_its_limit_then_stays_down_without_ending_the_job(tmp_path) -> None:
    watch, host = _watch(tmp_path, JobSpec(name="j", user="u", workers=2, ps=1), "worker-1", "ps-0")
    worker = host.tasks["worker-1"]
    for _ in range(WORKER_RESTARTS):
        asyncio.run(watch.ended(worker, 1))
    assert host.respawned == ["worker-1"] * WORKER_RESTARTS and worker.restarts == WORKER_RESTARTS
    assert host.events[0] == TaskEvent(task="worker-1", state=TaskState.RESTARTING, exit_code=1, restarts=1)
    assert host.lines[0] == (
        "worker-1",
        f"tfdist: worker-1 exited with code 1; restarting (1/{WORKER_RESTARTS})",
    )
    asyncio.run(watch.ended(worker, 1))
    assert host.events[-1] == TaskEvent(task="worker-1", state=TaskState.FAILED, exit_code=1)
    assert len(host.respawned) == WORKER_RESTARTS and not host.stops  # the other workers carry on
    assert host.forgotten == ["worker-1"] * (WORKER_RESTARTS + 1)


def test_a_lost_ps_without_checkpoints_ends_the_job_naming_it(tmp_path) -> None:
    watch, host = _watch(tmp_path, JobSpec(name="j", user="u", workers=1, ps=1), "worker-0", "ps-0")
    asyncio.run(watch.ended(host.tasks["ps-0"], -signal.SIGKILL))
    why = (
        "parameter server ps-0 was killed (SIGKILL: most often the server's memory limit); the fit cannot "
        "go on without it (restart from a checkpoint)"
    )
    assert host.stops == [
        (why, Reason.STOPPED, {"type": FailureKind.PS_LOST.value, "message": why, "traceback": ""})
    ]
    assert host.events == [TaskEvent(task="ps-0", state=TaskState.FAILED, exit_code=-signal.SIGKILL)]
    assert host.lines == [("ps-0", "tfdist: " + why)] and not host.respawned


def test_an_allreduce_worker_that_finished_is_done_and_one_that_failed_ends_the_job(tmp_path) -> None:
    spec = JobSpec(name="j", user="u", workers=3, ps=0, strategy="allreduce")
    watch, host = _watch(tmp_path, spec, "worker-0", "worker-1")
    asyncio.run(watch.ended(host.tasks["worker-0"], 0))
    assert host.events == [TaskEvent(task="worker-0", state=TaskState.EXITED_OK, exit_code=0)]
    assert not host.stops
    asyncio.run(watch.ended(host.tasks["worker-1"], 3))
    assert host.events[-1] == TaskEvent(task="worker-1", state=TaskState.FAILED, exit_code=3)
    ((why, code, failure),) = host.stops
    assert "worker-1" in why and code is Reason.STOPPED and failure and failure["message"] == why


def test_a_run_that_raised_says_why_a_task_could_not_start_or_that_it_is_our_bug() -> None:
    state, message, error = jobend.raised(StartupError("worker-0 did not listen\nits log: ..."))
    assert (state, message) == (JobState.FAILED, "worker-0 did not listen")
    assert error == {
        "type": "StartupError",
        "message": "worker-0 did not listen\nits log: ...",
        "traceback": "",
    }
    state, message, error = jobend.raised(KeyError("x"))
    assert (state, message) == (JobState.FAILED, "supervisor error: 'x'")
    assert error and error["reason"] == Reason.INTERNAL.value


def test_ending_the_tasks_terms_kills_the_stubborn_and_closes_their_logs(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(jobend, "KILL_GRACE_S", 0.5)
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
        "time.sleep(60)"
    )

    async def main() -> None:
        polite = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
        deaf = await asyncio.create_subprocess_exec(
            sys.executable, "-c", stubborn, stdout=asyncio.subprocess.PIPE
        )
        assert deaf.stdout is not None and await deaf.stdout.readline() == b"up\n"  # SIGTERM ignored from now
        done = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        await done.wait()
        logs = [open(tmp_path / f"{n}.log", "wb") for n in range(3)]
        tasks = [
            Task(name=n, port=0, env={}, proc=p, log=log)
            for n, p, log in zip(("worker-0", "ps-0", "worker-1"), (polite, deaf, done), logs, strict=True)
        ]
        alive = await asyncio.wait_for(jobend.end_tasks(tasks), 10)
        assert [t.name for t in alive] == ["worker-0", "ps-0"]
        assert polite.returncode == -signal.SIGTERM and deaf.returncode == -signal.SIGKILL
        assert all(log.closed for log in logs)

    asyncio.run(main())
