"""tfdist.job.vocab: the protocol's words are enums whose values are the wire's strings (no wire change)."""

from __future__ import annotations

import json

from tfdist.job.vocab import LIVE_TASK_STATES, TERMINAL, FailureKind, JobState, Reason, TaskState
from tfdist.jobview import reason_for


def test_members_are_their_wire_strings() -> None:
    assert JobState.RUNNING == "running" and f"{JobState.FAILED}" == "failed" and str(Reason.LOST) == "lost"
    assert json.dumps({"state": JobState.STOPPED, "task": TaskState.EXITED_OK}) == (
        '{"state": "stopped", "task": "exited-ok"}'
    )
    assert "running" in LIVE_TASK_STATES and "succeeded" in TERMINAL and "exited-ok" not in LIVE_TASK_STATES
    assert {FailureKind.OUT_OF_MEMORY: 1}.get("OutOfMemory") == 1


def test_wire_values_unchanged() -> None:
    """The strings pods of older images write: renaming one would split the protocol."""
    assert [s.value for s in JobState] == ["pending", "starting", "running", "succeeded", "failed", "stopped"]
    assert {k.value for k in FailureKind} >= {
        "StartupError", "StartupTimeout", "Unschedulable", "ParameterServerLost", "OutOfMemory",
        "CoordinatorExit", "PodFailed", "WorkerLost",
    }  # fmt: skip
    assert TaskState.NOT_STARTED == "not started" and TaskState.IMAGE_ERROR == "image-error"


def test_parse_keeps_unknown_words_out() -> None:
    assert TaskState.parse("running") is TaskState.RUNNING
    assert TaskState.parse("evicted") is None and Reason.parse(3, Reason.LOST) is Reason.LOST


def test_failure_kind_gives_reason_for_older_records() -> None:
    assert reason_for("failed", {"type": FailureKind.OUT_OF_MEMORY}) is Reason.OUT_OF_MEMORY
    assert reason_for("failed", {"type": "WorkerLost"}) is Reason.TASK_FAILED
    assert reason_for("failed", {"type": "BackoffLimitExceeded"}) is Reason.LOST
    assert every_reason_has_a_sentence()


def every_reason_has_a_sentence() -> bool:
    return all(r.sentence() for r in Reason)
