"""`%%tfdist run --strategy allreduce`: MultiWorkerMirroredStrategy jobs, real TF processes through a real
kernel; every worker runs the cell, chief-0 returns the results once; a lost worker ends the job."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest

from tests.kernels import job_processes, jobs_in, wait_gone
from tests.test_lifecycle import job_pids, task_pids
from tfdist.backends.local import LocalBackend
from tfdist.errors import NoSuchJob

pytestmark = pytest.mark.slow

FIT = "history = model.fit(train_ds, epochs=1, steps_per_epoch=2)"


BAD = [
    ("%%tfdist run --strategy horovod\n" + FIT, "--strategy 'horovod' is unknown: choose ps"),
    ("%%tfdist run --strategy allreduce --ps 1\n" + FIT, "--ps 1 does not go with --strategy allreduce"),
    ("%%tfdist run --strategy allreduce --ps 0\n" + FIT, "--ps 0 does not go with --strategy allreduce"),
    ("%%tfdist run --checkpoint-every 0\n" + FIT, "--checkpoint-every must be a positive count of steps"),
    ("%%tfdist run --checkpoint-every -5\n" + FIT, "--checkpoint-every must be a positive count"),
    ("%%tfdist run --checkpoint-every 1.5\n" + FIT, "--checkpoint-every takes a positive count of steps"),
    (
        "%%tfdist run --strategy allreduce --checkpoint-every 10\n" + FIT,
        "--checkpoint-every is for --strategy ps jobs",
    ),
]


@pytest.mark.parametrize(("cell", "message"), BAD, ids=[c[1][:40] for c in BAD])
def test_bad_strategy_input_starts_nothing(tf_kernel, cell, message):
    before = jobs_in(tf_kernel.state_dir)
    r = tf_kernel.execute(cell, timeout=60)
    shown = r.error_text + r.text
    assert message in shown, shown
    assert "Traceback (most recent call last)" not in shown
    assert jobs_in(tf_kernel.state_dir) == before
    assert not job_processes()


def wait_epoch_or_end(kernel, name: str, th, box, timeout: float = 300) -> None:
    """Until the job's first epoch; a cell that ended before that fails the test with what it showed.
    (A view read while the supervisor is still writing its pid file may look finished: the cell decides.)"""
    backend = LocalBackend(kernel.state_dir)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not th.is_alive():
            shown = (box[0].error_text + box[0].text) if box else "no result"
            raise AssertionError(f"the cell ended before epoch 1: {shown[-3000:]}")
        try:
            if asyncio.run(backend.status(name)).epoch >= 1:
                return
        except NoSuchJob:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"job {name} did not reach epoch 1")


def test_allreduce_trains_on_every_worker_and_returns_once(tf_kernel):
    r = tf_kernel.execute("w_before = [w.copy() for w in model.get_weights()]", timeout=30)
    assert r.error is None, r.error_text
    cell = (
        "%%tfdist run --strategy allreduce --workers 2 --name ar-fit\n"
        "history = model.fit(train_ds, epochs=3, steps_per_epoch=15)\n"
        "replicas = tf.distribute.get_strategy().num_replicas_in_sync\n"
        "kind = isinstance(tf.distribute.get_strategy(), tf.distribute.MultiWorkerMirroredStrategy)\n"
        "roles = sorted(tf.distribute.get_strategy().cluster_resolver.cluster_spec().as_dict())\n"
    )
    th, box = tf_kernel.execute_in_background(cell, timeout=400)
    wait_epoch_or_end(tf_kernel, "ar-fit", th, box)
    tasks = task_pids(tf_kernel.state_dir, "ar-fit")
    assert set(tasks) == {"chief-0", "worker-0"}  # two replicas, no PS, no separate coordinator
    th.join(400)
    assert box and box[0].error is None, box[0].error_text if box else "no result"
    r = tf_kernel.execute(
        "import numpy as np\n"
        "print(replicas, kind, len(history.history['loss']), roles)\n"
        "print(any(not np.allclose(a, b) for a, b in zip(w_before, model.get_weights())))\n",
        timeout=60,
    )
    assert r.error is None, r.error_text
    lines = r.text.split("\n")
    assert lines[0] == "2 True 3 ['chief', 'worker']"  # both replicas in one cluster of chief + worker
    assert lines[1] == "True"  # the notebook's own model holds the trained weights
    with open(os.path.join(tf_kernel.state_dir, "ar-fit", "state.json")) as f:
        state = json.load(f)
    assert state["reason"] == "finished"
    assert {t["state"] for t in state["tasks"].values()} <= {"exited-ok", "exited"}
    assert not job_processes()


def test_allreduce_worker_killed_ends_the_job_and_says_so(tf_kernel):
    cell = (
        "%%tfdist run --strategy allreduce --workers 2 --name ar-kill\n"
        "history = model.fit(train_ds, epochs=400, steps_per_epoch=40)\n"
    )
    th, box = tf_kernel.execute_in_background(cell, timeout=400)
    wait_epoch_or_end(tf_kernel, "ar-kill", th, box)
    pids = job_pids(tf_kernel.state_dir, "ar-kill")
    worker = task_pids(tf_kernel.state_dir, "ar-kill")["worker-0"]
    t0 = time.time()
    os.kill(worker, signal.SIGKILL)
    th.join(120)
    assert box, "the cell did not end after a worker was killed"
    shown = box[0].error_text + box[0].text
    # the supervisor saw it killed, or the chief's collective lost it first: either way it is named
    assert re.search(r"all-reduce worker worker-0 (was killed|stopped)", shown), shown
    assert wait_gone(pids, 15) == []
    assert time.time() - t0 < 120
    with open(os.path.join(tf_kernel.state_dir, "ar-kill", "state.json")) as f:
        assert json.load(f)["reason"] == "task-failed"
