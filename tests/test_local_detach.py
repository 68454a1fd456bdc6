"""Detach and attach on the local backend: a `--detach` job outlives the kernel that started it, a later
kernel with the same state directory takes its results once, and nobody else can.

One detached job trains while its kernel is gone and is attached from a new kernel (trained weights,
history, the final picture); a second attach is told the results were taken; a detached job is stopped
from another kernel and leaves no process; bad names, another state directory and another uid get one
sentence; expired jobs are deleted by the next use of the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

import pytest

from tests.conftest import SETUP_CODE
from tests.kernels import Kernel, Result, job_processes, kernel_env, wait_gone
from tests.test_lifecycle import job_pids, wait_for_epoch
from tfdist.backends.local import LocalBackend, NoSuchDetachedJob
from tfdist.errors import JobSpecError

pytestmark = pytest.mark.slow

SHORT = (  # the pause keeps it running past the first kernel's end (its fit alone took < 5 s on a fast host)
    "%%tfdist run --detach --name away --workers 1\n"
    "history = model.fit(train_ds, epochs=4, steps_per_epoch=25, verbose=0)\n"
    "import time; time.sleep(15)\n"
    "note = 'from the job'\n"
)
LONG = "%%tfdist run --detach --name long --workers 1\nmodel.fit(train_ds, epochs=1000, steps_per_epoch=40)\n"
RETENTION_S = "900"
NOBODY = "no detached tfdist job named {!r} is waiting here"


def wait_finished(backend: LocalBackend, name: str, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        view = asyncio.run(backend.status(name))
        if view.finished:
            return view
        time.sleep(1)
    raise TimeoutError(f"job {name} did not finish in {timeout}s")


def execute_with_updates(kernel: Kernel, code: str, timeout: float = 180) -> tuple[Result, list[dict]]:
    """Run a cell; its outputs and the data of every update_display_data it sent (the live monitor is
    replaced by the run's picture through one)."""
    res, updates = Result(), []
    msg_id = kernel.kc.execute(code)
    deadline = time.time() + timeout
    while True:
        msg = kernel.kc.get_iopub_msg(timeout=max(0.1, deadline - time.time()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        t = msg["msg_type"]
        if t == "status" and msg["content"]["execution_state"] == "idle":
            return res, updates
        if t == "error":
            res.error = msg["content"]
        elif t == "update_display_data":
            updates.append(msg["content"]["data"])
        elif t in ("stream", "display_data", "execute_result"):
            res.outputs.append(msg)


def light_kernel(state_dir: str, cwd: str) -> Kernel:
    """A kernel with the extension loaded and no TensorFlow: attach and stop need none until results come."""
    k = Kernel(kernel_env(state_dir, TFDIST_RESULT_RETENTION_S=RETENTION_S), cwd=cwd)
    r = k.execute("%load_ext tfdist", timeout=60)
    assert r.error is None, r.error_text
    return k


def test_a_detached_job_outlives_its_kernel_and_a_later_kernel_takes_its_results_once(tmp_path):
    state = str(tmp_path / "state")
    env = kernel_env(state, TFDIST_RESULT_RETENTION_S=RETENTION_S)
    first = Kernel(env, cwd=str(tmp_path))
    try:
        assert first.execute(SETUP_CODE, timeout=180).error is None
        for cell, name in ((SHORT, "away"), (LONG, "long")):
            r = first.execute(cell, timeout=180)
            assert r.error is None, r.error_text
            assert f"job {name} started detached; it runs without this kernel" in r.text
    finally:  # the kernel shut down as JupyterLab does (atexit runs): no lifeline takes detached jobs along
        first.kc.stop_channels()
        first.km.shutdown_kernel(now=False)
    backend = LocalBackend(state)
    time.sleep(3)
    assert backend.is_running("away") and backend.is_running("long")
    away_pids = job_pids(state, "away")

    # stopped from another kernel, without the one that started it: nothing of it stays
    wait_for_epoch(state, "long", 1, timeout=240)
    long_pids = job_pids(state, "long")
    other = light_kernel(state, str(tmp_path))
    try:
        r = other.execute("%tfdist stop long", timeout=60)
        assert r.error is None and "stopped long" in r.text, r.error_text or r.text
        assert wait_gone(long_pids, 15) == []
        r = other.execute("%tfdist list", timeout=60)
        rows = {line.split()[0]: line for line in r.text.splitlines()[1:]}
        # the short job may have finished meanwhile (a loaded machine stops `long` slowly): either is right
        assert rows["away"].endswith(("[detached]", "[detached: results wait for %tfdist attach]")), r.text
        assert rows["long"].endswith("[detached: no results]"), r.text
        # bad input: one sentence each
        r = other.execute("%tfdist attach never-started", timeout=60)
        assert r.error and NOBODY.format("never-started") in r.error_text
        assert "Traceback" not in r.error_text
        r = other.execute("%tfdist attach ../away", timeout=60)
        assert r.error and NOBODY.format("../away") in r.error_text
    finally:
        other.shutdown()

    # the short job ends by itself; its processes are gone, its results wait
    view = wait_finished(backend, "away")
    assert view.state == "succeeded", view.message
    assert wait_gone(away_pids, 15) == []
    assert [p for p in job_processes() if p.pid in away_pids] == []
    listed = {j.name: j for j in asyncio.run(backend.list_jobs())}
    assert listed["away"].detached and listed["away"].results == "waiting"
    assert listed["away"].kept_until == pytest.approx(view.ended + float(RETENTION_S), abs=1)

    # another state directory (another user's server) and another uid cannot attach
    stranger = light_kernel(str(tmp_path / "someone-else"), str(tmp_path))
    try:
        r = stranger.execute("%tfdist attach away", timeout=60)
        assert r.error and NOBODY.format("away") in r.error_text
    finally:
        stranger.shutdown()
    jobdir = os.path.join(state, "away")
    os.chown(jobdir, 65534, 65534)  # as if another uid owned it (a shared, misconfigured state dir)
    try:
        with pytest.raises(NoSuchDetachedJob, match=NOBODY.format("away")):
            asyncio.run(backend.attach("away"))
    finally:
        os.chown(jobdir, os.getuid(), os.getgid())

    # a new kernel attaches: the final picture, the trained weights, the names the cell bound
    second = Kernel(env, cwd=str(tmp_path))
    try:
        assert second.execute(SETUP_CODE, timeout=180).error is None
        r = second.execute(
            "import numpy as np\n"
            "before = [w.copy() for w in model.get_weights()]\n"
            "acc_before = model.evaluate(x, y, verbose=0)[1]\n",
            timeout=60,
        )
        assert r.error is None, r.error_text
        r, updates = execute_with_updates(second, "%tfdist attach away")
        assert r.error is None, r.error_text
        assert "tfdist: job away succeeded; weights of model updated; set " in r.text
        assert "history" in r.text and "note" in r.text
        assert "application/vnd.jupyter.widget-view+json" in r.mimetypes()  # the monitor...
        assert [u for u in updates if "image/png" in u]  # ...replaced by the run's picture
        r = second.execute(
            "import json\n"
            "print(json.dumps([any(not np.allclose(a, b) for a, b in zip(before, model.get_weights())),\n"
            "    len(history.history['loss']), note, float(acc_before),\n"
            "    model.evaluate(x, y, verbose=0)[1]]))",
            timeout=60,
        )
        changed, epochs, note, acc_before, acc_after = json.loads(r.text.strip().splitlines()[-1])
        assert (changed, epochs, note) == (True, 4, "from the job")
        assert acc_after > max(0.5, acc_before), r.text
        # a second attach: the results came back once
        r = second.execute("%tfdist attach away", timeout=60)
        assert r.error and "the results of job 'away' were already taken by an earlier attach" in r.error_text
        # an attached-to job that was stopped: the final state, no results
        r = second.execute("%tfdist attach long", timeout=60)
        assert r.error and "job long stopped" in r.error_text
    finally:
        second.shutdown()
    assert not os.path.exists(os.path.join(jobdir, "result.bin"))


def test_expired_detached_jobs_are_deleted_by_the_next_use_of_the_backend(tmp_path):
    """Retention runs from a job's end; the directory (results, logs, state) goes at the next backend use."""
    state = tmp_path / "state"
    backend = LocalBackend(str(state))
    ended = time.time() - 100
    for name, detached in (("kept", True), ("old", True), ("plain", False)):
        d = state / name
        (d / "logs").mkdir(parents=True)
        (d / "spec.json").write_text(json.dumps({"name": name, "user": "me", "extra": {"detach": detached}}))
        final = {"state": "succeeded", "ended": ended, "created": ended - 9}
        (d / "state.json").write_text(json.dumps(final))
        (d / "result.bin").write_bytes(b"results")
        if detached:
            retention = 1000 if name == "kept" else 50
            (d / "detached.json").write_text(json.dumps({"retention_s": retention, "uid": os.getuid()}))
    jobs = {j.name: j for j in asyncio.run(backend.list_jobs())}
    assert sorted(jobs) == ["kept", "plain"], "the expired detached job was not deleted"
    assert not (state / "old").exists()
    assert jobs["kept"].results == "waiting" and jobs["plain"].detached is False
    with pytest.raises(NoSuchDetachedJob):
        asyncio.run(backend.attach("old"))
    with pytest.raises(JobSpecError, match="was not started with --detach"):
        asyncio.run(backend.attach("plain"))
    asyncio.run(backend.attach("kept"))
    assert asyncio.run(backend.fetch_result("kept")) == b"results"
    with pytest.raises(JobSpecError, match="already taken"):
        asyncio.run(backend.attach("kept"))
    with pytest.raises(JobSpecError, match="already taken"):
        asyncio.run(backend.fetch_result("kept"))
    assert backend.expire(now=ended + 999) == []
    assert backend.expire(now=ended + 1001) == ["kept"]


def test_a_new_job_of_the_same_name_does_not_delete_results_nobody_has_taken(tmp_path):
    """`%%tfdist run --detach --name a` ended; a later `%%tfdist run --name a` deleted its directory, the
    unclaimed results with it (Kubernetes refuses the name while the root is there). Refused now, naming the
    way out; once the results are taken, the name is free again."""
    from tfdist.backends.base import Launch
    from tfdist.jobspec import JobSpec

    state = tmp_path / "state"
    backend = LocalBackend(str(state), isolation="none")
    d = state / "a"
    (d / "logs").mkdir(parents=True)
    (d / "spec.json").write_text(json.dumps({"name": "a", "user": "me", "detach": True}))
    ended = time.time() - 5
    (d / "state.json").write_text(json.dumps({"state": "succeeded", "ended": ended, "created": ended - 9}))
    (d / "result.bin").write_bytes(b"weights")
    (d / "detached.json").write_text(json.dumps({"retention_s": 1000, "uid": os.getuid()}))
    again = JobSpec(name="a", user="me")
    with pytest.raises(JobSpecError, match="the detached job 'a' has results nobody has taken yet"):
        asyncio.run(backend.submit(again, b"payload", Launch()))
    assert (d / "result.bin").read_bytes() == b"weights"
    asyncio.run(backend.attach("a"))
    assert asyncio.run(backend.fetch_result("a")) == b"weights"
    assert not backend._results_waiting("a")  # taken: a new job may have the name


def test_a_detached_job_ends_with_the_notebook_server_that_started_it(tmp_path):
    """A detached job outlives its kernel, not its server. Where the hub has no cgroup for the server (its
    watchdog knows the server's tree only as last seen, and the job runs in a session of its own) nothing
    ended it once the server was gone: it ran on, holding GPUs the hub had handed out again."""
    import subprocess
    import sys

    from tfdist import memfit
    from tfdist.backends.base import Launch
    from tfdist.job.vocab import JobState, Reason
    from tfdist.jobspec import JobSpec
    from tfdist.payload import pack

    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    state = str(tmp_path / "state")
    backend = LocalBackend(state)
    spec = JobSpec(name="orphaned", user="me", workers=1, ps=1, detach=True)
    cell = "import time\nwhile True:\n    time.sleep(0.2)\n"
    loop = asyncio.new_event_loop()
    try:
        launch = Launch(env={memfit.SERVER_PID_ENV: str(server.pid)})
        loop.run_until_complete(backend.submit(spec, pack(cell, [], {}), launch))
        deadline = time.time() + 180
        while loop.run_until_complete(backend.status("orphaned")).state != JobState.RUNNING:
            assert time.time() < deadline, "the job never ran"
            time.sleep(0.5)
        pids = job_pids(state, "orphaned")
        # another kernel's cell of the same name, interrupted: refused by the name check, it claims nothing,
        # and the interrupt's clean-up leaves this job alone (it stopped it by name before)
        from tfdist.kernel_magics.magics import _stop_if_claimed

        other = LocalBackend(state)
        with pytest.raises(JobSpecError, match="already running"):
            loop.run_until_complete(other.submit(spec, pack(cell, [], {}), launch))
        assert not other.claims("orphaned") and backend.claims("orphaned")
        loop.run_until_complete(_stop_if_claimed(other, "orphaned"))
        time.sleep(3)
        assert not loop.run_until_complete(
            backend.status("orphaned")
        ).finished  # the server lives: it goes on
        server.kill()
        server.wait()
        view = wait_finished(backend, "orphaned", 60)
        assert view.reason == Reason.SIGNALLED, (view.reason, view.message)
        assert "the notebook server that started it is gone" in view.message, view.message
        assert wait_gone(pids, 15) == [], "the job outlived its server"
    finally:
        server.kill()
        with contextlib.suppress(Exception):
            loop.run_until_complete(backend.stop("orphaned"))
        loop.close()
