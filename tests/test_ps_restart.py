"""A parameter server that comes back: `--checkpoint-every N` on a PS job, the PS killed mid-fit with
SIGKILL; the PS and the coordinator restart, the fit resumes from the last checkpoint, and the cell gets
one coherent history (real TF processes through a real kernel)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import psutil
import pytest

from tests.kernels import PACE_IMPORT, job_processes, paced
from tests.test_lifecycle import task_pids
from tfdist.backends.local import LocalBackend
from tfdist.errors import NoSuchJob

pytestmark = pytest.mark.slow


def wait_until(kernel, name: str, th, box, ok, what: str, timeout: float = 300) -> None:
    backend = LocalBackend(kernel.state_dir)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not th.is_alive():
            shown = (box[0].error_text + box[0].text) if box else "no result"
            raise AssertionError(f"the cell ended before {what}: {shown[-3000:]}")
        try:
            if ok(asyncio.run(backend.status(name))):
                return
        except NoSuchJob:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"job {name}: no {what} within {timeout}s")


def test_lost_ps_is_restarted_and_the_fit_resumes_with_one_history(tf_kernel):
    r = tf_kernel.execute(
        # paced data (tests.kernels.paced): 2 workers take >= 10 s for the 200 steps on any CPU, >= 7 s of
        # them after the first epoch's checkpoint, where the PS is killed
        f"w0 = [w.copy() for w in model.get_weights()]\n{PACE_IMPORT}paced_ds = {paced('train_ds')}\n",
        timeout=30,
    )
    assert r.error is None, r.error_text
    name = "ps-back"
    cell = (
        f"%%tfdist run --workers 2 --ps 1 --checkpoint-every 20 --name {name}\n"
        "history = model.fit(paced_ds, epochs=5, steps_per_epoch=40)\n"
    )
    th, box = tf_kernel.execute_in_background(cell, timeout=600)
    progress = os.path.join(tf_kernel.state_dir, name, "ckpt", "progress.json")

    def saved_epochs() -> int:
        try:
            with open(progress) as f:
                return int(json.load(f)["epoch"])
        except (OSError, ValueError, KeyError):  # not written yet, or being replaced
            return 0

    # the first checkpoint that records an epoch, as early as it comes: the PS must still be there
    wait_until(tf_kernel, name, th, box, lambda _: saved_epochs() >= 1, "checkpoint")
    with open(progress) as f:
        saved = json.load(f)
    assert saved["epoch"] >= 1 and len(saved["epoch_logs"]) == saved["epoch"]
    pids = task_pids(tf_kernel.state_dir, name)
    ps, old_chief = pids["ps-0"], pids["chief-0"]
    try:
        os.kill(ps, signal.SIGKILL)
    except ProcessLookupError:
        raise AssertionError(f"ps-0 was gone before the kill (fit over? {th.is_alive()=})") from None
    th.join(600)
    assert box, "the cell did not end"
    assert box[0].error is None, box[0].error_text + box[0].text
    assert not psutil.pid_exists(old_chief) or psutil.Process(old_chief).status() == psutil.STATUS_ZOMBIE
    r = tf_kernel.execute(
        "import numpy as np\n"
        "print(history.epoch)\n"
        "print(len(history.history['loss']), all(v is not None for v in history.history['loss']))\n"
        "print(history.history['loss'][-1] < history.history['loss'][0])\n"
        "print(any(not np.allclose(a, b) for a, b in zip(w0, model.get_weights())))\n",
        timeout=60,
    )
    assert r.error is None, r.error_text
    assert r.text.split("\n")[:4] == ["[0, 1, 2, 3, 4]", "5 True", "True", "True"], r.text
    r = tf_kernel.execute(f"%tfdist logs {name}", timeout=60)
    assert "parameter server ps-0 was killed" in r.text or "parameter server ps-0 exited" in r.text, r.text
    assert "resumes from the last checkpoint" in r.text
    assert "tfdist: resumed from the checkpoint at step" in r.text
    assert "tfdist: checkpoint written at step" in r.text and "could not be written" not in r.text
    with open(os.path.join(tf_kernel.state_dir, name, "state.json")) as f:
        state = json.load(f)
    assert state["reason"] == "finished"
    assert state["tasks"]["ps-0"]["restarts"] == 1
    assert not job_processes()
