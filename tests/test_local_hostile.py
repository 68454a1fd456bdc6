"""Local jobs under hostile conditions a user meets sooner or later: output of any shape, long paths,
PIDs the system reused, big payloads left on disk. Real supervisors and TensorFlow processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.kernels import RUN_MARK
from tfdist.backends.base import Launch
from tfdist.backends.local import LocalBackend
from tfdist.jobspec import JobSpec
from tfdist.jobview import JobView
from tfdist.payload import pack
from tfdist.procid import ProcessId

pytestmark = pytest.mark.slow

LAUNCH = Launch(env={"TF_CPP_MIN_LOG_LEVEL": "3", "TFDIST_TEST_RUN": RUN_MARK})


async def run_job(backend: LocalBackend, name: str, source: str, timeout: float = 240) -> JobView:
    spec = JobSpec(name=name, user="me", workers=1, ps=1, timeout_s=120)
    await backend.submit(spec, pack(source, [], {}), LAUNCH)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            view = await backend.status(name)
            if view.finished:
                return view
            await asyncio.sleep(0.5)
        raise AssertionError(f"job {name} did not end in {timeout}s: {view.state} {view.message}")
    finally:
        await backend.stop(name)


async def test_one_long_line_and_a_carriage_return_progress_bar_do_not_hang_a_job(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path / "jobs"))
    source = (
        "import sys\n"
        "sys.stdout.write('x' * 2**21)\n"  # 2 MiB without a newline: past asyncio's 64 KiB line limit
        "sys.stdout.flush()\n"
        "for i in range(20000):\n"
        "    print(f'\\rstep {i}/20000', end='', flush=True)\n"
        "print()\n"
        "print('after the flood')\n"
        "done = True\n"
    )
    view = await run_job(backend, "flood", source)
    assert view.state == "succeeded", (view.message, view.error)
    logs = (await backend.logs("flood", "chief-0"))["chief-0"]
    assert "after the flood" in logs
    assert len(logs) < 4 * 2**20  # the log file is bounded


async def test_a_job_works_under_a_long_path_and_its_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    """One finished job for both (a job start is the slow part): it ran under a path longer than AF_UNIX
    allows, and then its recorded supervisor PID belongs to someone else's process."""
    deep = tmp_path / ("home-of-a-user-with-a-long-name-" * 3) / ".local/state/tfdist/jobs"
    backend = LocalBackend(str(deep))
    name = "a-job-name-that-is-forty-characters-long"[:40]
    assert len(os.fsencode(str(deep / name / "control.sock"))) > 107
    view = await run_job(backend, name, "x = 6 * 7\n")
    assert view.state == "succeeded", (view.message, view.error)
    assert await backend.fetch_result(name) is not None

    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        me = ProcessId.of(bystander.pid)
        assert me is not None
        # what the file would say had an earlier process with this PID been the supervisor
        stale = ProcessId(bystander.pid, me.started - 100)
        (deep / name / "supervisor.pid").write_text(stale.dumps())
        assert not backend.is_running(name)
        assert await backend.stop(name) is False
        (deep / name / "supervisor.pid").write_text(str(bystander.pid))  # an older format
        assert not backend.is_running(name) and await backend.stop(name) is False
        time.sleep(0.3)
        assert bystander.poll() is None, "the bystander was killed"
        assert (await backend.status(name)).state == "succeeded"
    finally:
        bystander.kill()
        bystander.wait()


async def test_a_failed_job_leaves_no_payload_behind(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path / "jobs"))
    view = await run_job(backend, "boom", "raise ValueError('nope')\n")
    assert view.state == "failed" and "nope" in view.message
    jobdir = tmp_path / "jobs" / "boom"
    assert not (jobdir / "payload.bin").exists()
    assert not (jobdir / "supervisor.pid").exists()


async def test_a_missing_job_is_its_own_error_not_a_key_error(tmp_path: Path) -> None:
    """Only NoSuchJob means 'no such job' (a 404 in the lab server); a KeyError from a bug stays a bug."""
    from tfdist.errors import NoSuchJob

    backend = LocalBackend(str(tmp_path / "jobs"))
    for bad in ("nope", "../etc", ".hidden", ""):
        with pytest.raises(NoSuchJob):
            await backend.status(bad)
    assert not issubclass(NoSuchJob, KeyError)


async def test_a_running_supervisor_that_has_not_answered_yet_is_not_called_gone(tmp_path: Path) -> None:
    """Read from another process right after the start, before the supervisor binds its socket (seen in
    CI under load: the job was reported "supervisor is gone" 0.4 s after its start, and kept running)."""
    from tests.test_labserver import fake_job

    state = str(tmp_path / "jobs")
    fake_job(state, "starting", "user", state="pending", pid=os.getpid())  # alive, and no control.sock
    view = await LocalBackend(state).status("starting")
    assert (view.state, view.finished) == ("pending", False), view.message
    (tmp_path / "jobs" / "starting" / "supervisor.pid").write_text(
        ProcessId(os.getpid(), ProcessId.current().started - 1).dumps()  # it died; its PID lives on
    )
    view = await LocalBackend(state).status("starting")
    assert (view.state, view.reason) == ("failed", "lost"), view.message
