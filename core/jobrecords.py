"""What the lab server sends the jobs panel, as typed records: the one definition of those shapes.

Why here: the panel (TypeScript) and the server (Python) used to keep one copy each, and the panel's had
already lost fields (`reason`, `step`). These models are the source: the lab server builds its answers
through them, their JSON Schema is committed as `labextension/schema/job-records.schema.json`, and the
panel's types (`labextension/src/records.generated.ts`) are generated from that schema by
json-schema-to-typescript (`npm run gen:types`). A field added here reaches `%tfdist list`, the lab server
and the panel without a hand edit; tests/test_jobrecords.py and scripts/build-labextension fail when the
committed schema or the generated types are stale.

    python -m tfdist.jobrecords > labextension/schema/job-records.schema.json
"""

from __future__ import annotations

import json
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from .job.view import summary_fields
from .job.vocab import JobState

__all__ = ["GpuStatus", "JobDetail", "JobList", "JobSummary", "TaskRecord", "schema", "wire"]

ResultsState = Literal["pending", "waiting", "taken", "none"]


class _Record(BaseModel):
    # extra keys are kept on the way out (a backend may say more) but are not part of the contract
    model_config = ConfigDict(extra="allow")


class _Summary(_Record):
    name: str
    user: str
    backend: str
    state: JobState
    message: str
    reason: str = Field(
        "",
        description="why it ended (a Reason value); empty while it runs; `preempted` while it waits to be "
        "readmitted",
    )
    created: float
    ended: float | None
    tasks_started: int
    tasks_total: int
    epoch: int
    epochs: int | None
    step: int = Field(0, description="training steps done in the current fit")
    gpu_util: list[float]
    cpu_total: float
    detached: bool | None = Field(
        None, description="local backend: started with --detach (no kernel holds it)"
    )
    results: ResultsState | None = Field(
        None,
        description="a detached job's results: pending (still running), waiting, taken (by an attach), none",
    )
    kept_until: float | None = Field(None, description="until when (epoch seconds) waiting results are kept")


# The view's fields marked `summary(...)` join these without an edit here (tfdist.job.view.summary_fields)
JobSummary = create_model(
    "JobSummary",
    __base__=_Summary,
    __module__=__name__,
    __doc__="One job in a list (the jobs panel, `%tfdist list`).",
    **summary_fields(),
)


class GpuSample(_Record):
    index: int
    name: str | None = None
    util: float | None = Field(None, alias="util (%)")
    mem_used: float | None = Field(None, alias="mem_used (MiB)")
    mem_total: float | None = Field(None, alias="mem_total (MiB)")


class TaskSample(_Record):
    cpu: float | None = Field(None, alias="cpu (%)")
    rss: float | None = Field(None, alias="rss (MiB)")
    gpus: list[GpuSample] = []


class MetricsSample(_Record):
    t: float
    tasks: dict[str, TaskSample]


class TaskRecord(_Record):
    state: str
    restarts: int = 0
    gpus: list[Any] = []
    exit_code: int | None = None


class JobDetail(_Record):
    """One job's panel view: its tasks, the last minutes of samples, log tails and its summary."""

    name: str
    user: str
    state: JobState
    message: str
    reason: str = ""
    tasks: dict[str, TaskRecord]
    metrics: list[MetricsSample]
    logs: dict[str, list[str]]
    logs_hidden: int = Field(
        0, description="TensorFlow start-up lines left out of `logs` (the files keep them)"
    )
    summary: JobSummary


class JobList(_Record):
    user: str
    jobs: list[JobSummary]


class ServerSample(_Record):
    t: float
    cpu: float = Field(alias="cpu (%)")
    mem: float = Field(alias="mem (%)")
    gpus: list[GpuSample]


class GpuName(_Record):
    index: int
    name: str


class GpuStatus(_Record):
    """This server's GPUs and its CPU/memory samples (the GPU status item)."""

    gpu_count: int
    gpus: list[GpuName]
    cpu_count: int
    interval_s: float
    samples: list[ServerSample]


def wire(model: type[BaseModel], data: Any) -> dict[str, Any]:
    """`data` checked against its record and written as the panel reads it (aliases; optional fields a
    producer did not set stay off). A producer that breaks the contract fails here, in the server's log
    and its tests, not as a blank panel."""
    return model.model_validate(data).model_dump(mode="json", by_alias=True, exclude_unset=True)


RECORDS: tuple[type[BaseModel], ...] = (JobList, JobDetail, JobSummary, GpuStatus)


def schema() -> dict[str, Any]:
    """One JSON Schema holding every record (as it goes over the wire: aliases, not Python names)."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema([(m, "serialization") for m in RECORDS], by_alias=True, title="TfdistRecords")
    defs = top.get("$defs", {})
    for d in defs.values():  # a title per field would become a TypeScript alias per field
        for prop in d.get("properties", {}).values():
            prop.pop("title", None)
    # json-schema-to-typescript emits the root's properties; the records themselves are the root's
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "TfdistRecords",
        "description": "Generated from tfdist.jobrecords: do not edit (python -m tfdist.jobrecords).",
        "type": "object",
        "properties": {m.__name__: {"$ref": f"#/$defs/{m.__name__}"} for m in RECORDS},
        "$defs": defs,
    }


def schema_text() -> str:
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(schema_text())
