"""What a user's server pushes to the GPU admin service, and what the service answers: typed, bounded records.

Why bounded and strict: the report comes from a server its user controls. Every field is checked for type,
range and length here (NaN, infinities, strings for numbers, huge lists are refused with one sentence),
so nothing a user sends can break the admin page, the metrics or the culling round for everyone.
Kept free of tornado and JupyterHub imports: the lab server (the sender) imports it too.
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_GPUS",
    "MAX_JOBS",
    "MAX_SAMPLES",
    "ActivityReport",
    "GpuRecord",
    "JobRecord",
    "NoticeRecord",
    "ReportError",
    "ReportReply",
    "parse_report",
]

MAX_GPUS = 64  # 8 GPUs of 7 MIG instances each fit
MAX_SAMPLES = 1000  # per report; the sender sends only what is new since its last accepted report
MAX_JOBS = 256
MAX_BODY_BYTES = 1 << 20
RETENTION_S = 6 * 3600.0  # the servers keep this much (labserver.activity.RETENTION_S)
FUTURE_SLACK_S = 120.0  # clocks of the hub and of a notebook pod may differ a little

Percent = Annotated[float, Field(ge=0, le=100)]
MiB = Annotated[float, Field(ge=0, le=1e8)]
Name = Annotated[str, Field(max_length=200)]


class _Wire(BaseModel):
    # strict: "5" is not a number, true is not a number; NaN and infinities are refused
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", frozen=True)


class GpuRecord(_Wire):
    index: int = Field(ge=0, le=4096)  # the parent GPU's, for a MIG instance
    name: Name | None = None
    uuid: Name | None = None
    memory_total_mib: MiB | None = None
    mig_profile: Annotated[str, Field(max_length=40)] | None = None

    @property
    def is_mig(self) -> bool:
        """A MIG instance: NVML cannot measure its utilization (CUDA names it by a "MIG-..." UUID)."""
        return bool(self.mig_profile) or (self.uuid or "").startswith("MIG-")

    @property
    def label(self) -> str:
        name = self.name or "?"
        if self.is_mig:
            return f"{name} MIG {self.mig_profile}" if self.mig_profile else f"{name} MIG instance"
        return name


class JobRecord(_Wire):
    name: Name
    state: Annotated[str, Field(max_length=40)]
    gpu_util: list[Percent] = Field(default_factory=list, max_length=MAX_GPUS)


class Sample(_Wire):
    """One tick: time, then per GPU utilization (%) and memory used (MiB), None where NVML had no value
    (a MIG instance's utilization always: NVML cannot measure it)."""

    t: float = Field(ge=0)
    util: list[Percent | None] = Field(max_length=MAX_GPUS)
    mem: list[MiB | None] = Field(max_length=MAX_GPUS)


class ActivityReport(_Wire):
    """A server's GPUs, how long they have been idle below `busy_percent`, new samples and running jobs.

    No user or server name: the service takes those from the token that sent the report, never from it."""

    busy_percent: Percent | None = None
    idle_s: float | None = Field(None, ge=0, le=10 * RETENTION_S)
    gpus: list[GpuRecord] = Field(default_factory=list, max_length=MAX_GPUS)
    samples: list[Sample] = Field(default_factory=list, max_length=MAX_SAMPLES)
    jobs_running: list[JobRecord] = Field(default_factory=list, max_length=MAX_JOBS)
    jobs_error: Annotated[str, Field(max_length=1000)] | None = None

    @model_validator(mode="after")
    def _samples_match_gpus(self) -> ActivityReport:
        n = len(self.gpus)
        for i, s in enumerate(self.samples):
            if len(s.util) != n or len(s.mem) != n:
                raise ValueError(f"samples.{i} has values for {len(s.util)} GPUs, the report names {n}")
        return self


class NoticeRecord(_Wire):
    message: Annotated[str, Field(min_length=1, max_length=1000)]
    cull_at: float | None = None


class ReportReply(_Wire):
    """The service's answer: the culler's notice for this server (None: none), when to report next, and the
    threshold the next report's `idle_s` must be counted against (the server's profile's rule)."""

    notice: NoticeRecord | None = None
    next_report_s: float = Field(gt=0, le=3600)
    busy_percent: Percent


class ReportError(ValueError):
    """A report refused, with one sentence saying why (sent back as the 400's text)."""


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "report"
    more = f" (and {e.error_count() - 1} more problems)" if e.error_count() > 1 else ""
    return f"{where}: {err['msg'].removeprefix('Value error, ')}{more}"


def parse_report(body: bytes, now: float) -> ActivityReport:
    """The report in `body`, or ReportError saying what is wrong with it."""
    if len(body) > MAX_BODY_BYTES:
        raise ReportError(f"a report is at most {MAX_BODY_BYTES} bytes, this one has {len(body)}")
    try:
        raw = json.loads(body or b"null")
    except ValueError:
        raise ReportError("a report is a JSON object") from None
    if not isinstance(raw, dict):
        raise ReportError("a report is a JSON object")
    try:
        rep = ActivityReport.model_validate(raw)
    except ValidationError as e:
        raise ReportError(f"bad report: {_first_error(e)}") from None
    for i, s in enumerate(rep.samples):
        if not (now - RETENTION_S - FUTURE_SLACK_S <= s.t <= now + FUTURE_SLACK_S):
            raise ReportError(f"bad report: samples.{i}.t is not a time of the last 6 hours (clock wrong?)")
    return rep
