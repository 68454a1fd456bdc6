"""Embedded-mode resources: exclusive GPU handout, core placement, cgroup v2 files, the memory watchdog."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import sys as _sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

_sys.path.insert(0, str(Path(__file__).parent / "doubles"))
from fake_nvml import FakeNvmlInventory
from hub_objects import FakeHub, FakeHubUser

from tests.test_kernel_oom_cgroup2 import cgroup2_root  # noqa: F401  (the real cgroup2 hierarchy)
from tfdist.procid import ProcessId, boot_id, start_time
from tfdist.spawner import local
from tfdist.spawner.allocator import CorePicker, GpuAllocator, GpuShortage, ModelAvailability
from tfdist.spawner.limits import (
    CgroupV2,
    cgroup2_mount,
    enforce_once,
    find_cgroup_parent,
    kill_recorded,
    own_cgroup_path,
    pick_victim,
    record_tree,
)
from tfdist.spawner.local import safe_dirname, saved_process
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
    # a %%tfdist task (expendable) goes before the larger kernel that holds the user's work
    assert pick_victim(tree, 10, 1000, expendable=[12]) == 12
    assert pick_victim(tree, 10, 1000, expendable=[10]) == 11  # the server itself is never "expendable"


def _oom_adj(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/oom_score_adj") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def _dies(p, timeout: float = 5.0) -> bool:
    """Gone or a zombie (its parent, not this test, reaps it) within `timeout`: killed, not only named."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_watchdog_ends_a_job_task_before_the_bigger_kernel() -> None:
    """A real tree: server -> kernel (400 MiB) -> task (150 MiB, oom_score_adj 800 as tasks set it)."""
    task = (
        "open('/proc/self/oom_score_adj','w').write('800'); b=bytearray(150*2**20); "
        "import time; time.sleep(60)"
    )
    kernel = (
        "import subprocess,sys,time; b=bytearray(400*2**20); "
        f"t=subprocess.Popen([sys.executable,'-c',{task!r}]); time.sleep(60)"
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess,sys,time; "
            f"k=subprocess.Popen([sys.executable,'-c',{kernel!r}]); time.sleep(60)",
        ],
    )
    import psutil

    try:
        deadline = time.monotonic() + 20
        procs: list[psutil.Process] = []
        while time.monotonic() < deadline:
            procs = psutil.Process(server.pid).children(recursive=True)
            # the task is a task once it runs its own code: right after the fork it is a copy of the
            # kernel (400 MiB, oom_score_adj 0), and a watchdog then rightly ends the kernel (CI on 6b2ec28)
            if (
                len(procs) == 2
                and all(p.memory_info().rss > 140 * 2**20 for p in procs)
                and all(_oom_adj(p.pid) for p in procs if p.ppid() != server.pid)
            ):
                break
            time.sleep(0.2)
        kernel_p = next(p for p in procs if p.ppid() == server.pid)
        task_p = next(p for p in procs if p.ppid() == kernel_p.pid)
        victim = enforce_once(server.pid, 400 * 2**20)
        assert victim == task_p.pid
        assert _dies(task_p), "the watchdog named the task but it lives on"
        time.sleep(0.5)
        assert kernel_p.is_running() and kernel_p.status() != psutil.STATUS_ZOMBIE
    finally:
        for child in psutil.Process(server.pid).children(recursive=True):
            child.kill()
        server.kill()
        server.wait()


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
        import psutil

        kernel_p = psutil.Process(server.pid).children()[0]
        victim = enforce_once(server.pid, 150 * 2**20)
        assert victim == kernel_p.pid
        assert _dies(kernel_p), "the watchdog named the kernel but it lives on"
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


# ---- the hub's own CUDA_VISIBLE_DEVICES ------------------------------------------------------------------


@pytest.mark.parametrize("visible", ["0,2", "GPU-fake-0000,GPU-fake-0002", "2,0"])
def test_only_gpus_the_hub_sees_are_handed_out(visible: str) -> None:
    inv = FakeNvmlInventory(["NVIDIA H100 80GB HBM3"] * 3)
    alloc = GpuAllocator(inv, environ={"CUDA_VISIBLE_DEVICES": visible})
    assert alloc.availability({"h100": H100})["h100"] == ModelAvailability(free=2, total=2)
    assert [g.index for g in alloc.reserve("alice/", "h100", H100, 2)] == [0, 2]  # NVML indices
    with pytest.raises(GpuShortage):
        alloc.reserve("bob/", "h100", H100, 1)


def test_hub_without_cuda_visible_devices_sees_all() -> None:
    inv = FakeNvmlInventory(["NVIDIA H100 80GB HBM3"] * 3)
    assert len(GpuAllocator(inv, environ={}).gpus()) == 3
    assert GpuAllocator(inv, environ={"CUDA_VISIBLE_DEVICES": ""}).gpus() == []


# ---- adopting servers after a hub restart ----------------------------------------------------------------


def test_gpu_adopt_conflict_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    alloc = GpuAllocator(FakeNvmlInventory(["NVIDIA H100 80GB HBM3"] * 2))
    alloc.reserve("bob/", "h100", H100, 1)
    with caplog.at_level(logging.WARNING, logger="tfdist.spawner.allocator"):
        assert alloc.adopt("carol/", [0, 1]) == [1]
    assert "carol/ held GPU 0" in caplog.text and "bob/ holds it now" in caplog.text
    assert alloc.held_by("carol/") == [1] and alloc.held_by("bob/") == [0]


def test_core_adopt_counts_cores_again() -> None:
    picker = CorePicker([0, 1, 2, 3])
    assert picker.adopt("a", [1, 2, 99]) == [1, 2]  # 99: not one of the hub's cores
    assert picker.pick("b", 2) == [0, 3]  # no double booking of 1 and 2
    picker.release("a")
    assert picker.pick("c", 2) == [1, 2]


@pytest.fixture
def fresh_hub_objects(monkeypatch: pytest.MonkeyPatch) -> Iterator[CorePicker]:
    """The per-hub allocator registry and core picker, empty for this test (as after a hub restart)."""
    cores = CorePicker([0, 1, 2, 3])
    monkeypatch.setattr(local, "_allocators", {})
    monkeypatch.setattr(local, "_cores", cores)
    monkeypatch.setattr(local, "_cgroup", None)
    yield cores


def _spawner(name: str = "alice", **kw: Any) -> local.TfdistLocalSpawner:
    kw.setdefault("gpu_inventory", FakeNvmlInventory(["NVIDIA H100 80GB HBM3"] * 3))
    kw.setdefault("cgroup_mode", "off")
    return local.TfdistLocalSpawner(user=FakeHubUser(name), hub=FakeHub(), **kw)


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _end(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


async def test_load_state_restores_watchdog_gpus_and_cores(fresh_hub_objects: CorePicker) -> None:
    server = _sleeper()
    sp = _spawner(memory_check_interval=0.05)
    try:
        state = {
            **saved_process(ProcessId.of(server.pid)),
            "tfdist_gpus": [1],
            "tfdist_cores": [2, 3],
            "tfdist_memory": 2**30,
        }
        sp.load_state(state)
        assert sp.tfdist_allocator().held_by("alice/") == [1]
        assert fresh_hub_objects.pick("bob/", 2) == [0, 1]  # 2 and 3 are booked again
        assert sp._tfdist_watchdog is not None and sp._tfdist_watchdog.is_running()
        assert sp._tfdist_cgroup_path is None
        assert {k: sp.get_state()[k] for k in state} == state  # survives the next restart too
        await asyncio.sleep(0.2)
        assert server.pid in (sp._tfdist_tree or {})  # the watchdog ticks
        server.kill()
        server.wait()
        assert await sp.poll() == 0
        assert sp._tfdist_watchdog is None
        assert sp.tfdist_allocator().held_by("alice/") == []
        assert fresh_hub_objects.pick("carol/", 2) == [2, 3]
    finally:
        sp.clear_state()
        _end(server)


async def test_load_state_restores_cgroup(fresh_hub_objects: CorePicker, tmp_path: Path) -> None:
    server = _sleeper()
    sp = _spawner(memory_check_interval=0.05)
    cgroup = tmp_path / CgroupV2.name_for("alice/")
    cgroup.mkdir()
    (cgroup / "cgroup.kill").write_text("0")
    try:
        sp.load_state(
            {**saved_process(ProcessId.of(server.pid)), "tfdist_gpus": [0], "tfdist_cgroup": str(cgroup)}
        )
        assert sp._tfdist_cgroup_path == cgroup
        assert sp._tfdist_watchdog is None  # the kernel enforces the limit
        assert sp.get_state()["tfdist_cgroup"] == str(cgroup)
        assert sp.tfdist_allocator().held_by("alice/") == [0]
        sp.clear_state()
        assert (cgroup / "cgroup.kill").read_text() == "1"  # release kills what runs in it
        assert sp.tfdist_allocator().held_by("alice/") == []
    finally:
        sp.clear_state()
        _end(server)


async def test_a_server_that_died_while_the_hub_was_down_leaves_nothing_in_its_cgroup(
    fresh_hub_objects: CorePicker,
    cgroup2_root: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    """The server died while the hub was down; a detached job of it (a session of its own) still runs in
    its cgroup, a real one. Its GPUs were left to the next spawn and nothing ended that job, which kept
    using them: now load_state kills it and removes its cgroup."""
    server = _sleeper()
    saved = {**saved_process(ProcessId.of(server.pid)), "tfdist_gpus": [0, 1]}
    _end(server)
    cgroup = cgroup2_root / CgroupV2.name_for("alice/")
    cgroup.mkdir()
    job = _sleeper()
    try:
        # in a cgroup of its own below the server's (a job may make one): killed and removed with it
        (cgroup / "job").mkdir()
        (cgroup / "job" / "cgroup.procs").write_text(str(job.pid))
        assert (cgroup / "job" / "cgroup.procs").read_text().split() == [str(job.pid)]
        sp = _spawner()
        sp.load_state({**saved, "tfdist_cgroup": str(cgroup)})
        assert sp.pid == 0 and sp.tfdist_allocator().held_by("alice/") == []
        # cgroup.kill is asynchronous: a moment, not the 120 s the sleeper would run
        assert job.wait(timeout=5) == -signal.SIGKILL, "what the dead server left runs on"
        deadline = time.monotonic() + 5
        while cgroup.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not cgroup.exists()
        sp.clear_state()
    finally:
        _end(job)
        if cgroup.exists():
            CgroupV2.remove_path(cgroup)


async def test_load_state_ignores_a_foreign_cgroup_path(
    fresh_hub_objects: CorePicker, tmp_path: Path
) -> None:
    server = _sleeper()
    sp = _spawner(memory_check_interval=0.05)
    other = tmp_path / CgroupV2.name_for("bob/")
    other.mkdir()
    (other / "cgroup.kill").write_text("0")
    try:
        sp.load_state(
            {**saved_process(ProcessId.of(server.pid)), "tfdist_cgroup": str(other), "tfdist_memory": 2**30}
        )
        assert sp._tfdist_cgroup_path is None
        assert sp._tfdist_watchdog is not None  # no cgroup: the fallback runs
        sp.clear_state()
        assert (other / "cgroup.kill").read_text() == "0"
    finally:
        sp.clear_state()
        _end(server)


def test_load_state_of_a_dead_server_takes_nothing(fresh_hub_objects: CorePicker) -> None:
    dead = _sleeper()
    _end(dead)
    sp = _spawner()
    sp.load_state({"pid": dead.pid, "tfdist_gpus": [0, 1], "tfdist_cores": [0], "tfdist_memory": 2**30})
    assert sp.tfdist_allocator().held_by("alice/") == []
    assert sp._tfdist_watchdog is None
    sp.clear_state()


async def test_a_saved_pid_that_names_another_process_is_neither_adopted_nor_signalled(
    fresh_hub_objects: CorePicker,
) -> None:
    """After a hub restart the saved server PID may belong to an unrelated process (the same Unix user's)."""
    bystander = _sleeper()
    sp = _spawner(memory_check_interval=0.05)
    try:
        started, boot = start_time(bystander.pid), boot_id()
        assert started is not None
        sp.load_state(
            {"pid": bystander.pid, "tfdist_gpus": [0], "tfdist_started": started - 50, "tfdist_boot": boot}
        )
        assert sp.pid == 0 and sp.tfdist_allocator().held_by("alice/") == []
        assert await sp.poll() is not None
        await sp.stop()
        # the same PID, adopted while it was the server, then reused: poll says gone, stop signals nothing
        sp2 = _spawner("bob", memory_check_interval=0)
        sp2.load_state(
            {"pid": bystander.pid, "tfdist_gpus": [1], "tfdist_started": started, "tfdist_boot": boot}
        )
        assert sp2.tfdist_allocator().held_by("bob/") == [1]
        # as if the server had died and its PID come back as another process
        sp2._tfdist_server_created = started - 50
        sp2._tfdist_tree = {bystander.pid: started - 50}
        assert await sp2.poll() == 0
        assert sp2.tfdist_allocator().held_by("bob/") == []
        await sp2.stop()
        time.sleep(0.3)
        assert bystander.poll() is None, "an unrelated process was killed"
    finally:
        _end(bystander)


# ---- what a dead server leaves behind (watchdog mode) ----------------------------------------------------

_SERVER = (
    "import subprocess, sys\n"
    "sys.stdin.readline()\n"
    "k = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
    "print(k.pid, flush=True)\n"
    "sys.stdin.readline()\n"
)


async def test_leftovers_of_a_dead_server_are_ended_before_its_gpus_go(fresh_hub_objects: CorePicker) -> None:
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert server.stdin is not None and server.stdout is not None
    sp = _spawner(memory_check_interval=0.05)
    kernel = 0
    try:
        sp.load_state(
            {**saved_process(ProcessId.of(server.pid)), "tfdist_gpus": [0, 2], "tfdist_memory": 2**30}
        )
        server.stdin.write(b"\n")
        server.stdin.flush()
        kernel = int(server.stdout.readline())  # started after adoption: only a watchdog tick sees it
        await asyncio.sleep(0.3)
        assert kernel in (sp._tfdist_tree or {})
        server.kill()  # the server dies by itself; its kernel (own session) lives on, re-parented
        server.wait()
        assert not _gone(kernel)

        alloc = sp.tfdist_allocator()
        seen_at_release = []
        real_release = alloc.release

        def release(owner: str) -> None:
            seen_at_release.append(_gone(kernel))
            real_release(owner)

        alloc.release = release  # type: ignore[method-assign]
        assert await sp.poll() == 0  # the hub's poll finds it dead
        assert seen_at_release == [True]  # ended before the GPUs were free again
        assert alloc.held_by("alice/") == []
    finally:
        sp.clear_state()
        if kernel and not _gone(kernel):
            os.kill(kernel, signal.SIGKILL)
        _end(server)


def test_kill_recorded_checks_start_time() -> None:
    proc = _sleeper()
    try:
        created = start_time(proc.pid)
        assert created is not None
        assert kill_recorded({proc.pid: created + 1.0}) == []  # the pid now names another process
        assert proc.poll() is None
        tree = record_tree(proc.pid, {}, created)
        assert tree == {proc.pid: created}
        assert record_tree(proc.pid, {}, created + 1.0) == {}
        assert kill_recorded(tree) == [proc.pid]
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert record_tree(proc.pid, dict(tree)) == {}  # gone: dropped from the record
    finally:
        _end(proc)


STOP_WITHOUT_PID = """
import asyncio, subprocess, sys
sys.path[:0] = [{doubles!r}]
from fake_nvml import FakeNvmlInventory
from hub_objects import FakeHub, FakeHubUser
from tfdist.spawner import local

async def main():
    sp = local.TfdistLocalSpawner(
        user=FakeHubUser("alice"), hub=FakeHub(), gpu_inventory=FakeNvmlInventory([]), cgroup_mode="off",
        interrupt_timeout=5, term_timeout=1, kill_timeout=1,
    )
    # adopted after a hub restart, pid cleared: nothing to signal (the base class: os.kill(0, sig))
    sp.proc, sp.pid = None, 0
    assert await sp._signal(15) is False
    # our own server whose pid was cleared while it still runs: the stop ends that server only
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sp.proc, sp.pid = server, 0
    await sp.stop()
    print("stopped", server.poll())

asyncio.run(main())
"""


def test_a_server_without_a_pid_never_signals_the_hubs_process_group(tmp_path: Path) -> None:
    """JupyterHub's LocalProcessSpawner signals os.kill(self.pid, sig): with a pid of 0 that is the hub's
    whole process group, i.e. whatever started the hub (two CI runs were ended by SIGTERM, then SIGKILL, in
    the middle of the culler test). The hub here runs in a session of its own, so a group signal shows as
    its own death."""
    code = STOP_WITHOUT_PID.format(doubles=str(Path(__file__).parent / "doubles"))
    hub = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, start_new_session=True
    )
    assert hub.returncode == 0, (hub.returncode, hub.stderr[-2000:])
    said = hub.stdout.split()
    assert said[0] == "stopped" and said[1] != "None", hub.stdout  # the server ended, the hub lived
