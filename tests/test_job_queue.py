"""A job waiting in the cluster's queue (Kueue), from its record to every display: one field of the view
(`JobView.queue`, folded from a `QueueEvent`) reaches the cell's monitor, `%tfdist list`, the lab server's
JSON and the panel's generated TypeScript type with no edit of theirs (issue 23's "done means").

The producer (tfdist.kube.queueing, watching Kueue's workloads) needs a cluster with Kueue; here the real
records are fed through a Backend double (tests/doubles/event_backend.py) to the real readers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.doubles.event_backend import EventBackend
from tfdist.events import EventError, QueueEvent, StateEvent, parse, to_wire
from tfdist.job.vocab import TaskState
from tfdist.jobrecords import JobList, JobSummary, wire
from tfdist.jobview import JobView, summary_fields
from tfdist.kernel_magics.magics import TfdistMagics
from tfdist.kernel_magics.monitor import TextMonitor, header_html
from tfdist.kube import names as kn
from tfdist.kube import status as kst

pytest_plugins = ["pytest_jupyter.jupyter_server"]

SENTENCE = "queued: 3rd in team-a, about 20 min"
WIRE = {"type": "queue", "position": 3, "queue": "team-a", "ahead": 2, "wait_s": 1200, "scope": "queue"}
ROOT = Path(__file__).resolve().parent.parent


def queued_view() -> JobView:
    v = JobView(name="q", user="alice", total_tasks=4)
    assert v.apply(StateEvent(state="starting", message="submitted"))
    assert v.apply(WIRE)  # as a wire dict: parsed where every stream meets
    return v


def test_the_record_reads_its_wire_form_and_says_where_the_job_waits() -> None:
    ev = parse(WIRE)
    assert isinstance(ev, QueueEvent) and (ev.position, ev.queue, ev.ahead, ev.wait_s) == (
        3,
        "team-a",
        2,
        1200,
    )
    assert parse(to_wire(ev)) == ev
    assert ev.info().sentence() == SENTENCE
    assert parse({"type": "queue", "position": 1}).info().sentence() == "queued: 1st in line"
    assert QueueEvent(position=22, wait_s=30).sentence() == "queued: 22nd in line, about 1 min"
    assert QueueEvent(position=11, queue="q", wait_s=3 * 3600).sentence() == "queued: 11th in q, about 3 h"
    # counted among the user's own jobs only (no visibility API): never passed off as the queue's place
    own = parse({"type": "queue", "position": 1, "queue": "q", "scope": "own"}).info()
    assert own.sentence().startswith("queued: 1st of your jobs in q (other users' jobs in the queue are not")
    whole = parse({"type": "queue", "position": 2, "scope": "queue"}).info()
    assert whole.sentence() == "queued: 2nd in line"


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "queue"},  # the position is the one field a queue record must have
        {"type": "queue", "position": 0},
        {"type": "queue", "position": "3"},
        {"type": "queue", "position": 3, "wait_s": float("nan")},
        {"type": "queue", "position": 3, "queue": "x" * 300},
        {"type": "queue", "position": 3, "scope": "everyone"},  # "queue" or "own" only
    ],
)
def test_a_malformed_queue_record_is_refused_and_changes_nothing(bad: dict) -> None:
    with pytest.raises(EventError):
        parse(bad)
    v = queued_view()
    assert not v.apply(bad) and v.queue is not None and v.message == SENTENCE and v.dropped == 1


def test_the_view_folds_it_until_the_job_is_admitted() -> None:
    v = queued_view()
    assert v.queue is not None and v.queue.position == 3 and v.message == SENTENCE
    assert v.state == "starting" and v.state_word == "queued"
    assert v.apply({**WIRE, "position": 1, "wait_s": 60})
    assert v.message == "queued: 1st in team-a, about 1 min"
    assert v.apply(StateEvent(state="running", message="all tasks running"))
    assert v.queue is None and v.state_word == "running"
    assert v.apply(WIRE)  # a late word of the queue: the job already runs
    assert v.queue is None and v.message == "all tasks running"


def gated_pod(task: str, reason: str, message: str) -> dict:
    """A task pod as the API server reports it while it has no node."""
    role, index = task.split("-")
    gates = [{"name": "kueue.x-k8s.io/admission"}] if reason == "SchedulingGated" else []
    return {
        "metadata": {"name": f"q-{task}", "labels": {kn.L_ROLE: role, kn.L_INDEX: index}},
        "spec": {"schedulingGates": gates},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": reason, "message": message}],
        },
    }


def test_pods_held_by_kueue_leave_the_place_in_line_as_the_jobs_word() -> None:
    """The pod watch's word for a gated pod is not the scheduler's "blocked" sentence, which (arriving
    after Kueue's place in line, said only when it changes) hid where the job waited; a pod no node fits
    once admitted still says why."""
    v, tasks = queued_view(), {}
    gate = "Scheduling is blocked due to non-empty scheduling gates"
    for e in kst.task_events([gated_pod("worker-0", "SchedulingGated", gate)], tasks):
        assert v.apply(e)
    assert v.state_word == "queued" and v.message == SENTENCE
    assert tasks["worker-0"] == (TaskState.PENDING, kst.ADMISSION_WAIT)
    full = "0/1 nodes are available: 1 Insufficient cpu."
    out = kst.task_events([gated_pod("worker-0", "Unschedulable", full)], tasks)
    assert [e for e in out if isinstance(e, StateEvent) and e.message == f"worker-0: {full}"], out


def test_a_snapshot_keeps_it_and_is_checked_against_the_views_own_fields() -> None:
    v = queued_view()
    again = JobView()
    assert again.apply({"type": "snapshot", "view": json.loads(json.dumps(v.to_dict()))})
    assert again.queue == v.queue and again.state_word == "queued" and again.summary() == v.summary()
    broken = {**v.to_dict(), "queue": {"position": -1}}
    assert not again.apply({"type": "snapshot", "view": broken}) and again.dropped == 1


def test_the_cell_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    v = queued_view()
    head = header_html(v)
    assert ">queued</span>" in head and SENTENCE in head
    TextMonitor(v).refresh(v)
    assert capsys.readouterr().out.strip() == f"q: {SENTENCE}"


@pytest.fixture
def lister(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[TfdistMagics, EventBackend]:
    monkeypatch.setenv("TFDIST_USER", "alice")
    monkeypatch.setenv("TFDIST_BACKEND", "local")
    monkeypatch.setenv("TFDIST_STATE_DIR", str(tmp_path))
    magics = TfdistMagics(None)
    backend = EventBackend()
    magics._backends["local"] = backend
    return magics, backend


def test_tfdist_list_shows_it(lister, capsys: pytest.CaptureFixture[str]) -> None:
    magics, backend = lister
    backend.feed(
        "q", StateEvent(state="starting"), QueueEvent(**{k: v for k, v in WIRE.items() if k != "type"})
    )
    backend.feed("r", StateEvent(state="running", message="all tasks running"), user="alice")
    backend.views["q"].user = "alice"
    magics.list([])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["q"].split()[2] == "queued" and rows["q"].endswith(SENTENCE), rows
    assert rows["r"].split()[2] == "running"


@pytest.fixture
def jp_server_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """The lab server as the installed jupyter-config file enables it, for user alice."""
    monkeypatch.setenv("TFDIST_USER", "alice")
    monkeypatch.setenv("TFDIST_BACKEND", "local")
    monkeypatch.setenv("TFDIST_STATE_DIR", str(tmp_path))
    return {"ServerApp": {"jpserver_extensions": {"tfdist": True}}}


def test_the_lab_servers_json_carries_it(jp_fetch, jp_serverapp, jp_asyncio_loop) -> None:
    """The jobs list and the job's view, as the panel fetches them, through the server's real handlers."""
    backend = EventBackend()
    backend.feed("q", StateEvent(state="starting"), parse(WIRE), user="alice")
    jp_serverapp.web_app.settings["tfdist"]._backend = backend

    async def get(*path: str) -> dict:
        return json.loads((await jp_fetch("tfdist", "api", *path)).body)

    async def scenario() -> tuple[list, dict, dict]:
        return await backend.list_jobs(), await get("jobs"), await get("jobs", "q")

    summaries, listed, detail = jp_asyncio_loop.run_until_complete(scenario())
    assert isinstance(summaries[0], JobSummary)
    [job] = listed["jobs"]
    assert job["queue"] == {"position": 3, "queue": "team-a", "ahead": 2, "wait_s": 1200.0, "scope": "queue"}
    assert job["message"] == SENTENCE and job["state"] == "starting"
    assert detail["summary"]["queue"] == job["queue"] and detail["message"] == SENTENCE
    assert wire(JobList, listed) == listed  # what the panel reads is the record's own form


def test_the_panels_generated_type_has_it() -> None:
    """The committed TypeScript (generated from the schema that tests/test_jobrecords.py keeps current)."""
    fields = summary_fields()  # the view's fields marked summary(...): the summary's without an edit there
    assert "queue" in fields and set(fields) <= set(JobSummary.model_fields)
    assert JobSummary.model_fields["queue"].description == fields["queue"][1].description
    ts = (ROOT / "labextension" / "src" / "records.generated.ts").read_text()
    summary = ts[ts.index("export interface JobSummary {") :]
    assert "queue?: QueueInfo | null;" in summary[: summary.index("\n}")]
    info = ts[ts.index("export interface QueueInfo {") :]
    info = info[: info.index("\n}")]
    for field in (
        "position: number;",
        "queue?: string | null;",
        "ahead?: number | null;",
        'scope?: ("queue" | "own") | null;',
        "wait_s?: number | null;",
    ):
        assert field in info, info
