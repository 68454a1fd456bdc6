"""Will the job fit this server's memory: the estimate, its message, and where the numbers come from."""

from __future__ import annotations

from pathlib import Path

from tfdist import memfit

GiB = 2**30


def test_the_default_job_does_not_fit_a_2_gib_server_and_says_why() -> None:
    budget = memfit.Budget(limit=2 * GiB, used=int(0.7 * GiB), source="server processes")
    why = memfit.refusal(2, 1, budget, memfit.Footprint())
    assert why is not None
    assert "needs about 2.7 GiB" in why and "4 TensorFlow processes" in why
    assert "1.3 GiB free" in why and "2.0 GiB limit" in why
    assert "more memory" in why and "Nothing was started" in why


def test_a_smaller_shape_is_suggested_when_one_fits() -> None:
    budget = memfit.Budget(limit=4 * GiB, used=int(0.7 * GiB), source="cgroup")
    why = memfit.refusal(4, 2, budget, memfit.Footprint())
    assert why is not None and "--workers 2 --ps 1 would fit" in why


def test_the_default_job_fits_the_default_profile() -> None:
    budget = memfit.Budget(limit=4 * GiB, used=int(0.7 * GiB), source="server processes")
    assert memfit.refusal(2, 1, budget, memfit.Footprint()) is None


def test_footprint_is_remembered_only_from_a_complete_job(tmp_path: Path) -> None:
    assert memfit.load_footprint(str(tmp_path)) == memfit.Footprint()
    memfit.save_footprint(str(tmp_path), {"ps": 300.0, "worker": 400.0})  # no coordinator seen
    assert not memfit.load_footprint(str(tmp_path)).measured
    memfit.save_footprint(str(tmp_path), {"ps": 300.0, "worker": 400.0, "chief": 900.0})
    fp = memfit.load_footprint(str(tmp_path))
    assert fp.measured and (fp.ps, fp.worker, fp.chief) == (300.0, 400.0, 900.0)
    (tmp_path / memfit.FOOTPRINT_FILE).write_text("{not json")
    assert memfit.load_footprint(str(tmp_path)) == memfit.Footprint()


def test_cgroup_limits_are_read_from_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "srv").mkdir(parents=True)
    (v2 / "srv" / "memory.max").write_text("2147483648\n")
    (v2 / "srv" / "memory.current").write_text("1073741824\n")
    assert memfit.cgroup_memory("0::/srv\n", root=str(v2)) == (2 * GiB, GiB)
    (v2 / "srv" / "memory.max").write_text("max\n")  # no limit: not a budget
    assert memfit.cgroup_memory("0::/srv\n", root=str(v2)) is None
    v1 = tmp_path / "v1"
    (v1 / "memory" / "kubepods" / "pod1").mkdir(parents=True)
    (v1 / "memory" / "kubepods" / "pod1" / "memory.limit_in_bytes").write_text(str(3 * GiB))
    (v1 / "memory" / "kubepods" / "pod1" / "memory.usage_in_bytes").write_text(str(GiB))
    text = "12:cpu,cpuacct:/kubepods/pod1\n7:memory:/kubepods/pod1\n0::/\n"
    assert memfit.cgroup_memory(text, root=str(v1)) == (3 * GiB, GiB)


def test_without_a_limit_there_is_no_budget() -> None:
    import os

    if memfit.cgroup_memory() is None:  # this test machine's own cgroup has no memory limit
        assert memfit.server_budget(os.getpid(), {}) is None
    b = memfit.server_budget(os.getpid(), {"MEM_LIMIT": str(64 * GiB)})
    assert b is not None and b.limit == 64 * GiB and 0 < b.used < 64 * GiB
