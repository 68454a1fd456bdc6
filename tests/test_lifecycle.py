"""Nothing outlives its owner: interrupt, kernel death, worker loss, coordinator errors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import psutil
import pytest

from tests.kernels import Kernel, job_processes, kernel_env, wait_gone
from tfdist.backends.local import LocalBackend
from tfdist.errors import NoSuchJob

pytestmark = pytest.mark.slow

LONG_FIT = "%%tfdist run --name {name}\nhistory = model.fit(train_ds, epochs=400, steps_per_epoch=40)\n"


def wait_for_epoch(state_dir: str, name: str, epoch: int, timeout: float = 120):
    """Watch the job through the same backend API the lab panel uses, until it reaches `epoch`."""
    backend = LocalBackend(state_dir)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            view = asyncio.run(backend.status(name))
            if view.epoch >= epoch:
                return view
            assert not view.finished, f"job ended early: {view.state} {view.message}"
        except NoSuchJob:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"job {name} did not reach epoch {epoch}")


def job_pids(state_dir: str, name: str) -> list[int]:
    with open(os.path.join(state_dir, name, "supervisor.pid")) as f:
        sup = psutil.Process(json.load(f)["pid"])
    return [sup.pid] + [c.pid for c in sup.children(recursive=True)]


def task_pids(state_dir: str, name: str) -> dict[str, int]:
    """Each task's PID as the job records it. Not from /proc/PID/environ: that is the environment a
    process was exec'd with, and a forked task (runtime.forkserver) was exec'd as its fork server."""
    with open(os.path.join(state_dir, name, "state.json")) as f:
        return {t: int(v["pid"]) for t, v in json.load(f)["tasks"].items() if v.get("pid")}


def listening_ports(pid: int) -> set[int]:
    """TCP ports listening in `pid`'s network namespace (/proc/PID/net is that namespace's view)."""
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def assert_unreachable_from_host(pids: list[int], servers: int) -> None:
    """TF's servers bind *:port whatever TF_CONFIG says; in the job's own network namespace that is only
    the namespace's loopback. From this (the host's) namespace, every port the job listens on must refuse."""
    for pid in pids:
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    ports = listening_ports(pids[-1])
    assert len(ports) >= servers, ports
    for port in ports:
        with socket.socket() as s:
            s.settimeout(1)
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"TF port {port} is reachable from the host"


def test_interrupt_mid_fit_ends_every_process(tf_kernel):
    th, box = tf_kernel.execute_in_background(LONG_FIT.format(name="interrupted"), timeout=300)
    wait_for_epoch(tf_kernel.state_dir, "interrupted", 1)
    pids = job_pids(tf_kernel.state_dir, "interrupted")
    assert len(pids) >= 5  # supervisor + chief + 2 workers + ps
    assert_unreachable_from_host(pids, servers=3)  # ps-0, worker-0, worker-1 (and the chief's)
    t0 = time.time()
    tf_kernel.km.interrupt_kernel()
    assert wait_gone(pids, 10) == [], "job processes still alive 10 s after the interrupt"
    elapsed = time.time() - t0
    th.join(60)
    assert box and box[0].error and box[0].error["ename"] == "KeyboardInterrupt"
    assert box[0].error["evalue"] == "tfdist job interrupted interrupted; all its processes were ended"
    assert "Traceback" not in box[0].error_text  # one line, not a traceback through tfdist's own code
    assert elapsed < 10
    # the kernel still works, and the notebook's model is untouched and usable
    r = tf_kernel.execute("print(len(model.get_weights()))", timeout=30)
    assert r.text.strip() == "4"


def test_kernel_killed_mid_fit_leaves_nothing(tmp_path):
    state = str(tmp_path / "state")
    k = Kernel(kernel_env(state), cwd=str(tmp_path))
    try:
        from tests.conftest import SETUP_CODE

        assert k.execute(SETUP_CODE, timeout=180).error is None
        k.execute_in_background(LONG_FIT.format(name="orphan-check"), timeout=300)
        wait_for_epoch(state, "orphan-check", 1)
        pids = job_pids(state, "orphan-check")
        # the job's tasks were forked (the default): each is the supervisor's own child, not the fork
        # server's, and the fork server is gone once chief-0 started (moved here from test_forkserver)
        tasks = task_pids(state, "orphan-check")
        assert sorted(tasks) == ["chief-0", "ps-0", "worker-0", "worker-1"], tasks
        sup = pids[0]
        for task, pid in tasks.items():
            assert psutil.Process(pid).ppid() == sup, task
            assert "tfdist.runtime.forkserver" in " ".join(psutil.Process(pid).cmdline()), task
        servers = [c.pid for c in psutil.Process(sup).children() if c.pid not in tasks.values()]
        assert wait_gone(servers, 10) == []  # closed once chief-0 started
        os.kill(k.pid, signal.SIGKILL)
        assert wait_gone(pids, 10) == [], "job processes outlived their kernel by 10 s"
    finally:
        k.shutdown()


def test_kernel_killed_mid_plan_leaves_no_probe(tmp_path):
    """`%%tfdist plan` measures in a probe subprocess (TensorFlow servers, trials, maybe a GPU, the
    notebook's model and data): a kernel SIGKILLed meanwhile left it running to its end."""
    state = str(tmp_path / "state")
    k = Kernel(kernel_env(state, TFDIST_POOL_ON_LOAD="0"), cwd=str(tmp_path))
    try:
        from tests.conftest import SETUP_CODE

        assert k.execute(SETUP_CODE, timeout=180).error is None
        k.execute_in_background("%%tfdist plan --workers 2\nhistory = model.fit(train_ds, epochs=1)\n", 300)
        deadline = time.monotonic() + 60
        probes: list[psutil.Process] = []
        while not probes and time.monotonic() < deadline:
            probes = [p for p in job_processes() if "tfdist.runtime.probe" in " ".join(p.cmdline())]
            time.sleep(0.2)
        assert probes, "the plan's probe never started"
        os.kill(k.pid, signal.SIGKILL)
        assert wait_gone([p.pid for p in probes], 10) == [], "the probe outlived its kernel by 10 s"
        deadline = time.monotonic() + 10
        while job_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert job_processes() == [], "the probe's helpers outlived it"
    finally:
        k.shutdown()


def test_worker_killed_mid_fit_the_fit_completes(tf_kernel):
    th, box = tf_kernel.execute_in_background(
        "%%tfdist run --name lose-worker\nhistory = model.fit(train_ds, epochs=12, steps_per_epoch=40)\n",
        timeout=400,
    )
    view = wait_for_epoch(tf_kernel.state_dir, "lose-worker", 2)
    victim = view.tasks["worker-1"]["pid"]
    os.kill(victim, signal.SIGKILL)
    th.join(400)
    r = box[0]
    assert r.error is None, r.error_text
    assert "succeeded" in r.text
    r = tf_kernel.execute(
        "print(len(history.history['loss']), history.history['loss'][-1] < history.history['loss'][0])"
    )
    assert r.text.split() == ["12", "True"]
    # the killed worker was restarted (a new process), not merely logged
    final = asyncio.run(LocalBackend(tf_kernel.state_dir).status("lose-worker"))
    assert final.tasks["worker-1"]["restarts"] >= 1, final.tasks
    assert final.tasks["worker-1"].get("pid") not in (None, victim), final.tasks


def test_coordinator_error_shows_the_cells_line_and_cleans_up(tf_kernel):
    # `_three` also checks that a notebook name starting with "_" travels (only the shell's own names stay)
    assert tf_kernel.execute("_three = 3", timeout=30).error is None
    r = tf_kernel.execute(
        "%%tfdist run --name broken\nn = _three\nhistory = model.fit(train_ds, epochs=1, steps_per_epoch=2)\n"
        "ratio = n / (n - 3)\n",
        timeout=300,
    )
    err = r.error_text
    assert r.error and r.error["ename"] == "JobFailed", err
    assert "ZeroDivisionError" in err
    assert "cell, line 4" in err and "ratio = n / (n - 3)" in err  # the cell's own line numbering
    assert not job_processes()


def test_an_interrupt_while_the_chart_loads_stops_the_job(tf_kernel):
    """The job exists once submit returns; the live chart loads after it (bqplot and ipywidgets, slow the
    first time in a kernel). An interrupt that lands there (stood for by a make_monitor that raises it) ended
    the cell and left the job training on, held by the kernel's lifeline with nobody to take its results."""
    patch = (
        "import tfdist.kernel_magics.magics as _m\n"
        "_m._real_make_monitor = _m.make_monitor\n"
        "def _interrupted(view):\n"
        "    raise KeyboardInterrupt\n"
        "_m.make_monitor = _interrupted\n"
    )
    assert tf_kernel.execute(patch).error is None
    try:
        r = tf_kernel.execute(LONG_FIT.format(name="chartload"), timeout=300)
        assert r.error and r.error["ename"] == "KeyboardInterrupt", r.error_text + r.text
        assert r.error["evalue"] == "tfdist job chartload interrupted; all its processes were ended"
        deadline = time.monotonic() + 15
        while job_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert job_processes() == [], "the job outlived the interrupted cell"
    finally:
        tf_kernel.execute("_m.make_monitor = _m._real_make_monitor")


def test_a_chart_that_cannot_be_drawn_follows_the_job_in_text(tf_kernel):
    """bqplot and ipywidgets that do not match (an error other than ImportError): the job is running by
    then, so the cell follows it in text and still hands back its results."""
    patch = (
        "from tfdist.kernel_magics import monitor as _mon\n"
        "_real_init = _mon.WidgetMonitor.__init__\n"
        "def _broken(self, view):\n"
        "    raise RuntimeError('widget model version mismatch')\n"
        "_mon.WidgetMonitor.__init__ = _broken\n"
    )
    assert tf_kernel.execute(patch).error is None
    try:
        cell = "%%tfdist run --name textonly\nhistory = model.fit(train_ds, epochs=2, steps_per_epoch=3)\n"
        r = tf_kernel.execute(cell, timeout=300)
        assert r.error is None, r.error_text
        assert "the live chart cannot be drawn (RuntimeError: widget model version mismatch)" in r.text
        assert tf_kernel.execute("print(len(history.history['loss']))").text.strip() == "2"
    finally:
        tf_kernel.execute("_mon.WidgetMonitor.__init__ = _real_init")
