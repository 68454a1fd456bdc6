"""Detached jobs' one lifecycle, for both backends: how long their results wait (the admin's retention),
what `%tfdist list` and the panel say of them, and the sentences a user reads. Pure: the backends keep
the records (a local job's `detached.json`, a Kubernetes job's record in the state directory) and ask here.

The rules: a detached job runs without a kernel; its results wait until one `%tfdist attach` takes them
(once: a second attach is told so) or until the retention, counted from the job's end, has passed. The
retention is the admin's TFDIST_RESULT_RETENTION_S when the job started (kept in its record, whatever the
environment says later); a value that is not a number of seconds above 0 is the default, and said.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..settings import KernelSettings
from ..settings.fields import SettingsError
from ..settings.groups import DEFAULT_RETENTION_S

ResultsState = Literal["pending", "waiting", "taken", "none"]


def hours(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"


@dataclasses.dataclass(frozen=True)
class Retention:
    """How long a detached job's results wait after it ends, and why it is the default when the admin's
    value could not be read (`problem`, a sentence; None when it was fine)."""

    seconds: float
    problem: str | None = None


def retention(settings: KernelSettings | None = None) -> Retention:
    """The admin's retention now: the same rule, and the same sentence, for both backends."""
    settings = settings or KernelSettings()
    var = KernelSettings.result_retention_s
    strict = copy.copy(var)
    strict.fallback = False
    try:
        return Retention(strict.read(settings.env))
    except SettingsError:
        raw = settings.env.get(var.name)
        return Retention(
            var.default,
            f"{var.name}={raw!r} is not a number of seconds above 0, so a detached job's results wait the "
            f"default {hours(var.default)} (ask your admin to correct it)",
        )


def kept_for(record: Mapping[str, Any] | None) -> float:
    """The retention a job was started under (its record's); the default for a record without a usable one."""
    keep = (record or {}).get("retention_s")
    if isinstance(keep, (int, float)) and not isinstance(keep, bool) and 0 < keep < float("inf"):
        return float(keep)
    return DEFAULT_RETENTION_S


def taken(record: Mapping[str, Any] | None) -> bool:
    return record is not None and "taken" in record


def expired(record: Mapping[str, Any] | None, ended: float | None, now: float) -> bool:
    """Whether a detached job's results (and what else of it is kept) may go: its retention has passed
    since it ended. A running job (ended None) never expires."""
    return record is not None and ended is not None and now - ended > kept_for(record)


class DetachSummary(BaseModel):
    """What `%tfdist list` and the panel add for a job: detached or not, where its results are, until
    when they wait (merged into the job's `tfdist.jobrecords.JobSummary`)."""

    model_config = ConfigDict(frozen=True)

    detached: bool
    results: ResultsState | None = None
    kept_until: float | None = None

    def fields(self) -> dict[str, Any]:
        """The summary's fields this adds (unset ones left off, as the panel expects)."""
        return self.model_dump(exclude_none=True)

    def note(self) -> str:
        """`%tfdist list`'s word on it ("" for an ordinary job)."""
        if not self.detached:
            return ""
        return f" [{NOTES.get(self.results or '', 'detached')}]"


NOTES: dict[str, str] = {
    "waiting": "detached: results wait for %tfdist attach",
    "taken": "detached: results taken",
    "none": "detached: no results",
}


def summary(
    record: Mapping[str, Any] | None, ended: float | None, has_results: bool | None = None
) -> DetachSummary:
    """A job's detach summary from its record (None: not detached) and its end (None: still running).
    `has_results`: whether its results are there to take (None: not known here, taken to be so)."""
    if record is None:
        return DetachSummary(detached=False)
    if taken(record):
        return DetachSummary(detached=True, results="taken")
    if ended is None:
        return DetachSummary(detached=True, results="pending")
    if has_results is False:
        return DetachSummary(detached=True, results="none", kept_until=ended + kept_for(record))
    return DetachSummary(detached=True, results="waiting", kept_until=ended + kept_for(record))


def row_note(row: Mapping[str, Any]) -> str:
    """`%tfdist list`'s word on a listed job (a summary with the detach fields merged in)."""
    if not row.get("detached"):
        return ""
    return DetachSummary(detached=True, results=row.get("results")).note()


# ------------------------------------------------------------------ what users read
def started(name: str, keep: Retention) -> str:
    """The cell's line once a detached job has started (both backends)."""
    line = (
        f"tfdist: job {name} started detached; it runs without this kernel. `%tfdist attach {name}` in any "
        f"later kernel of this server follows it and brings its results (kept {hours(keep.seconds)} after "
        "it ends, once)"
    )
    return line + (f"\ntfdist: {keep.problem}" if keep.problem else "")


def already_taken(name: str) -> str:
    return (
        f"the results of job {name!r} were already taken by an earlier attach (results come back once; "
        "they are not kept after that)"
    )


def not_detached(name: str) -> str:
    return (
        f"job {name!r} was not started with --detach: it belongs to the kernel that started it (its results "
        "went there); `%tfdist status` and `%tfdist logs` show it"
    )


def nothing_waiting(name: str, keep: float) -> str:
    """No detached job of that name to attach to: one sentence for never started, another user's, and
    deleted after the retention, so that it says nothing about other users' jobs."""
    return (
        f"no detached tfdist job named {name!r} is waiting here: it was never started with this server's "
        f"state directory, belongs to another user, or ended more than {hours(keep)} ago and its results "
        "were deleted (see %tfdist list)"
    )


def results_gone(name: str) -> str:
    return (
        f"job {name!r} has ended and its results are gone (they are kept until fetched once, or for the "
        "retention time)"
    )
