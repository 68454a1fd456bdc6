"""MIG on the embedded hub (issue 13): a GPU in MIG mode is handed out as its MIG instances, each by UUID in
CUDA_VISIBLE_DEVICES and each exclusive like a whole GPU; a GPU model whose resource names a MIG profile
(``nvidia.com/mig-1g.10gb``) is served by instances of that profile, and the form shows them free per
profile. NVML is the named double tests/doubles/fake_pynvml (this machine has no GPU); everything above
the NVML calls (tfdist.nvml, tfdist.gpus, the allocator, the spawner, the hub) is the production code.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hub_fixtures import RunningHub, start_hub
from tests.test_hub_local import GROUPS, _env_of, _free_text, as_json
from tfdist.gpus import NvmlInventory, visible_gpus
from tfdist.nvml import Nvml
from tfdist.procid import ProcessId
from tfdist.spawner import local
from tfdist.spawner.allocator import CorePicker, GpuAllocator, GpuShortage, device_key
from tfdist.spawner.local import saved_process
from tfdist.spawner.mig import mig_profile, profile_for
from tfdist.spawner.profiles import GpuModel

DOUBLES = Path(__file__).resolve().parent / "doubles"
A100 = "NVIDIA A100-SXM4-80GB"
MIG_A = "MIG-5a7c1a3e-0b1f-5e63-9d6a-0a1b2c3d4e5f"
MIG_B = "MIG-6b8d2b4f-1c2a-5f74-8e7b-1b2c3d4e5f60"
MIG_C = "MIG-7c9e3c50-2d3b-5085-9f8c-2c3d4e5f6071"
# GPU 0: A100 in MIG mode, two 1g.10gb, an empty slot, one 3g.40gb whose name lacks its profile (old
# drivers: found from its slices and memory); GPU 1: A100 with MIG off; GPU 2: H100 without MIG support
MACHINE = {
    "gpus": [
        {
            "name": A100,
            "uuid": "GPU-00000000-0000-0000-0000-000000000000",
            "mig": [
                {"profile": "1g.10gb", "uuid": MIG_A, "memory_total_mib": 9728},
                {"profile": "1g.10gb", "uuid": MIG_B, "memory_total_mib": 9728},
                None,
                {"profile": "3g.40gb", "uuid": MIG_C, "memory_total_mib": 40192, "name_has_profile": False},
            ],
        },
        {"name": A100, "uuid": "GPU-11111111-1111-1111-1111-111111111111", "mig_mode": 0},
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-22222222-2222-2222-2222-222222222222", "util": 40},
    ]
}
WHOLE_A100 = GpuModel(display_name="A100", nvml_name="NVIDIA A100.*")
MIG_1G = GpuModel(
    display_name="A100 MIG 1g.10gb", resource="nvidia.com/mig-1g.10gb", nvml_name="NVIDIA A100.*"
)
MIG_3G = GpuModel(
    display_name="A100 MIG 3g.40gb", resource="nvidia.com/mig-3g.40gb", nvml_name="NVIDIA A100.*"
)
H100 = GpuModel(display_name="H100", nvml_name="NVIDIA H100.*")
MODELS = {"a100": WHOLE_A100, "mig1g": MIG_1G, "mig3g": MIG_3G, "h100": H100}


@pytest.fixture
def fake_nvml(tmp_path, monkeypatch) -> Path:
    """This process's `pynvml` is the double, reading MACHINE from a file."""
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(MACHINE))
    monkeypatch.setenv("TFDIST_FAKE_NVML", str(path))
    spec = importlib.util.spec_from_file_location("pynvml", DOUBLES / "fake_pynvml" / "pynvml.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return path


def test_nvml_lists_a_mig_gpu_as_its_instances(fake_nvml) -> None:
    with Nvml() as n:
        devices = n.devices()
        assert n.mig_instances(1) is None and n.mig_instances(2) is None  # MIG off / not supported
        assert n.usage(2)["util (%)"] == 40.0  # whole GPUs are sampled as before
    assert [(d.index, d.uuid, d.mig_profile, d.cuda_id) for d in devices] == [
        (0, MIG_A, "1g.10gb", MIG_A),
        (0, MIG_B, "1g.10gb", MIG_B),
        (0, MIG_C, "3g.40gb", MIG_C),  # from its attributes: 3 slices, 39.25 GiB
        (1, MACHINE["gpus"][1]["uuid"], "", "1"),
        (2, MACHINE["gpus"][2]["uuid"], "", "2"),
    ]
    assert {d.name for d in devices[:3]} == {A100}  # the parent's model: nvml_name regexes still match
    assert devices[0].memory_total_mib == 9728
    assert NvmlInventory().gpus() == devices


def test_profiles_from_names_and_resources() -> None:
    assert mig_profile("nvidia.com/mig-1g.10gb") == "1g.10gb" and mig_profile("nvidia.com/gpu") == ""
    assert profile_for(1, 9.5) == "1g.10gb" and profile_for(7, 79.0) == "7g.80gb"
    assert profile_for(3, 70.5) == "3g.71gb" and profile_for(5, 10) == ""


def test_visible_devices_name_mig_instances_by_uuid(fake_nvml, monkeypatch) -> None:
    def seen(value: str) -> list[str]:
        return [g.cuda_id for g in visible_gpus(environ={"CUDA_VISIBLE_DEVICES": value})]

    assert seen(MIG_B) == [MIG_B]
    assert seen(f"1,{MIG_C}") == ["1", MIG_C]
    assert seen("0") == [MIG_A, MIG_B, MIG_C]  # an index of a MIG-mode GPU: all its instances
    assert seen("MIG-not-here,7") == []
    # the kernel gives each worker its devices by these names (the magic's list for the supervisor)
    from tfdist.kernel_magics.cellcheck import _gpu_ids

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{MIG_A},{MIG_B}")
    assert _gpu_ids() == [MIG_A, MIG_B]


def test_mig_instances_are_handed_out_exclusively_per_instance(fake_nvml, caplog) -> None:
    alloc = GpuAllocator(NvmlInventory(), environ={})
    av = alloc.availability(MODELS)
    # GPU 0 is never a whole A100 (CUDA cannot use a MIG-mode GPU whole); its instances count per profile
    assert {k: (a.free, a.total) for k, a in av.items()} == {
        "a100": (1, 1),
        "mig1g": (2, 2),
        "mig3g": (1, 1),
        "h100": (1, 1),
    }
    taken = alloc.reserve("alice/", "mig1g", MIG_1G, 2)
    assert [device_key(g) for g in taken] == [MIG_A, MIG_B]
    with pytest.raises(GpuShortage) as e:
        alloc.reserve("bob/", "mig1g", MIG_1G, 1)
    assert (e.value.asked, e.value.free) == (1, 0)
    assert [device_key(g) for g in alloc.reserve("bob/", "mig3g", MIG_3G, 1)] == [MIG_C]
    assert [device_key(g) for g in alloc.reserve("bob/", "a100", WHOLE_A100, 1)] == [1]
    assert alloc.held_by("bob/") == [1, MIG_C]  # indices first, then UUIDs
    av = alloc.availability(MODELS)
    assert {k: a.free for k, a in av.items()} == {"a100": 0, "mig1g": 0, "mig3g": 0, "h100": 1}
    # after a hub restart an instance another server holds is not taken twice
    with caplog.at_level(logging.WARNING, logger="tfdist.spawner.allocator"):
        assert alloc.adopt("carol/", [MIG_A]) == []
    assert "carol/ held GPU " + MIG_A in caplog.text
    alloc.release("alice/")
    assert alloc.availability(MODELS)["mig1g"].free == 2
    assert alloc.adopt("carol/", [MIG_A]) == [MIG_A]
    assert alloc.availability(MODELS)["mig1g"].free == 1


def test_the_hubs_cuda_visible_devices_narrows_mig_instances_too(fake_nvml) -> None:
    alloc = GpuAllocator(NvmlInventory(), environ={"CUDA_VISIBLE_DEVICES": f"{MIG_B},2"})
    av = alloc.availability(MODELS)
    assert {k: (a.free, a.total) for k, a in av.items()} == {
        "a100": (0, 0),
        "mig1g": (1, 1),
        "mig3g": (0, 0),
        "h100": (1, 1),
    }


@pytest.fixture
def fresh_hub_objects(monkeypatch) -> None:
    monkeypatch.setattr(local, "_allocators", {})
    monkeypatch.setattr(local, "_cores", CorePicker([0, 1]))
    monkeypatch.setattr(local, "_cgroup", None)


def test_a_server_gets_its_instances_by_uuid_and_keeps_them_across_a_hub_restart(
    fake_nvml, fresh_hub_objects
) -> None:
    sys.path.insert(0, str(DOUBLES))
    from hub_objects import FakeHub, FakeHubUser

    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    sp = local.TfdistLocalSpawner(user=FakeHubUser("alice"), hub=FakeHub(), cgroup_mode="off")
    try:
        bad: list[Any] = [f"{MIG_A},0", "MIG-../../x", True, -1, 1.0, "0", {"x": 1}]
        sp.load_state(
            {
                **saved_process(ProcessId.of(server.pid)),
                "tfdist_gpus": [MIG_B, 2, *bad],
                "tfdist_memory": 2**30,
            }
        )
        assert sp.tfdist_allocator().held_by("alice/") == [2, MIG_B]
        env = sp.get_env()
        assert env["CUDA_VISIBLE_DEVICES"] == f"{MIG_B},2" and env["TFDIST_GPUS"] == "2"
        assert sp.get_state()["tfdist_gpus"] == [MIG_B, 2]  # survives the next restart as well
        free = sp.tfdist_allocator().availability(MODELS)
        assert (free["mig1g"].free, free["h100"].free) == (1, 0)
    finally:
        server.kill()
        server.wait()
        sp.clear_state()
    assert sp.tfdist_allocator().held_by("alice/") == []


# ------------------------------------------------------------------------------- the hub, end to end
PROFILES = r"""
gpu_models:
  a100:
    display_name: "NVIDIA A100 80GB"
    nvml_name: "NVIDIA A100.*"
  mig1g:
    display_name: "A100 slice 1g.10gb"
    resource: nvidia.com/mig-1g.10gb
    nvml_name: "NVIDIA A100.*"
  mig3g:
    display_name: "A100 slice 3g.40gb"
    resource: nvidia.com/mig-3g.40gb
    nvml_name: "NVIDIA A100.*"
profiles:
  - slug: gpu
    display_name: "GPU"
    groups: [gpu-users]
    cpu: {min: 1, max: 4, default: 1}
    memory_gib: {min: 1, max: 8, default: 1}
    gpus: {min: 0, max: 2, default: 1}
    gpu_models: [mig1g, mig3g, a100]
    images: [local]
"""
SLICE = {"profile": "gpu", "cpu": "1", "memory": "1", "gpus": "2", "gpu_model": "mig1g", "image": "local"}


CULLING = """
gpu_admin:
  culling:
    check_interval_s: 1
    default: {idle_below_percent: 10, idle_minutes: 0.2, warn_minutes: 0.1}
"""


@pytest.fixture(scope="module")
def mig_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    """One hub for the module's hub tests (a start is seconds, tens under load): MACHINE's NVML, the
    GPU admin service and the culler's rule, first instance's memory in use."""
    from tests.test_hub_gpu_culler import ADMIN_PASSWORD

    tmp = tmp_path_factory.mktemp("mighub")
    machine = json.loads(json.dumps(MACHINE))
    machine["gpus"][0]["mig"][0]["mem_used_mib"] = 700.0
    nvml = tmp / "nvml.json"
    nvml.write_text(json.dumps(machine))
    path = os.pathsep.join(p for p in (str(DOUBLES / "fake_pynvml"), os.environ.get("PYTHONPATH")) if p)
    extra = f"""
import os
sys.path.insert(0, {str(DOUBLES / "fake_pynvml")!r})
os.environ['TFDIST_FAKE_NVML'] = {str(nvml)!r}
from tests.hub_fixtures import free_port as _fp
from tfdist.hubadmin.hubconfig import enable_gpu_admin
c.Spawner.environment = {{"PYTHONPATH": {path!r}, "TFDIST_FAKE_NVML": {str(nvml)!r},
                          "TFDIST_GPU_ACTIVITY_INTERVAL": "0.5"}}
enable_gpu_admin(c, profiles=c.TfdistLocalSpawner.profiles_file,
                 public_url=f"http://127.0.0.1:{{c.JupyterHub.port}}", port=_fp(), period_s=1,
                 local_gpus=True)
c.JupyterHub.services[-1]["environment"].update(c.Spawner.environment)
c.JupyterHub.load_roles[0]["scopes"].append("access:services")
c.SharedPasswordAuthenticator.admin_password = {ADMIN_PASSWORD!r}
c.Authenticator.admin_users = {{"boss"}}
"""
    repo = str(Path(__file__).resolve().parent.parent)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, old) if p)
    h = start_hub(tmp / "hub", profiles_yaml=PROFILES + CULLING, groups=GROUPS, extra=extra)
    try:
        yield h
    finally:
        h.stop()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def test_the_hub_form_shows_free_instances_per_profile_and_hands_them_out(mig_hub: RunningHub) -> None:
    h = mig_hub
    free = _free_text(h.spawn_form("alice").text)
    for text in (
        "A100 slice 1g.10gb: 2 of 2 free",
        "A100 slice 3g.40gb: 1 of 1 free",
        "NVIDIA A100 80GB: 1 of 1 free",
    ):
        assert text in free, free
    ok = h.api("POST", "/users/alice/server", json={"user_options": as_json(SLICE)})
    assert ok.status_code in (201, 202), ok.text
    h.wait_ready("alice")
    env = _env_of(h.server_pid("alice"))
    assert env["CUDA_VISIBLE_DEVICES"] == f"{MIG_A},{MIG_B}" and env["TFDIST_GPUS"] == "2"
    r = h.api("POST", "/users/bob/server", json={"user_options": as_json({**SLICE, "gpus": "1"})})
    assert r.status_code == 400 and "only 0 free" in r.json()["message"], r.text
    assert "A100 slice 1g.10gb: 0 of 2 free" in _free_text(h.spawn_form("bob").text)
    h.stop_server("alice")
    assert "A100 slice 1g.10gb: 2 of 2 free" in _free_text(h.spawn_form("bob").text)


# ------------------------------------------------------------------ MIG and the GPU-idle culler, end to end
def test_a_mig_server_shows_unmeasured_utilization_and_is_never_culled_for_it(mig_hub: RunningHub) -> None:
    """NVML cannot measure a MIG instance's utilization: the server reports its instances' memory and no
    utilization, the admin page says "n/a (MIG)" and why the culler leaves it alone, and it is still up
    well past the idle limit; a whole GPU's idle server on the same rule is stopped meanwhile."""
    from tests.test_hub_gpu_culler import admin_session, page_rows, server_get

    h = mig_hub
    for user, options in (("alice", SLICE), ("bob", {**SLICE, "gpus": "1", "gpu_model": "a100"})):
        ok = h.api("POST", f"/users/{user}/server", json={"user_options": as_json(options)})
        assert ok.status_code in (201, 202), ok.text
        h.wait_ready(user)
    started = time.monotonic()
    gpus = server_get(h, "alice", "gpus")
    assert [g["name"] for g in gpus["gpus"]] == [f"{A100} MIG 1g.10gb"] * 2
    last = gpus["samples"][-1]["gpus"]
    assert [(g["util (%)"], g["util_missing"], g["mem_used (MiB)"]) for g in last] == [
        (None, "mig", 700.0),
        (None, "mig", 0.0),
    ]
    admin = admin_session(h)
    row: dict[str, Any] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and row.get("action") != "unmeasured":
        row = page_rows(admin, h).get("alice/") or {}
        time.sleep(0.5)
    assert row.get("action") == "unmeasured", (row, h.log_tail())
    assert row["util_text"] == ["n/a (MIG)", "n/a (MIG)"] and row["util"] == [None, None]
    assert "not measurable on a MIG instance" in row["reason"] and row["reason"].endswith("not culled")
    assert [g["label"] for g in row["gpus"]] == [f"{A100} MIG instance"] * 2
    # bob's whole A100 at 0 %: warned and stopped on the same rule; alice is left alone all along
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and "" in h.servers("bob"):
        time.sleep(0.5)
    assert "" not in h.servers("bob"), h.log_tail()
    # alice was up before bob on the same rule: had her instances counted as idle, she would have gone
    # first; past bob's cull, the idle limit and the warning, and some of the service's checks
    while time.monotonic() - started < 27:  # the idle limit is 12 s
        time.sleep(1)
    assert h.servers("alice")[""]["ready"]
    assert server_get(h, "alice", "notice")["notice"] is None
    assert page_rows(admin, h)["alice/"]["action"] == "unmeasured"
