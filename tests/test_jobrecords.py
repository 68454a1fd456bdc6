"""The lab server's records are the one definition of what the panel reads (tfdist.jobrecords): the
committed JSON Schema (from which scripts/build-labextension generates the panel's TypeScript types and
refuses stale ones) must be the one the Python records give, and what the server sends must fit them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tfdist import jobrecords
from tfdist.job.detach import DetachSummary
from tfdist.job.events import QueueInfo, StateEvent
from tfdist.jobview import JobView

SCHEMA = Path(__file__).resolve().parent.parent / "labextension" / "schema" / "job-records.schema.json"


def test_the_committed_schema_is_the_records_own():
    assert SCHEMA.read_text() == jobrecords.schema_text(), (
        "labextension/schema/job-records.schema.json is stale: run "
        "python -m tfdist.jobrecords > labextension/schema/job-records.schema.json, then "
        "(cd labextension && npm run gen:types)"
    )


def test_a_views_summary_is_a_job_summary_and_says_reason_and_step():
    v = JobView(name="j", user="ann")
    v.apply({"type": "progress", "epoch": 1, "epochs": 3, "step": 7})
    v.apply({"type": "state", "state": "failed", "message": "boom", "reason": "task-failed"})
    s = v.summary()
    assert jobrecords.JobSummary.model_validate(s).step == 7
    assert s["reason"] == "task-failed" and s["step"] == 7
    # the detached fields are the backends' to add: not sent unless set
    assert "detached" not in s and "results" not in s


def test_the_wire_form_keeps_the_panels_keys_and_refuses_a_broken_producer():
    v = JobView(name="j", user="ann")
    v.apply({"type": "metrics", "t": 1.0, "tasks": {"worker-0": {"cpu (%)": 50.0, "rss (MiB)": 10.0}}})
    d = v.to_dict() | {"summary": v.summary(), "logs": {}, "logs_hidden": 0}
    out = jobrecords.wire(jobrecords.JobDetail, d)
    assert out["metrics"][0]["tasks"]["worker-0"]["cpu (%)"] == 50.0  # the alias, as the panel reads it
    assert out["summary"]["name"] == "j"
    with pytest.raises(ValidationError):
        jobrecords.wire(jobrecords.JobSummary, {**v.summary(), "state": "exploded"})


@pytest.mark.parametrize(
    "record",
    [
        StateEvent(state="running"),
        QueueInfo(position=1),
        DetachSummary(detached=False),
        jobrecords.JobSummary.model_validate(JobView(name="j", user="ann").summary()),
    ],
    ids=lambda r: type(r).__name__,
)
def test_records_are_read_by_attribute_not_by_wire_key(record):
    """Typed end to end: a record is no dict (no `rec["state"]`, no `rec.get`), so a caller reads
    `rec.state` and writes the wire form once, with `model_dump`, where it leaves the process."""
    with pytest.raises(TypeError):
        record["state"]
    assert not hasattr(record, "get")
