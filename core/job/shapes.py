"""The bounded field types and the typed dicts that a job's event records and its view share: the
shapes of the job protocol's values, apart from the messages that carry them (`tfdist.job.events`, the
records and their wire codec) and the fold that keeps them (`tfdist.job.view`).

Why typed dicts and not models for samples and task records: a snapshot holds 600 samples of every task,
checked without building an object per task, and the monitor reads them as the dicts the sampler writes.
The bounds are far above anything tfdist writes, so only a broken or hostile producer reaches them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    StrictFloat,
    StrictInt,
    StringConstraints,
)
from typing_extensions import Required, TypedDict

from ..tf_config import ROLES, TaskId

# Bounds far above anything tfdist writes (log lines are cut at 2,000 characters, tracebacks are a few
# KiB): only a broken or hostile producer reaches them.
NAME_MAX = 256  # states, phases, reasons, error types, task names, metric names
TEXT_MAX = 2**20  # a message (a cell's exception text may be long)
TRACEBACK_MAX = 4 * 2**20
LINE_MAX = 64 * 2**10  # one log line
LINES_MAX = 10_000  # log lines in one event
TASKS_MAX = 4096  # tasks in one metrics sample
GPUS_MAX = 64  # GPUs of one task
KEYS_MAX = 256  # metrics of one epoch

Name = Annotated[str, StringConstraints(strict=True, max_length=NAME_MAX)]
Text = Annotated[str, StringConstraints(strict=True, max_length=TEXT_MAX)]
Line = Annotated[str, StringConstraints(strict=True, max_length=LINE_MAX)]
Count = Annotated[StrictInt, Field(ge=0)]
Num = StrictInt | StrictFloat  # finite: every model refuses NaN and infinities (allow_inf_nan=False)
Time = Annotated[StrictFloat, Field(ge=0)]


def _task_id(value: Any) -> TaskId:
    if isinstance(value, TaskId):
        return value
    if not isinstance(value, str) or len(value) > NAME_MAX:
        raise ValueError("a task is named by a string such as worker-0")
    return TaskId.parse(value)


Task = Annotated[TaskId, PlainValidator(_task_id), PlainSerializer(str, return_type=str)]
# a task kept as its text (dict keys, JobView): TaskId's form, checked without a Python call per key
_TASK_PATTERN = f"^({'|'.join(ROLES)})-[0-9]+$"
TaskName = Annotated[str, StringConstraints(strict=True, max_length=NAME_MAX, pattern=_TASK_PATTERN)]

# A task's sample stays the dict the sampler writes and the monitor reads ("cpu (%)": None when not
# readable): typed dicts, checked without building an object per task (a snapshot holds 600 samples of
# every task).
GpuSample = TypedDict(
    "GpuSample",
    {
        "index": Required[StrictInt],
        "util (%)": Num | None,
        "mem_used (MiB)": Num | None,
        "mem_total (MiB)": Num | None,
        # a MIG instance: its UUID and profile, and why utilisation is None ("mig": NVML cannot measure it)
        "uuid": Name,
        "mig_profile": Name,
        "util_missing": Name,
    },
    total=False,
)
GpuSample.__pydantic_config__ = ConfigDict(allow_inf_nan=False)  # type: ignore[attr-defined]
TaskSample = TypedDict(
    "TaskSample",
    {
        "cpu (%)": Num | None,
        "rss (MiB)": Num | None,
        "gpus": Annotated[list[GpuSample], Field(max_length=GPUS_MAX)],
    },
    total=False,
)
TaskSample.__pydantic_config__ = ConfigDict(allow_inf_nan=False)  # type: ignore[attr-defined]


# What a view holds per sample, per task and for its error, declared once here and checked by the view's
# own fields.
class MetricsSample(TypedDict):
    t: Time
    tasks: Annotated[dict[TaskName, TaskSample], Field(max_length=TASKS_MAX)]


MetricsSample.__pydantic_config__ = ConfigDict(allow_inf_nan=False)  # type: ignore[attr-defined]


class TaskRecord(TypedDict, total=False):
    state: Name
    restarts: Count
    gpus: Annotated[list[Name], Field(max_length=GPUS_MAX)]
    exit_code: StrictInt | None
    pid: Count | None
    node: Name | None


class ErrorRecord(TypedDict, total=False):
    type: Name
    message: Text
    traceback: Annotated[str, StringConstraints(strict=True, max_length=TRACEBACK_MAX)]
    reason: Name | None


EpochLogs = Annotated[dict[Name, Num | None], Field(max_length=KEYS_MAX + 2)]
LogLine = tuple[Name, Line]
