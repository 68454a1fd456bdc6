"""The pure fold from a job's pods to its task events and verdict (tfdist.kube.podfold), with plain pod
dicts as the API server sends them: no API server, no watch. Events come out as records."""

from __future__ import annotations

from typing import Any

from tfdist.job.events import Event, LogEvent, StateEvent, TaskEvent
from tfdist.kube import names as kn
from tfdist.kube.podfold import PodFold, gone, timed_out


def pod(
    task: str, name: str, phase: str = "Running", created: str = "2026-01-01T00:00:00Z", **status
) -> dict:
    role, index = task.rsplit("-", 1)
    labels = {kn.L_ROLE: role, kn.L_INDEX: index}
    out: dict[str, Any] = {
        "metadata": {"name": name, "labels": labels, "creationTimestamp": created},
        "spec": {"nodeName": "node-1"},
        "status": {"phase": phase, **status},
    }
    return out


def kinds(events: list[Event]) -> list[tuple]:
    assert all(isinstance(e, (TaskEvent, StateEvent, LogEvent)) for e in events)
    task = lambda e: str(e.task) if isinstance(e, TaskEvent) else None  # noqa: E731
    return [(e.type, task(e), getattr(e, "state", None)) for e in events]


JOB = [pod("chief-0", "j-abc"), pod("worker-0", "j-worker-0-a"), pod("ps-0", "j-ps-0-a", "Pending")]


def test_a_list_says_each_task_once_and_running_once_all_run() -> None:
    fold = PodFold(expected=3)
    evs = fold.listed(JOB)
    assert kinds(evs) == [
        ("task", "chief-0", "running"),
        ("task", "worker-0", "running"),
        ("task", "ps-0", "pending"),
    ]
    assert fold.listed(JOB) == []  # nothing changed
    assert fold.running() == [] and fold.verdict() is None
    evs = fold.changed("MODIFIED", pod("ps-0", "j-ps-0-a"))
    assert kinds(evs) == [("task", "ps-0", "running")]
    assert [e.message for e in fold.running()] == ["all tasks running"]
    assert fold.running() == []  # once


def test_a_replaced_pod_is_a_restart_and_the_old_one_says_nothing() -> None:
    fold = PodFold(expected=3)
    fold.listed(JOB)
    assert kinds(fold.changed("MODIFIED", pod("worker-0", "j-worker-0-a", "Failed", reason="Error"))) == [
        ("task", "worker-0", "failed"),
        ("state", None, "starting"),
        ("log", None, None),
    ]
    assert fold.verdict() is None  # a PS-strategy worker is the Job controller's to replace
    evs = fold.changed("ADDED", pod("worker-0", "j-worker-0-b", "Pending", "2026-01-01T00:01:00Z"))
    assert kinds(evs)[:2] == [("task", "worker-0", "restarting"), ("log", None, None)]
    assert evs[0].restarts == 1 and evs[1].lines == (
        ("worker-0", "tfdist: worker-0 pod replaced by the cluster (1)"),
    )
    assert kinds(evs)[2:] == [("task", "worker-0", "pending")]
    assert fold.changed("DELETED", pod("worker-0", "j-worker-0-a", "Failed")) == []  # the old pod
    assert fold.tasks["worker-0"][0] == "pending"


def test_a_relist_sees_a_replacement_made_while_nobody_watched() -> None:
    fold = PodFold(expected=3)
    fold.listed(JOB)
    newer = pod("worker-0", "j-worker-0-b", created="2026-01-01T00:01:00Z")
    evs = fold.listed([*JOB, newer])  # the old pod still listed: the newest speaks for the task
    assert kinds(evs) == [("task", "worker-0", "restarting"), ("log", None, None)]


def verdict(fold: PodFold) -> tuple[str, str | None, str]:
    v = fold.verdict()
    assert isinstance(v, StateEvent)
    return (v.state, v.error.type if v.error else None, v.message)


def test_verdicts() -> None:
    fold = PodFold(expected=3)
    fold.listed(JOB)
    fold.changed("MODIFIED", pod("chief-0", "j-abc", "Succeeded"))
    assert verdict(fold) == ("succeeded", None, "finished")

    fold = PodFold(expected=3)
    fold.listed(JOB)
    fold.changed("MODIFIED", pod("ps-0", "j-ps-0-a", "Failed", reason="OOMKilled"))
    assert verdict(fold) == ("failed", "PodFailed", "ps-0: OOMKilled")

    fold = PodFold(expected=3, strategy="allreduce")
    fold.listed([pod("chief-0", "j-abc"), pod("worker-0", "w0"), pod("worker-1", "w1")])
    fold.changed("MODIFIED", pod("worker-1", "w1", "Failed", reason="Error"))
    state, kind, message = verdict(fold)
    assert (state, kind) == ("failed", "WorkerLost") and "worker-1" in message


def test_deleted_pods_empty_the_fold() -> None:
    fold = PodFold(expected=3)
    fold.listed(JOB)
    for p in JOB:
        fold.changed("DELETED", p)
    assert fold.empty and fold.verdict() is None
    deleted, listed = gone(listed=False), gone(listed=True)
    assert deleted.state == "stopped" and "deleted in the cluster" in deleted.message
    assert (listed.state, listed.message) == ("stopped", "no objects left")


def test_pods_without_a_task_are_not_the_jobs() -> None:
    fold = PodFold(expected=1)
    stray = {"metadata": {"name": "x", "labels": {}}, "status": {"phase": "Running"}}
    assert not fold.relevant(stray) and fold.changed("ADDED", stray) == [] and fold.listed([stray]) == []
    odd = pod("chief-0", "c") | {"metadata": {"name": "c", "labels": {kn.L_ROLE: "bogus"}}}
    assert fold.relevant(odd) and fold.listed([odd]) == [] and fold.empty  # labelled, but no task of ours
    newer = {"metadata": {"name": "d", "labels": {kn.L_ROLE: "bogus"}, "creationTimestamp": "2026-01-02"}}
    assert fold.changed("ADDED", newer) == []  # its "replacement" is not a restart of a task of ours


def test_not_running_in_time_names_each_tasks_words() -> None:
    fold = PodFold(expected=3)
    unsched = {
        "conditions": [{"type": "PodScheduled", "status": "False", "message": "0/1 nodes: Insufficient cpu"}]
    }
    fold.listed([pod("chief-0", "j-abc"), pod("ps-0", "p", "Pending", **unsched)])
    assert fold.not_running() == "ps-0: 0/1 nodes: Insufficient cpu"
    v = timed_out(30, fold.not_running())
    assert v.state == "failed" and v.error is not None and v.error.type == "Unschedulable"
    assert v.message == "not running within --timeout 30s; deleted. ps-0: 0/1 nodes: Insufficient cpu"
