"""MIG as real NVML behaves (issue 27): no utilization on a GPU in MIG mode nor on its instances, memory per
instance; and what the product makes of it: the samplers say "not measurable" (None with a reason, never a 0
or the parent's), the monitor and the admin page show it so, and the GPU-idle culler never stops a server on
what nobody measured (a MIG instance, an NVML error, no samples).

NVML is the named double tests/doubles/fake_pynvml; its first tests hold it to nvidia-ml-py's own error
classes and to NVML's documented answers, so the product tests below run against what a GPU machine says.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.test_mig_local import A100, DOUBLES, MACHINE, MIG_A, MIG_B, MIG_C
from tfdist.gpus import visible_gpus
from tfdist.hubadmin.config import CullingConfig, CullingRule
from tfdist.hubadmin.culler import decide
from tfdist.hubadmin.report import parse_report
from tfdist.hubadmin.servers import ServerRecord
from tfdist.hubadmin.service import GpuAdminState
from tfdist.labserver.activity import GpuActivity
from tfdist.labserver.sampler import ServerSampler
from tfdist.nvml import Nvml
from tfdist.sampler import GpuReader, TaskProcess, TaskSampler


def load_double() -> Any:
    spec = importlib.util.spec_from_file_location("pynvml", DOUBLES / "fake_pynvml" / "pynvml.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def machine(**changes: Any) -> dict[str, Any]:
    """MACHINE with the instances' memory in use, a busy H100, and `changes` on top."""
    m = json.loads(json.dumps(MACHINE))
    m["gpus"][0]["mig"][0]["mem_used_mib"] = 1200.0
    m["gpus"][0]["mig"][1]["mem_used_mib"] = 300.0
    m["gpus"][0]["util"] = 55  # written, but a GPU in MIG mode cannot be read: never reported
    m["gpus"][2]["mem_used_mib"] = 5000.0
    m.update(changes)
    return m


@pytest.fixture
def nvml_file(tmp_path, monkeypatch) -> Path:
    """This process's `pynvml` is the double, reading `machine()` from a file the test may rewrite."""
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(machine()))
    monkeypatch.setenv("TFDIST_FAKE_NVML", str(path))
    monkeypatch.setitem(sys.modules, "pynvml", load_double())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return path


# ---- the double, held to NVML ------------------------------------------------------------------------------


def test_the_doubles_errors_are_nvidia_ml_pys() -> None:
    """Same class names, codes and texts as the real pynvml (nvidia-ml-py, installed with the project)."""
    import pynvml as real

    fake = load_double()
    names = [n for n in dir(fake) if n.startswith("NVMLError_")]
    assert len(names) >= 6
    for name in names:
        code = getattr(fake, name)().value
        assert getattr(real, name)().value == code, name
        assert str(fake.NVMLError(code)) == str(real.NVMLError(code)), name
        assert type(fake.NVMLError(code)).__name__ == name  # the code picks the subclass, as in pynvml
        assert getattr(fake, "NVML_ERROR_" + name.removeprefix("NVMLError_").upper(), code) == code
    assert fake.NVML_DEVICE_MIG_ENABLE == real.NVML_DEVICE_MIG_ENABLE


def test_the_double_answers_as_nvml_does_per_device_and_mig_mode(nvml_file: Path) -> None:
    nv = sys.modules["pynvml"]
    nv.nvmlInit()
    mig_gpu, mig_off, no_mig = (nv.nvmlDeviceGetHandleByIndex(i) for i in range(3))
    a = nv.nvmlDeviceGetMigDeviceHandleByIndex(mig_gpu, 0)
    # utilization: refused on a GPU in MIG mode and on each of its instances; read on the others
    for h in (mig_gpu, a):
        with pytest.raises(nv.NVMLError_NotSupported) as e:
            nv.nvmlDeviceGetUtilizationRates(h)
        assert e.value.value == nv.NVML_ERROR_NOT_SUPPORTED and str(e.value) == "Not Supported"
    assert nv.nvmlDeviceGetUtilizationRates(no_mig).gpu == 40
    assert nv.nvmlDeviceGetUtilizationRates(mig_off).gpu == 0
    # memory: each instance its own; the MIG-mode GPU the whole, with the instances' use summed
    assert (
        nv.nvmlDeviceGetMemoryInfo(a).used == 1200 * 2**20
        and nv.nvmlDeviceGetMemoryInfo(a).total == 9728 * 2**20
    )
    assert nv.nvmlDeviceGetMemoryInfo(mig_gpu).used == 1500 * 2**20
    # MIG mode and instances
    assert nv.nvmlDeviceGetMigMode(mig_gpu) == [1, 1] and nv.nvmlDeviceGetMigMode(mig_off) == [0, 0]
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigMode(no_mig)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetMigMode(a)
    with pytest.raises(nv.NVMLError_NotFound):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(mig_gpu, 2)  # the empty slot
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(mig_off, 0)
    assert nv.nvmlDeviceIsMigDeviceHandle(a) == 1 and nv.nvmlDeviceIsMigDeviceHandle(mig_gpu) == 0
    assert nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(a) == mig_gpu
    assert nv.nvmlDeviceGetName(a) == f"{A100} MIG 1g.10gb" and nv.nvmlDeviceGetUUID(a) == MIG_A
    assert nv.nvmlDeviceGetHandleByUUID(MIG_B) == nv.nvmlDeviceGetMigDeviceHandleByIndex(mig_gpu, 1)


def test_the_double_answers_per_driver_privilege_and_a_lost_gpu(nvml_file: Path, monkeypatch) -> None:
    nv = sys.modules["pynvml"]
    m = machine(driver="460.91.03", privileged=False)
    m["gpus"][2]["lost"] = True
    nvml_file.write_text(json.dumps(m))
    assert nv.nvmlSystemGetDriverVersion() == "460.91.03"
    with pytest.raises(nv.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByUUID(MIG_A)  # MIG UUIDs by handle only from R470 on
    with pytest.raises(nv.NVMLError_NoPermission):
        nv.nvmlDeviceGetMemoryInfo(0)  # the whole of a MIG-mode GPU: privileged callers only
    assert nv.nvmlDeviceGetMemoryInfo((0, 0)).used == 1200 * 2**20  # an instance's own: anyone
    for call in (nv.nvmlDeviceGetUtilizationRates, nv.nvmlDeviceGetMemoryInfo, nv.nvmlDeviceGetName):
        with pytest.raises(nv.NVMLError_GpuIsLost):
            call(2)
    monkeypatch.delenv("TFDIST_FAKE_NVML")
    with pytest.raises(nv.NVMLError_LibraryNotFound):
        nv.nvmlInit()


# ---- the samplers ------------------------------------------------------------------------------------------
# (the lab's samplers tick on tornado's loop: their tests are async, so each has a running loop of its own)


def test_a_mig_instance_reads_its_own_memory_and_no_utilization(nvml_file: Path) -> None:
    with Nvml() as n:
        a, b, c = n.mig_instances(0) or []
        got = n.read(a)
        assert (got.util, got.util_missing) == (None, "mig")
        assert (got.mem_used_mib, got.mem_total_mib) == (1200.0, 9728.0)  # its own, not the A100's
        assert n.read(b).mem_used_mib == 300.0 and n.read(c).mem_total_mib == 40192.0
        whole = n.read(2)
        assert (whole.util, whole.util_missing, whole.mem_used_mib) == (40.0, None, 5000.0)
        parent = n.read(0)  # the MIG-mode GPU by its index: its memory, and no utilization either
        assert (parent.util, parent.util_missing, parent.mem_used_mib) == (None, "mig", 1500.0)
        assert n.read(9).util_missing == "no-device"


def test_nvml_errors_are_said_not_zeroed(nvml_file: Path) -> None:
    m = machine(privileged=False)
    m["gpus"][2]["lost"] = True
    nvml_file.write_text(json.dumps(m))
    with Nvml() as n:
        lost = n.read(2)
        assert (lost.util, lost.util_missing, lost.mem_used_mib) == (None, "error", None)
        parent = n.read(0)  # unprivileged: no whole-GPU memory in MIG mode; still "mig", not an error
        assert (parent.util_missing, parent.mem_used_mib) == ("mig", None)
        # an unprivileged server still finds its instances (the parent's memory is not needed for that)
        [a, b, _] = n.mig_instances(0) or []
        assert (a.uuid, n.read(a).mem_used_mib, b.name) == (MIG_A, 1200.0, A100)


def test_task_sampler_reads_a_task_given_mig_instances_by_uuid(nvml_file: Path) -> None:
    s = TaskSampler(gpus=GpuReader())
    s.track(TaskProcess("worker-0", 1, [MIG_A, MIG_B]))
    s.track(TaskProcess("worker-1", 1, ["2", "MIG-not-on-this-machine"]))
    tasks = s.sample()["tasks"]
    a, b = tasks["worker-0"]["gpus"]
    assert a == {
        "index": 0,
        "uuid": MIG_A,
        "mig_profile": "1g.10gb",
        "util (%)": None,
        "util_missing": "mig",
        "mem_used (MiB)": 1200.0,
        "mem_total (MiB)": 9728.0,
    }
    assert (b["uuid"], b["mem_used (MiB)"]) == (MIG_B, 300.0)
    [whole] = tasks["worker-1"]["gpus"]
    assert (whole["index"], whole["util (%)"], "util_missing" in whole) == (2, 40.0, False)


async def test_the_lab_sampler_shows_each_instance_not_the_parent_three_times(
    nvml_file: Path, monkeypatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{MIG_A},{MIG_B},2")
    s = ServerSampler()
    snap = s.snapshot()
    s.stop()
    assert snap["gpu_count"] == 3
    assert [g["name"] for g in snap["gpus"]] == [f"{A100} MIG 1g.10gb"] * 2 + ["NVIDIA H100 80GB HBM3"]
    last = snap["samples"][-1]["gpus"]
    assert [(g.get("uuid"), g["util (%)"], g.get("util_missing")) for g in last] == [
        (MIG_A, None, "mig"),
        (MIG_B, None, "mig"),
        (None, 40.0, None),
    ]
    assert [g["mem_used (MiB)"] for g in last] == [1200.0, 300.0, 5000.0]


async def test_the_activity_tracker_samples_mig_memory_and_leaves_utilization_unknown(
    nvml_file: Path, monkeypatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{MIG_A},{MIG_C}")
    a = GpuActivity(interval_s=60)
    rep = a.report(10.0, after=0)
    a.stop()
    assert [g["uuid"] for g in rep["gpus"]] == [MIG_A, MIG_C]
    [sample] = rep["samples"]
    assert sample["util"] == [None, None] and sample["mem"] == [1200.0, 0.0]
    assert visible_gpus()[0].mig_profile == "1g.10gb"


# ---- the culler ------------------------------------------------------------------------------------------

RULE = CullingRule(idle_below_percent=10, idle_minutes=2, warn_minutes=0.5)  # warned at 90 s idle


def test_decide_never_culls_what_is_not_measured() -> None:
    now = 1e9
    facts = {"gpus": [1], "idle_s": 7200.0, "jobs_running": []}
    assert decide(RULE, facts, None, now).action == "warn"
    assert decide(RULE, facts, now - 1, now).action == "cull"
    for missing in (["MIG instance"], ["no recent GPU sample"]):
        assert decide(RULE, {**facts, "unmeasured": missing}, now - 1, now).action == "unmeasured"


def mig_report(t: float, utils: list[float | None], idle_s: float, uuids: list[str]) -> bytes:
    return json.dumps(
        {
            "busy_percent": 10,
            "idle_s": idle_s,
            "gpus": [{"index": i, "name": A100, "uuid": u} for i, u in enumerate(uuids)],
            "samples": [{"t": t, "util": utils, "mem": [1.0] * len(utils)}],
        }
    ).encode()


async def service_with(rec: ServerRecord) -> GpuAdminState:
    culling = CullingConfig.model_validate({"check_interval_s": 1e-6, "default": RULE.model_dump()})
    state = GpuAdminState(api_url="http://127.0.0.1:9/hub/api", api_token="x", culling=culling)
    state.servers[rec.key] = rec
    return state


def record(user: str) -> ServerRecord:
    return ServerRecord(user=user, name="", profile="gpu", gpu_model="mig1g", url=f"/user/{user}/")


async def test_a_mig_server_idle_for_hours_by_its_own_count_is_not_warned_nor_culled() -> None:
    """Its utilization is None in every sample (NVML cannot measure a MIG instance): the server's tracker
    counts that as idle (nothing at or above the threshold), the culler must not."""
    rec = record("miguser")
    state = await service_with(rec)
    now = time.time()
    for k in range(3):
        rep = parse_report(mig_report(now - 20 + 10 * k, [None, None], 7200.0 + 10 * k, [MIG_A, MIG_B]), now)
        reply = await state.accept(rec, rep)
        assert reply.notice is None
        assert rec.decision is not None and rec.decision.action == "unmeasured"
    assert (state.warned_total, state.culled_total, rec.warned_cull_at) == (0, 0, None)
    [row] = state.view()["servers"]
    assert row["util_text"] == ["n/a (MIG)", "n/a (MIG)"] and row["util"] == [None, None]
    assert row["reason"].startswith("GPU utilization not measured (")
    assert "not measurable on a MIG instance" in row["reason"] and row["reason"].endswith("not culled")
    assert row["gpus"][0]["label"] == f"{A100} MIG instance"


async def test_time_without_a_measurement_never_counts_as_idle() -> None:
    """A whole GPU whose NVML read failed for an hour, then reads 0 %: idle only since it was measured."""
    rec = record("flaky")
    state = await service_with(rec)
    now = time.time()
    gpu = ["GPU-22222222-2222-2222-2222-222222222222"]
    rep = parse_report(mig_report(now - 30, [None], 3600.0, gpu), now)
    await state.accept(rec, rep)
    assert rec.decision is not None and rec.decision.action == "unmeasured"
    assert "utilization not read" in state.view()["servers"][0]["reason"]
    rep = parse_report(mig_report(now - 5, [0.0], 3630.0, gpu), now)
    await state.accept(rec, rep)
    assert rec.decision is not None and rec.decision.action == "active", rec.decision  # ~30 s, not an hour
    assert 25 <= (rec.decision.idle_s or 0) <= 40 and state.warned_total == 0


async def test_a_warning_is_withdrawn_when_utilization_can_no_longer_be_measured() -> None:
    rec = record("idler")
    state = await service_with(rec)
    now = time.time()
    gpu = ["GPU-22222222-2222-2222-2222-222222222222"]
    reply = await state.accept(rec, parse_report(mig_report(now - 1, [0.0], 600.0, gpu), now))
    assert reply.notice is not None and rec.warned_cull_at is not None  # measured idle: warned
    reply = await state.accept(rec, parse_report(mig_report(now, [None], 601.0, gpu), now))
    assert reply.notice is None and rec.warned_cull_at is None and state.culled_total == 0


async def test_a_server_without_recent_samples_is_not_culled() -> None:
    rec = record("silent")
    state = await service_with(rec)
    now = time.time()
    gpu = ["GPU-22222222-2222-2222-2222-222222222222"]
    rep = parse_report(mig_report(now - 4 * 3600, [0.0], 4 * 3600.0, gpu), now)  # its tracker stopped
    await state.accept(rec, rep)
    assert rec.decision is not None and rec.decision.action == "unmeasured"
    assert state.view()["servers"][0]["reason"] == (
        "GPU utilization not measured (no recent GPU sample); not culled"
    )
