"""One vocabulary of how a job ended, shared by the cell, `%tfdist list/status` and the lab panel."""

from __future__ import annotations

from tfdist.jobview import JobView, Reason, reason_for
from tfdist.memfit import Budget, GiB
from tfdist.runtime import lifeline


def running_view() -> JobView:
    v = JobView(name="j", total_tasks=4)
    for task, state in (("chief-0", "running"), ("worker-0", "running"), ("worker-1", "restarting")):
        v.apply({"type": "task", "task": task, "state": state})
    v.apply({"type": "task", "task": "ps-0", "state": "pending"})
    v.apply({"type": "state", "state": "running", "message": "training"})
    return v


def test_a_finished_job_has_no_live_task():
    v = running_view()
    v.apply(
        {
            "type": "state",
            "state": "stopped",
            "reason": "interrupted",
            "message": "interrupted from the notebook",
        }
    )
    states = {t: r["state"] for t, r in v.tasks.items()}
    assert states == {
        "chief-0": "stopped",
        "worker-0": "stopped",
        "worker-1": "stopped",
        "ps-0": "not started",
    }
    assert v.reason == "interrupted" and v.summary()["reason"] == "interrupted"
    # a late task event cannot bring a task of a finished job back to life
    v.apply({"type": "task", "task": "chief-0", "state": "running"})
    assert v.tasks["chief-0"]["state"] == "stopped"
    v.apply({"type": "state", "state": "running", "message": "training"})
    assert v.state == "stopped" and v.message == "interrupted from the notebook"


def test_success_ends_servers_as_exited_and_survives_a_snapshot():
    v = running_view()
    v.apply({"type": "task", "task": "chief-0", "state": "exited-ok"})
    v.apply({"type": "state", "state": "succeeded", "message": "finished", "reason": "finished"})
    assert v.tasks["chief-0"]["state"] == "exited-ok" and v.tasks["worker-0"]["state"] == "exited"
    again = JobView()
    again.apply({"type": "snapshot", "view": v.to_dict()})
    assert again.reason == "finished" and again.tasks == v.tasks


def test_reason_without_a_name_is_inferred_from_the_error():
    assert reason_for("succeeded") is Reason.FINISHED
    assert reason_for("stopped") is Reason.STOPPED
    assert reason_for("failed", {"type": "ParameterServerLost"}) is Reason.PS_LOST
    assert reason_for("failed", {"type": "StartupTimeout"}) is Reason.STARTUP_TIMEOUT
    assert reason_for("failed", {"type": "ZeroDivisionError", "traceback": "..."}) is Reason.CELL_ERROR
    assert reason_for("failed", {"type": "KeyError", "reason": "internal-error"}) is Reason.INTERNAL
    assert reason_for("failed", None) is Reason.LOST
    v = running_view()
    v.apply({"type": "state", "state": "failed", "message": "", "error": {"type": "OutOfMemory"}})
    assert v.reason == "out-of-memory" and v.message == Reason.OUT_OF_MEMORY.sentence()
    assert all(Reason(r).sentence() for r in Reason)  # every reason has its sentence
    assert Reason.parse("no-such-reason") is None and Reason.parse("bogus", Reason.STOPPED) is Reason.STOPPED


def test_oom_kills_are_read_from_the_memory_cgroup(tmp_path):
    v2 = tmp_path / "v2" / "user.slice" / "server"
    v2.mkdir(parents=True)
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 3\noom_group_kill 0\n")
    assert lifeline.oom_kills("0::/user.slice/server\n", root=str(tmp_path / "v2")) == 3
    v1 = tmp_path / "v1" / "memory" / "srv"
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    assert lifeline.oom_kills("4:memory:/srv\n1:cpu:/\n", root=str(tmp_path / "v1")) == 7
    (v1 / "kernel").mkdir()  # v1 counts each cgroup's own kills: the kernel's child cgroup is added
    (v1 / "kernel" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert lifeline.oom_kills("4:memory:/srv\n1:cpu:/\n", root=str(tmp_path / "v1")) == 9
    assert lifeline.oom_kills("0::/missing\n", root=str(tmp_path / "v2")) is None
    # a container without a cgroup namespace: the host's path, our own cgroup mounted as the root
    assert lifeline.oom_kills("4:memory:/host/container/srv\n", root=str(tmp_path / "v1")) == 9
    assert lifeline.oom_kills("garbage", root=str(tmp_path)) is None


def test_kernel_gone_says_memory_only_with_evidence():
    full = Budget(limit=2 * GiB, used=int(1.9 * GiB), source="cgroup")
    calm = Budget(limit=2 * GiB, used=int(0.8 * GiB), source="cgroup")
    code, why = lifeline.kernel_gone(1, 2, 0, calm)  # the OOM killer fired as the kernel went
    assert code is Reason.KERNEL_OOM and "ran out of memory" in why and "2.0 GiB" in why
    code, _ = lifeline.kernel_gone(1, 2, 1, calm)  # ...but that kill was one of our tasks
    assert code is Reason.KERNEL_GONE
    code, why = lifeline.kernel_gone(None, None, 0, full)  # no cgroup counter: the watchdog's limit
    assert code is Reason.KERNEL_GONE_MEMORY and "1.90 of the server's 2.00 GiB" in why
    assert why.startswith("the notebook kernel went away (it may have run out of memory")
    code, why = lifeline.kernel_gone(None, None, 0, calm)
    assert (code, why) == (Reason.KERNEL_GONE, "the notebook kernel that started this job went away")
    assert lifeline.kernel_gone(0, 0, 0, None)[0] is Reason.KERNEL_GONE
