"""Kueue takes a queue's lent CPU back on the real node, and the preempted `--checkpoint-every` job resumes
from the checkpoint its kernel kept (issue 25, end to end in real containers: the kwok plane's
tests/test_kueue_preemption.py runs the queue side with GPUs, tests/test_pod_runtime_preempt_resume.py the
pods' side as local processes).

Two queues in one cohort: ann's `rn-a` (1.0 CPU) and bob's `rn-b` (1.4 CPU). Ann's job (3 pods at 0.45 CPU,
1.35) is admitted by borrowing from rn-b. Once her kernel keeps a checkpoint, bob's job (1.35, within rn-b's
own quota) arrives: Kueue evicts ann's job whole, her cell says it was preempted and where it waits, bob's job
runs to its end, and ann's kernel submits her cell again. Its coordinator gets the kept checkpoint before the
payload and the fit goes on at the epoch it had reached: one history of every epoch, trained.

Until stop 35 this could not have passed: the PS wrote each checkpoint shard, in its own pod, so the
coordinator pod never had a checkpoint to hand over.
"""

from __future__ import annotations

import glob
import os
import re
import sys
import time
import uuid

import pytest

from tests.realnode_jobs import job_state, wait_first_epoch, wait_for
from tests.test_kueue_realnode import WL, cell_error, cpu_profile, live, mf_pods, queues_converged, two_users

if "tests.realnode_fixtures" not in sys.modules:
    from tests.realnode_fixtures import job_image, real_cluster  # noqa: F401

pytestmark = [pytest.mark.k8s, pytest.mark.realnode]

QA, QB = "rn-a", "rn-b"
PROFILES = {
    "kueue": {"cohort": "rn-lend", "queues": {QA: {"cpu": 1.0}, QB: {"cpu": 1.4}}},
    "profiles": [cpu_profile("cpu-a", QA), cpu_profile("cpu-b", QB)],
}
EPOCHS = 12
# paced data (0.25 s a batch): ann's fit lasts >= 30 s, so bob's job arrives while it trains
CELL = (
    "%%tfdist run --workers 1 --ps 1 --name {name} --cpu 0.45 --memory 1536Mi{extra}\n"
    "history = model.fit(paced_ds, epochs={epochs}, steps_per_epoch=10)\n"
)
PREEMPTED = re.compile(r"it resumes from epoch (\d+) \(the checkpoint at step (\d+)\) when admitted")
TIMES: dict[str, float] = {}
RESUMED = re.compile(r"resumed from epoch (\d+) after preemption \(the checkpoint at step (\d+)\)")


@pytest.fixture(scope="module")
def lend(real_cluster, job_image, tmp_path_factory):
    with (
        queues_converged(real_cluster, PROFILES) as cfg,
        two_users(real_cluster, cfg, job_image, tmp_path_factory.mktemp("kueue-lend"), (QA, QB), 0.25) as u,
    ):
        yield u


def test_a_borrowing_job_preempted_by_the_lender_resumes_from_its_kept_checkpoint(real_cluster, lend):
    from tfdist.kube import queueline as ql

    ann, bob = lend
    a_job, b_job = f"pa{uuid.uuid4().hex[:4]}", f"pb{uuid.uuid4().hex[:4]}"
    a_ns, b_ns = ann.tenant.namespace, bob.tenant.namespace
    a_mark = ann.kernel.mark()
    a_cell = ann.kernel.submit(CELL.format(name=a_job, extra=" --checkpoint-every 5", epochs=EPOCHS))
    wait_first_epoch(real_cluster, ann.kernel, a_cell, a_mark, a_ns, a_job, timeout=300)
    wl = real_cluster.get(WL.format(ns=a_ns, job=a_job)) or {}
    assert ql.is_admitted(wl), wl.get("status")

    # the checkpoint ann's kernel keeps (fetched from the coordinator's agent every 5 s)
    kept_glob = os.path.join(ann.state_dir, "kubernetes", a_ns, f"{a_job}.*.ckpt")

    def kept() -> list[str]:
        if ann.kernel.idle_after(a_cell):
            raise AssertionError(
                f"ann's cell ended before a checkpoint was kept: {cell_error(ann.kernel, a_cell)}"
            )
        return glob.glob(kept_glob)

    wait_for("a checkpoint kept by ann's kernel", kept, 120)
    t0 = time.monotonic()
    b_cell = bob.kernel.submit(CELL.format(name=b_job, extra="", epochs=2))

    def told() -> list[str]:
        """The cell's header says preempted and waiting (its message, "preempted by Kueue to give queue
        rn-b its quota back; ...", gives way to the place in line as soon as the queue says it)."""
        if ann.kernel.idle_after(a_cell):
            r = ann.kernel.wait(a_cell, timeout=5)
            raise AssertionError(
                f"ann's cell ended before it was preempted ({r.error_text or 'succeeded'}) "
                f"{time.monotonic() - t0:.1f}s after bob's cell"
            )
        return [t for t in ann.kernel.widget_texts(a_mark) if "preempted, waiting to be readmitted" in t]

    said = wait_for("ann's cell told it was preempted", told, 180)
    TIMES["preempted_said_s"] = time.monotonic() - t0
    # its message first ("... waiting in queue rn-a again, it resumes from epoch 2 ..."), then its place
    assert f"waiting in queue {QA} again" in said[-1] or f"queued: 1st in {QA}" in said[-1], said[-1]

    rb = bob.kernel.wait(b_cell, timeout=600)
    assert rb.error is None, f"{rb.error_text}\n{job_state(real_cluster, b_ns, b_job)}"
    TIMES["lender_done_s"] = time.monotonic() - t0
    ra = ann.kernel.wait(a_cell, timeout=600)
    TIMES["preempted_job_done_s"] = time.monotonic() - t0
    texts = ann.kernel.widget_texts(a_mark)
    assert ra.error is None, f"{ra.error_text}\n{job_state(real_cluster, a_ns, a_job)}\n{texts[-5:]}"
    resumed = [(int(m[1]), int(m[2])) for t in texts for m in RESUMED.finditer(t)]
    assert resumed, texts[-5:]
    resume_epoch, resume_step = resumed[-1]
    assert resume_epoch >= 1 and resume_step >= 5, resumed  # from a checkpoint the first run wrote
    # what the cell said when it was preempted, when it was shown: the same checkpoint
    preempted = [m for t in texts for m in PREEMPTED.finditer(t)]
    assert all((int(m[1]), int(m[2])) == (resume_epoch, resume_step) for m in preempted), preempted
    r = ann.kernel.run("print('epochs', len(history.history['loss']), history.epoch)")
    assert f"epochs {EPOCHS} " in r.text and str(list(range(EPOCHS))) in r.text, r.text
    # nothing of either job is left
    wait_for(
        "both jobs' pods gone",
        lambda: not live(mf_pods(real_cluster, a_ns, a_job)) and not live(mf_pods(real_cluster, b_ns, b_job)),
        120,
    )
    print(f"\nkueue preemption on the real node: { {k: round(v, 1) for k, v in TIMES.items()} }")
