"""`%tfdist attach` on the one-machine cluster's real node: a detached job trains in real pods after the
kernel that started it was SIGKILLed, a new kernel of the same server attaches and gets the trained
weights and history the pods computed, and a second attach is refused with a sentence. (On kwok,
test_k8s_lifecycle.py checks the attach state only: kwok runs no containers, so no results come back.)
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import pytest

from tests.realnode_jobs import (
    digits_kernel,
    job_pods,
    kubectl,
    run_line,
    running,
    start_notebook_pod,
    wait_gone,
)
from tfdist.job.detach import already_taken

if "tests.realnode_fixtures" not in sys.modules:
    from tests.realnode_fixtures import real_cluster  # noqa: F401

pytestmark = [pytest.mark.k8s, pytest.mark.realnode]

EPOCHS = 3
# what the pods computed, bound as names next to the model, to hold the attached kernel's model against
MEASURE = "trained_sum = float(sum(float(w.sum()) for w in model.get_weights()))\n"
CHECK = (
    "print('RESULT ' + json.dumps({'changed': any(not np.allclose(a, b) for a, b in "
    "zip(before, model.get_weights(), strict=True)), "
    "'weights_sum': float(sum(float(w.sum()) for w in model.get_weights())), 'trained_sum': trained_sum, "
    "'losses': history.history['loss'], 'final_loss': final_loss, "
    "'acc_before': float(acc_before), 'acc': float(model.evaluate(x_test, y_test, verbose=0)[1])}))"
)


def payload_in_pod(cluster: Any, ns: str, job: str) -> bool:
    """Whether the job's chief pod holds its payload (the agent's job directory has `payload.bin`)."""
    pods = running(job_pods(cluster, ns, job, "chief"))
    if not pods:
        return False
    r = kubectl("exec", "-n", ns, pods[0]["metadata"]["name"], "--", "python3", "-c", FIND_PAYLOAD)
    return r.returncode == 0 and r.stdout.strip() == "True"


FIND_PAYLOAD = "import glob; print(bool(glob.glob('/tmp/tfdist-job-*/payload.bin')))"


def _result(text: str) -> dict:
    return json.loads(next(ln for ln in text.splitlines() if ln.startswith("RESULT "))[7:])


@pytest.mark.timeout(1200)
def test_a_detached_jobs_results_come_back_from_real_pods_to_a_new_kernel_once(
    real_cluster, job_image, tenants, tmp_path
):
    eve = tenants("eve")
    ns = eve.namespace
    start_notebook_pod(real_cluster, eve)  # owns the job, as the server's pod does; stays up throughout
    first = digits_kernel(eve, job_image, tmp_path)
    try:
        cell = run_line("away", "--detach").replace("epochs=8", f"epochs={EPOCHS}") + "\n" + MEASURE
        r = first.run(cell, timeout=300)
        assert r.error is None, r.error_text
        assert "tfdist: job away started detached" in r.text, r.text
        # The cell returns only once the coordinator's pod holds the payload: the kernel dies right away
        # (it once said "started detached" before the handover, and a kernel killed then lost the job).
        assert payload_in_pod(real_cluster, ns, "away")
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.shutdown()

    second = digits_kernel(eve, job_image, tmp_path)  # same server: same state directory and token
    try:
        r = second.run("%tfdist attach away", timeout=900)
        assert r.error is None, r.error_text
        assert "tfdist: job away succeeded; weights of model updated; set " in r.text, r.text
        r = second.run("import json\n" + CHECK, timeout=120)
        assert r.error is None, r.error_text
        got = _result(r.text)
        print(f"\nattached from a new kernel: {got}")
        assert got["changed"], got
        assert got["weights_sum"] == pytest.approx(got["trained_sum"], abs=1e-4)  # the pods' weights
        assert len(got["losses"]) == EPOCHS and got["final_loss"] == got["losses"][-1], got
        assert got["losses"][-1] < got["losses"][0], got
        assert got["acc"] > max(0.5, got["acc_before"]), got
        # the results came back once: a second attach is refused with a sentence, and changes nothing
        r = second.run("%tfdist attach away", timeout=120)
        assert r.error is not None and already_taken("away") in r.error_text, r.error_text
        assert "Traceback (most recent call last)" not in r.error_text + r.text, r.error_text
        assert _result(second.run(CHECK, timeout=120).text)["weights_sum"] == got["weights_sum"]
        took = wait_gone(real_cluster, ns, "away", 90)  # taken: the job's objects go
        print(f"results taken -> nothing of the job left: {took:.1f}s")
    finally:
        second.shutdown()
