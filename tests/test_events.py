"""Events as typed records (`tfdist.events`): every record survives the JSON wire unchanged, the dicts
producers wrote before the records (older pods, the agent's relay) read the same, and anything malformed
is refused with one clear error: a JobView, the kernel's event loop and the monitor fed it keep working."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time

import numpy as np
import pytest

from tfdist import events as ev
from tfdist.events import (
    EventError,
    MetricsEvent,
    SnapshotEvent,
    StateEvent,
    TaskEvent,
    error_info,
    parse,
    to_wire,
)
from tfdist.jobview import JobView
from tfdist.kernel_magics.magics import TfdistMagics
from tfdist.kernel_magics.monitor import TextMonitor, WidgetMonitor, log_text, static_png, tasks_html
from tfdist.runtime import events as wire
from tfdist.runtime.coordinator import _progress
from tfdist.sampler import TaskProcess, TaskSampler
from tfdist.tf_config import TaskId

SAMPLE = {
    "cpu (%)": 12.5,
    "rss (MiB)": 300.0,
    "gpus": [{"index": 1, "util (%)": 90.0, "mem_used (MiB)": 1000.0, "mem_total (MiB)": 80000.0}],
}


def _view_dict() -> dict:
    v = JobView(name="j", user="u", total_tasks=2)
    for e in good_records():
        v.apply(e)
    return v.to_dict()


def good_records() -> list:
    return [
        StateEvent(state="starting", message="starting tasks"),
        TaskEvent(task="worker-0", state="starting", pid=123, restarts=0, gpus=["0", "MIG-1a2b"]),
        TaskEvent(task="ps-0", state="running", node="gpu-node-1"),
        TaskEvent(task="worker-0", state="restarting", exit_code=-9, restarts=1),
        ev.ProgressEvent(phase="connecting"),
        ev.ProgressEvent(phase="fit", epoch=0, step=0, epochs=3),
        ev.ProgressEvent(phase="fit", step=40, t=1000.5),
        ev.ProgressEvent(
            phase="fit", epoch=1, epochs=3, steps=100, logs={"loss": 0.5, "acc": None}, t=1001.0
        ),
        MetricsEvent(t=1001.0, tasks={"worker-0": SAMPLE, "ps-0": {"cpu (%)": None, "rss (MiB)": None}}),
        ev.LogEvent(lines=[("worker-0", "epoch 1 <b>done</b>"), ("tfdist", "tfdist: a line of ours")]),
        StateEvent(
            state="failed",
            message="the cell raised",
            t=1002.0,
            reason="cell-error",
            error=ev.ErrorInfo(type="ValueError", message="bad", traceback="Traceback ..."),
        ),
    ]


@pytest.mark.parametrize("record", [*good_records(), "snapshot"], ids=lambda r: getattr(r, "type", r))
def test_every_record_survives_the_json_wire(record) -> None:
    if record == "snapshot":
        record = SnapshotEvent(view=_view_dict())
    line = wire.dumps(to_wire(record))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    back = parse(wire.loads(line))
    assert back == record and type(back) is type(record)
    assert to_wire(back) == json.loads(line)


def test_the_task_is_a_task_id_and_travels_as_its_name() -> None:
    rec = parse({"type": "task", "task": "ps-1", "state": "running"})
    assert rec.task == TaskId("ps", 1) and rec.task.role == "ps"
    assert to_wire(rec)["task"] == "ps-1"


# What producers wrote before the records, and older pods (podmain, the agent) still write.
LEGACY = [
    {"type": "state", "state": "starting", "message": "starting tasks"},
    {
        "type": "state",
        "state": "failed",
        "message": "x",
        "t": 5.0,
        "reason": "task-failed",
        "error": {"type": "WorkerLost", "message": "x", "traceback": "", "reason": "task-failed"},
    },
    {"type": "state", "state": "succeeded", "t": 7.0, "message": "finished"},  # podmain's key order
    {"type": "task", "task": "worker-1", "state": "starting", "pid": 9, "restarts": 0, "gpus": ["1"]},
    {"type": "task", "task": "chief-0", "state": "pending", "node": None},  # kube.status: no node yet
    {"type": "progress", "phase": "waiting for the payload"},
    {"type": "progress", "phase": "fit", "epoch": 0, "step": 0, "epochs": None},
    {
        "type": "progress",
        "phase": "fit",
        "epoch": 2,
        "epochs": 5,
        "steps": None,
        "logs": {"loss": 1},
        "t": 3.0,
    },
    {"type": "metrics", "t": 2.0, "tasks": {"ps-0": SAMPLE}},
    {"type": "log", "lines": [["ps-0", "a line"]]},
]


@pytest.mark.parametrize("d", LEGACY, ids=lambda d: d["type"])
def test_the_dicts_written_before_read_the_same(d: dict) -> None:
    rec = parse(json.loads(json.dumps(d)))
    assert to_wire(rec) == {k: v for k, v in d.items() if v is not None}  # None was never information


def test_the_supervisors_lines_are_byte_identical() -> None:
    """Same keys in the same order as the dicts the supervisor wrote: the same bytes on the socket."""
    old = {"type": "state", "state": "failed", "message": "m", "t": 1.5, "reason": "lost"}
    assert wire.dumps(to_wire(StateEvent(state="failed", message="m", t=1.5, reason="lost"))) == wire.dumps(
        old
    )
    old = {"type": "task", "task": "worker-0", "state": "starting", "pid": 4, "restarts": 0, "gpus": []}
    new = TaskEvent(task="worker-0", state="starting", pid=4, restarts=0, gpus=[])
    assert wire.dumps(to_wire(new)) == wire.dumps(old)


def test_a_real_samplers_output_is_a_metrics_record_unchanged() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        s = TaskSampler()
        s.track(TaskProcess("worker-0", proc.pid, []))
        time.sleep(0.2)
        sample = s.sample()
        rec = parse(sample)
        assert isinstance(rec, MetricsEvent) and rec.tasks["worker-0"]["rss (MiB)"] > 1
        assert to_wire(rec) == json.loads(wire.dumps(sample))
    finally:
        proc.kill()
        proc.wait()


HUGE = "x" * (5 * 2**20)
MALFORMED = [
    ([1, 2], "an event is a JSON object, not list"),
    ("state", "an event is a JSON object, not str"),
    (None, "an event is a JSON object, not NoneType"),
    ({}, "unknown event type NoneType"),
    ({"type": "reboot"}, "unknown event type 'reboot'"),
    ({"type": ["state"]}, "unknown event type list"),
    ({"type": "state"}, "malformed state event: state: Field required"),
    ({"type": "state", "state": "exploded"}, "malformed state event: state: Input should be 'pending'"),
    ({"type": "state", "state": "failed", "error": "boom"}, "error: Input should be a valid dictionary"),
    (
        {"type": "state", "state": "failed", "error": {"type": ["x"]}},
        "error.type: Input should be a valid string",
    ),
    ({"type": "state", "state": "running", "message": 5}, "message: Input should be a valid string"),
    ({"type": "state", "state": "running", "t": float("nan")}, "t: Input should be a finite number"),
    ({"type": "state", "state": "running", "message": HUGE}, "message: String should have at most"),
    ({"type": "task", "state": "running"}, "malformed task event: task: Field required"),
    ({"type": "task", "task": "evil-0", "state": "running"}, "'evil-0' is not a task name"),
    ({"type": "task", "task": HUGE, "state": "running"}, "a task is named by a string"),
    ({"type": "task", "task": 3, "state": "running"}, "a task is named by a string"),
    (
        {"type": "task", "task": "ps-0", "state": "running", "restarts": "2"},
        "restarts: Input should be a valid integer",
    ),
    (
        {"type": "task", "task": "ps-0", "state": "running", "restarts": True},
        "restarts: Input should be a valid integer",
    ),
    (
        {"type": "task", "task": "ps-0", "state": "running", "restarts": -1},
        "restarts: Input should be greater",
    ),
    (
        {"type": "task", "task": "ps-0", "state": "running", "gpus": "0"},
        "gpus: Input should be a valid tuple",
    ),
    ({"type": "progress", "epoch": 1.5}, "epoch: Input should be a valid integer"),
    ({"type": "progress", "logs": {"loss": float("inf")}}, "logs.loss: Input should be a finite number"),
    ({"type": "progress", "logs": {"loss": "low"}}, "logs.loss: Input should be a valid number"),
    ({"type": "progress", "logs": [1]}, "logs: Input should be a valid dictionary"),
    ({"type": "metrics", "tasks": {}}, "malformed metrics event: t: Field required"),
    ({"type": "metrics", "t": 1.0, "tasks": []}, "tasks: Input should be a valid dictionary"),
    (
        {"type": "metrics", "t": 1.0, "tasks": {"ps-0": {"gpus": [{}]}}},
        "tasks.ps-0.gpus.0.index: Field required",
    ),
    ({"type": "metrics", "t": 1.0, "tasks": {"ps-0": {"cpu (%)": "<b>9</b>"}}}, "tasks.ps-0.cpu (%)"),
    ({"type": "metrics", "t": 1.0, "tasks": {"ps-0": {"rss (MiB)": float("nan")}}}, "finite number"),
    ({"type": "metrics", "t": 1.0, "tasks": {HUGE: {}}}, "tasks."),
    ({"type": "metrics", "t": 1.0, "tasks": {f"worker-{i}": {} for i in range(5000)}}, "at most 4096 items"),
    ({"type": "log", "lines": [["ps-0"]]}, "lines.0.1: Field required"),
    ({"type": "log", "lines": [["ps-0", 7]]}, "lines.0.1: Input should be a valid string"),
    ({"type": "log", "lines": [["ps-0", HUGE]]}, "lines.0.1: String should have at most 65536"),
    ({"type": "log", "lines": [["ps-0", "x"]] * 20_000}, "at most 10000 items"),
    ({"type": "log", "lines": "hello"}, "lines: Input should be a valid tuple"),
    ({"type": "snapshot"}, "view: Field required"),
    ({"type": "snapshot", "view": {"tasks": 5}}, "view.tasks: Input should be a valid dictionary"),
    ({"type": "snapshot", "view": {"metrics": [{"t": 1, "tasks": {"ps-0": {"gpus": 3}}}]}}, "view.metrics.0"),
    ({"type": "snapshot", "view": {"logs": [["a"]]}}, "view.logs.0.1: Field required"),
]


@pytest.mark.parametrize("bad,said", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_events_are_refused_with_one_clear_error(bad, said: str) -> None:
    with pytest.raises(EventError) as info:
        parse(bad)
    msg = str(info.value)
    assert said in msg, msg
    assert len(msg) < 1000 and "xxxxxxxxxx" not in msg  # never the offending value itself
    assert isinstance(info.value, ValueError)


def test_nan_in_a_json_line_is_refused() -> None:
    line = b'{"type":"progress","phase":"fit","epoch":1,"logs":{"loss":NaN}}\n'
    with pytest.raises(EventError, match="finite"):
        parse(wire.loads(line))


def test_a_deeply_nested_event_is_refused() -> None:
    deep: dict = {}
    for _ in range(200):
        deep = {"a": deep}
    with pytest.raises(EventError):
        parse({"type": "snapshot", "view": {"spec": {"x": deep}, "tasks": deep}})


def _snapshot(d: object) -> bool:
    return isinstance(d, dict) and d.get("type") == "snapshot"


def _stream() -> list:
    """A run with a malformed event of every kind between the good ones."""
    t0 = time.time()
    out: list = []
    # (None is the pump's end of stream, not an event)
    bad = [b for b, _ in MALFORMED if isinstance(b, (dict, list, str)) and not _snapshot(b)]
    good = [
        {"type": "state", "state": "starting", "message": "starting tasks"},
        {"type": "task", "task": "worker-0", "state": "running", "gpus": ["1"]},
        {"type": "task", "task": "ps-0", "state": "running"},
        {"type": "state", "state": "running", "message": "training"},
        {"type": "progress", "phase": "fit", "epoch": 1, "epochs": 2, "logs": {"loss": 1.0}, "t": t0 + 1},
        {"type": "metrics", "t": t0 + 1, "tasks": {"worker-0": SAMPLE, "ps-0": SAMPLE}},
        {"type": "progress", "phase": "fit", "epoch": 2, "epochs": 2, "logs": {"loss": 0.5}, "t": t0 + 2},
        {"type": "metrics", "t": t0 + 2, "tasks": {"worker-0": SAMPLE}},
        {"type": "log", "lines": [["worker-0", "still fine"]]},
    ]
    for i, g in enumerate(good):
        out.append(g)
        out.extend(bad[i :: len(good)])
    out.append({"type": "state", "state": "succeeded", "message": "finished", "t": t0 + 3})
    return out


def test_a_view_fed_malformed_events_keeps_working_and_says_so_once() -> None:
    stream = _stream()
    v = JobView(name="j", total_tasks=3)
    applied = [v.apply(e) for e in stream]
    n_bad = applied.count(False)
    assert n_bad == len(MALFORMED) - 5 and v.dropped == n_bad
    assert v.state == "succeeded" and v.reason == "finished" and v.epoch == 2
    assert [x["loss"] for x in v.epoch_logs] == [1.0, 0.5] and len(v.metrics) == 2
    said = [line for task, line in v.logs if "malformed" in line]
    assert (
        len(said) == 1 and said[0].startswith("tfdist: ignored a malformed event (") and len(said[0]) < 1200
    )
    assert "still fine" in log_text(v)
    # a snapshot of it is a valid event, and keeps the count
    again = JobView()
    assert again.apply(SnapshotEvent(view=v.to_dict())) and again.dropped == n_bad
    assert again.summary() == v.summary()


def test_the_monitor_draws_a_run_with_malformed_events() -> None:
    v = JobView(name="j", total_tasks=3)
    m = WidgetMonitor(v)
    for e in _stream():
        v.apply(e)
        m.refresh(v)
    assert "succeeded" in m.header.value and "still fine" in m.logs.value
    assert "worker-0" in tasks_html(v)
    assert static_png(v)[:4] == b"\x89PNG"
    m.close()
    TextMonitor(v).refresh(v)


def test_the_kernels_event_loop_survives_a_hostile_stream() -> None:
    """What the cell runs: the pump's queue drained into the view (`TfdistMagics._drain`)."""
    q: queue.Queue = queue.Queue()
    for e in _stream():
        q.put(e)
    q.put(None)
    v = JobView(name="j")
    assert TfdistMagics._drain(v, q, timeout=5) is True
    assert v.finished and v.dropped > 0


def test_a_broken_error_record_still_ends_the_job() -> None:
    assert error_info(None) is None
    good = {"type": "ValueError", "message": "m", "traceback": "t", "reason": "cell-error"}
    assert to_wire(error_info(good)) == good
    info = error_info({"type": ["not", "a", "name"], "message": 5, "traceback": "x" * 10})
    assert info is not None and info.message == "5" and "not" in info.type
    StateEvent(state="failed", error=info)  # a valid record: the final event goes out


def test_the_coordinators_progress_never_raises() -> None:
    rec = _progress(phase="fit", epoch=np.int64(3), epochs=np.int64(5), steps=np.int32(100), t=time.time())
    assert rec.epoch == 3 and rec.epochs == 5 and rec.steps == 100
    rec = _progress(phase="fit", epoch=1, logs={"m" * 1000: 1.0}, t=1.0)  # a metric name past the bounds
    assert rec.epoch == 1 and rec.logs is None
    rec = _progress(phase="fit", epoch=-1, t=float("nan"))
    assert rec.phase == "fit" and rec.epoch is None


def test_records_are_frozen_and_build_checked() -> None:
    rec = StateEvent(state="running")
    with pytest.raises(ValueError):
        rec.state = "failed"  # type: ignore[misc]
    with pytest.raises(ValueError):
        TaskEvent(task="gpu-0", state="running")
    assert set(ev.JOB_STATES) == {"pending", "starting", "running", "succeeded", "failed", "stopped"}
    assert os.path.basename(ev.__file__) == "events.py"


def test_pod_derived_events_are_records_whatever_the_cluster_says() -> None:
    """kube.status builds records from pods: a huge status message is cut, a pod naming no task is skipped,
    and every event it yields parses back."""
    from tfdist.kube import names as kn
    from tfdist.kube import status as st

    def pod(role: str, index: str, message: str) -> dict:
        labels = {kn.L_ROLE: role, kn.L_INDEX: index}
        return {
            "metadata": {"name": f"p-{role}", "labels": labels},
            "spec": {"nodeName": "n1"},
            "status": {"phase": "Failed", "reason": message},
        }

    tasks: st.TaskStates = {}
    out = st.task_events([pod("ps", "0", HUGE), pod("evil", "0", "x"), pod("worker", "1", "Error")], tasks)
    recs = [parse(d) for d in out]
    assert {str(r.task) for r in recs if isinstance(r, TaskEvent)} == {"ps-0", "worker-1"}
    assert "evil-0" not in tasks and all(len(ev.encode(d)) < 10_000 for d in out)
    done = st.outcome(tasks)
    assert isinstance(parse(done), StateEvent) and done.error is not None and done.error.type == "PodFailed"
    v = st.view("j", None, [pod("chief", "0", "DeadlineExceeded")], None, time.time())
    assert v.state == "failed" and v.dropped == 0


async def test_a_pods_malformed_events_stop_at_the_agent_client(tmp_path) -> None:
    """The real agent relays whatever its pods sent; the kernel's client yields only checked events
    (the first malformed one said once in the log), and the stream still ends at the final state."""
    import socket

    from tfdist.kube.agent_client import AgentClient
    from tfdist.runtime.agent import AgentState, serve

    token = "job-token-0123456789"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = AgentState(str(tmp_path), token)
    srv = serve(state, port, host="127.0.0.1")
    client = AgentClient(f"http://127.0.0.1:{port}", token, retry_for=5)
    try:
        for e in [{"type": "progress", "phase": "fit", "epoch": 1}, *(b for b, _ in MALFORMED[:11])]:
            state.log.add(e)
        state.log.add({"type": "state", "state": "succeeded", "message": "finished", "t": 5.0})
        got = [e async for e in client.events()]
    finally:
        await client.close()
        srv.shutdown()
    assert [e.type for e in got] == ["progress", "log", "state"]
    assert "ignored a malformed event from the job's agent" in got[1].lines[0][1]
    v = JobView(name="j")
    assert all(v.apply(e) for e in got) and v.state == "succeeded" and v.dropped == 0


def test_a_mig_instances_sample_keeps_its_uuid_profile_and_why_util_is_missing() -> None:
    """The sampler writes these for a MIG slice (tfdist.sampler); the wire must not strip them, or the cell's
    monitor cannot say "n/a (MIG)" and shows an unnamed GPU instead."""
    gpu = {
        "index": 0,
        "util (%)": None,
        "mem_used (MiB)": 812.0,
        "mem_total (MiB)": 9728.0,
        "uuid": "MIG-2bb8a0d4-6c4e-5f7b-9d4c-0a1b2c3d4e5f",
        "mig_profile": "1g.10gb",
        "util_missing": "mig",
    }
    sample = {
        "type": "metrics",
        "t": 1.0,
        "tasks": {"worker-0": {"cpu (%)": 3.0, "rss (MiB)": 90.0, "gpus": [gpu]}},
    }
    rec = parse(wire.loads(wire.dumps(sample)))
    assert rec.tasks["worker-0"]["gpus"] == [gpu]
