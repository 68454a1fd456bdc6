"""The cgroup v2 path of server limits against the real cgroup2 filesystem of this kernel.

`test_kernel_oom` OOM-kills a real kernel through a cgroup v1 memory limit, because this machine's memory
controller is bound to cgroup v1: a controller serves one hierarchy at a time, so the cgroup2 hierarchy here
(mounted by the host, or mounted by this module) has no memory controller, and `cgroup_no_v1` is a boot
option. What cgroup v2 gives without it is tested here for real: detection refuses a parent without the
memory controller with a sentence; a failed `create` leaves no directory behind; a server joined by
`join_fn` before exec takes its whole tree (new sessions included) into its cgroup; `remove_path` ends
that tree through `cgroup.kill` and removes the cgroup. What stays untested is listed in docs/testing.md.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tfdist.spawner.limits import CgroupV2, cgroup2_mount, find_cgroup_parent, own_cgroup_path

OWNER = f"oom-v2-test-{os.getpid()}/"


@pytest.fixture(scope="module")
def cgroup2_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This process's own cgroup in the real cgroup2 hierarchy (mounting one if the host has none)."""
    mount = cgroup2_mount(Path("/proc/self/mounts").read_text())
    mounted: Path | None = None
    if mount is None:
        mounted = tmp_path_factory.mktemp("cgroup2")
        if subprocess.run(["mount", "-t", "cgroup2", "none", str(mounted)], capture_output=True).returncode:
            pytest.skip("no cgroup2 hierarchy here, and this user may not mount one")
        mount = str(mounted)
    own = own_cgroup_path(Path("/proc/self/cgroup").read_text()) or "/"
    root = Path(mount) / own.lstrip("/")
    probe = root / f"tfdist-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        pytest.skip(f"cannot create a cgroup below {root} ({e.strerror})")
    try:
        yield root
    finally:
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], check=False)


def _memory_controller(root: Path) -> bool:
    return "memory" in (root / "cgroup.controllers").read_text().split()


def test_a_parent_without_the_memory_controller_is_refused_with_a_sentence(cgroup2_root: Path) -> None:
    if _memory_controller(cgroup2_root):
        pytest.skip("the memory controller is on cgroup v2 here, so there is no refusal to test")
    cg, why = find_cgroup_parent(str(cgroup2_root))
    assert cg is None
    assert why == f"the memory controller is not delegated to {cgroup2_root}"
    assert "memory" not in (cgroup2_root / "cgroup.subtree_control").read_text().split()  # changed nothing


def test_a_failed_create_leaves_no_cgroup_behind(cgroup2_root: Path) -> None:
    """Writing memory.max where the memory controller is off: the kernel refuses; nothing is left."""
    if _memory_controller(cgroup2_root):
        pytest.skip("memory.max is writable here")
    cg = CgroupV2(cgroup2_root)
    with pytest.raises(OSError):  # EACCES here: cgroupfs makes no file that its controllers do not
        cg.create(OWNER, 2**30, 1.0)
    assert not cg.path_for(OWNER).exists()


def _cgroup_of(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        return own_cgroup_path(Path(f"/proc/{pid}/cgroup").read_text())
    return None


def test_a_server_tree_joins_its_cgroup_and_ends_with_it(cgroup2_root: Path) -> None:
    """The server joins before exec; a child in a session of its own (as kernels run) is still inside,
    and removing the cgroup ends both (cgroup.kill), with no process left to reap by pid."""
    cg = CgroupV2(cgroup2_root)
    path = cg.path_for(OWNER)
    path.mkdir()
    server = None
    try:
        kernel = "import os,time; os.setsid(); time.sleep(120)"
        server = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import subprocess,sys,time; subprocess.Popen([sys.executable,'-c',{kernel!r}]); "
                "time.sleep(120)",
            ],
            preexec_fn=CgroupV2.join_fn(path),
        )
        deadline = time.monotonic() + 30
        children: list[psutil.Process] = []
        while time.monotonic() < deadline and not children:
            children = psutil.Process(server.pid).children()
            time.sleep(0.1)
        assert children, "the server never started its kernel"
        expected = (_cgroup_of(os.getpid()) or "/").rstrip("/") + "/" + path.name
        assert _cgroup_of(server.pid) == expected
        assert _cgroup_of(children[0].pid) == expected  # its own session, same cgroup
        assert sorted(int(p) for p in (path / "cgroup.procs").read_text().split()) == sorted(
            [server.pid, children[0].pid]
        )
        CgroupV2.remove_path(path)
        assert server.wait(timeout=10) == -9
        assert psutil.wait_procs(children, timeout=10)[1] == [], "the kernel outlived its server's cgroup"
        for _ in range(50):  # rmdir succeeds once the kernel has reaped the killed tasks
            if not path.exists():
                break
            CgroupV2.remove_path(path)
            time.sleep(0.1)
        assert not path.exists()
    finally:
        if server is not None and server.poll() is None:
            server.kill()
        with contextlib.suppress(OSError):
            (path / "cgroup.kill").write_text("1")
        with contextlib.suppress(OSError):
            path.rmdir()
