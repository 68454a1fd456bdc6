"""Embedded-mode resources: exclusive GPU handout, core placement, cgroup v2 files, the memory watchdog."""

from __future__ import annotations

import subprocess
import sys
import sys as _sys
import time
from pathlib import Path

import pytest

_sys.path.insert(0, str(Path(__file__).parent / "doubles"))
from fake_nvml import FakeNvmlInventory

from tfdist.spawner.allocator import CorePicker, GpuAllocator, GpuShortage
from tfdist.spawner.limits import (
    CgroupV2,
    cgroup2_mount,
    enforce_once,
    find_cgroup_parent,
    own_cgroup_path,
    pick_victim,
)
from tfdist.spawner.local import safe_dirname
from tfdist.spawner.profiles import GpuModel

H100 = GpuModel(display_name="H100", nvml_name="NVIDIA H100.*")
A100 = GpuModel(display_name="A100", nvml_name="NVIDIA A100.*")


def test_gpus_are_handed_out_once() -> None:
    inv = FakeNvmlInventory(["NVIDIA H100 80GB HBM3"] * 3 + ["NVIDIA A100-SXM4-40GB"])
    alloc = GpuAllocator(inv)
    assert [g.index for g in alloc.reserve("alice/", "h100", H100, 2)] == [0, 1]
    with pytest.raises(GpuShortage) as e:
        alloc.reserve("bob/", "h100", H100, 2)
    assert e.value.free == 1
    assert [g.index for g in alloc.reserve("bob/", "a100", A100, 1)] == [3]
    av = alloc.availability({"h100": H100, "a100": A100})
    assert (av["h100"].free, av["h100"].total, av["a100"].free) == (1, 3, 0)
    alloc.release("alice/")
    assert alloc.availability({"h100": H100})["h100"].free == 3
    assert alloc.adopt("carol/", [3]) == []  # bob still holds it
    assert inv.calls == 1  # NVML is read once, not per form render


def test_cores_least_used_first() -> None:
    picker = CorePicker([0, 1, 2, 3])
    assert picker.pick("a", 2) == [0, 1]
    assert picker.pick("b", 1.5) == [2, 3]
    assert picker.pick("c", 0.5) == [0]
    picker.release("a")
    assert picker.pick("d", 3) == [0, 1, 2]  # core 1 is free now; the rest are used once each


def test_cgroup_detection_text() -> None:
    assert cgroup2_mount("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n") == "/sys/fs/cgroup"
    assert cgroup2_mount("cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n") is None
    assert own_cgroup_path("4:memory:/x\n0::/system.slice/hub.service\n") == "/system.slice/hub.service"
    cg, why = find_cgroup_parent(None, mounts_text="cgroup /sys/fs/cgroup/memory cgroup rw 0 0\n")
    assert cg is None and "cgroup v1" in why


def test_cgroup_v2_files(tmp_path: Path) -> None:
    """A delegated cgroup v2 directory, mimicked by plain files: the limits the kernel would enforce."""
    parent = tmp_path / "hub.service"
    parent.mkdir()
    (parent / "cgroup.controllers").write_text("cpu memory pids\n")
    (parent / "cgroup.subtree_control").write_text("cpu memory\n")
    cg, why = find_cgroup_parent(str(parent))
    assert cg is not None and cg.cpu, why
    path = cg.path_for("alice/gpu box")
    path.mkdir()
    for f in ("memory.max", "memory.swap.max", "cpu.max", "cgroup.procs"):
        (path / f).write_text("max\n")
    created = cg.create("alice/gpu box", 3 * 2**30, 1.5)
    assert created.name.startswith("tfdist-alice_gpu_box-")
    assert cg.path_for("a+b/") != cg.path_for("a_b/")  # one cgroup per server, whatever the names
    assert (created / "memory.max").read_text() == str(3 * 2**30)
    assert (created / "memory.swap.max").read_text() == "0"
    assert (created / "cpu.max").read_text() == "150000 100000"
    CgroupV2.join_fn(created)()
    assert (created / "cgroup.procs").read_text().startswith("0")


def test_watchdog_policy() -> None:
    tree = [(10, 100), (11, 900), (12, 50)]
    assert pick_victim(tree, 10, 2000) is None
    assert pick_victim(tree, 10, 1000) == 11  # the big kernel, not the server
    assert pick_victim([(10, 5000)], 10, 1000) == 10


def test_watchdog_kills_a_real_hog() -> None:
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess,sys,time; k=subprocess.Popen([sys.executable,'-c',"
            "'b=bytearray(300*2**20); import time; time.sleep(60)']); time.sleep(60)",
        ],
    )
    try:
        time.sleep(2.5)
        victim = enforce_once(server.pid, 150 * 2**20)
        assert victim is not None and victim != server.pid
        assert server.poll() is None  # the server survives; its kernel was ended
    finally:
        import psutil

        for child in psutil.Process(server.pid).children(recursive=True):
            child.kill()
        server.kill()
        server.wait()


@pytest.mark.parametrize(
    ("name", "expect"),
    [
        ("alice", "alice"),
        ("../x", "..-2f-x"),
        ("..", "-.."),
        ("A b", "-41--20-b"),
        ("a+", "a-2b-"),
        ("a-2b-", "a-2d-2b-2d-"),
    ],
)
def test_safe_dirname(name: str, expect: str) -> None:
    assert safe_dirname(name) == expect
