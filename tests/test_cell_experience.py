"""What a user sees in the `%%tfdist` cell, in a real kernel with real jobs: an interrupt is one line and
leaves nothing, the reason is the same in the cell, `%tfdist list` and the job's state, one chart stays in
the output (the PNG), the kernel is busy for the whole cell, a stuck job is called stuck."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import time
from typing import Any

import pytest

from tests.kernels import Kernel, job_processes, kernel_env, wait_gone
from tfdist.backends.local import LocalBackend
from tfdist.errors import NoSuchJob
from tfdist.jobview import LIVE_TASK_STATES

pytestmark = pytest.mark.slow

WIDGET = "application/vnd.jupyter.widget-view+json"


class Watched:
    """Every iopub message of one execution, and the kernel status JupyterLab would show meanwhile."""

    def __init__(self, kernel: Kernel, code: str):
        self.kernel = kernel
        self.msg_id = kernel.kc.execute(code)
        self.msgs: list[dict[str, Any]] = []
        self.lab_status: list[tuple[str, str]] = []  # (status, parent msg_type) as JupyterLab tracks it
        from jupyter_server.services.kernels.kernelmanager import MappingKernelManager

        self.untracked = set(MappingKernelManager.class_traits()["untracked_message_types"].default())
        self.other_parents: set[str] = set()  # types of the other requests that published a status
        self.done = False

    def pump(self, seconds: float) -> None:
        deadline = time.time() + seconds
        while not self.done and time.time() < deadline:
            try:
                msg = self.kernel.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            parent = msg["parent_header"]
            if msg["msg_type"] == "status" and parent.get("msg_type") not in self.untracked:
                self.lab_status.append((msg["content"]["execution_state"], parent.get("msg_id")))
                if parent.get("msg_id") != self.msg_id:
                    self.other_parents.add(parent.get("msg_type"))
            if parent.get("msg_id") != self.msg_id:
                continue
            self.msgs.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                self.done = True

    def wait(self, timeout: float) -> None:
        self.pump(timeout)
        assert self.done, f"cell did not finish in {timeout}s: {self.text[-2000:]}"

    @property
    def text(self) -> str:
        return "".join(m["content"]["text"] for m in self.msgs if m["msg_type"] == "stream")

    @property
    def error(self) -> dict[str, Any] | None:
        errs = [m["content"] for m in self.msgs if m["msg_type"] == "error"]
        return errs[-1] if errs else None

    def outputs(self) -> list[dict[str, Any]]:
        """The cell's outputs as a front end ends up showing them (update_display_data applied)."""
        out: list[dict[str, Any]] = []
        ids: dict[str, list[int]] = {}
        for m in self.msgs:
            t, c = m["msg_type"], m["content"]
            did = (c.get("transient") or {}).get("display_id")
            if t == "display_data":
                out.append(c["data"])
                if did:
                    ids.setdefault(did, []).append(len(out) - 1)
            elif t == "update_display_data":
                for i in ids.get(did, []):
                    out[i] = c["data"]
        return out


def job_view(state_dir: str, name: str):
    return asyncio.run(LocalBackend(state_dir).status(name))


def wait_view(state_dir: str, name: str, ok, watched: Watched, timeout: float = 180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        watched.pump(0.5)
        try:
            view = job_view(state_dir, name)
        except NoSuchJob:
            continue
        if ok(view):
            return view
        assert not view.finished, f"job ended early: {view.state} {view.message}\n{watched.text}"
    raise TimeoutError(f"job {name}: condition not reached\n{watched.text}")


def test_interrupt_is_one_line_same_reason_everywhere_one_chart_and_busy_throughout(tf_kernel):
    """Heartbeat steps arrive within an epoch; a control request mid-cell cannot make the kernel look idle;
    the interrupt leaves one line, no process, the reason `interrupted` in the cell, the state and the
    list, no live task, and one picture in the output."""
    w = Watched(
        tf_kernel,
        "%%tfdist run --name cut\nhistory = model.fit(train_ds, epochs=1, steps_per_epoch=100000)\n",
    )
    try:
        view = wait_view(tf_kernel.state_dir, "cut", lambda v: v.step > 0, w)
        assert view.epoch == 0  # the heartbeat shows steps inside the first epoch, before any epoch ended
        # What JupyterLab 4.6 does when the monitor's widgets open (its default "commsOverSubshells":
        # "perCommTarget"): a subshell for the widget comm target, asked on the control channel; and
        # jupyter-resource-usage's usage_request. Their busy/idle must not leave JupyterLab "idle".
        kc = tf_kernel.kc
        asks = [kc.session.msg(t, {}) for t in ("create_subshell_request", "usage_request")]
        for m in asks:
            kc.control_channel.send(m)
        answered = {("idle", m["header"]["msg_id"]) for m in asks}
        deadline = time.time() + 60
        while not answered <= set(w.lab_status) and time.time() < deadline:
            w.pump(0.5)
        w.pump(1)
        others = [s for s in w.lab_status if s[1] != w.msg_id]
        assert {"usage_request", "create_subshell_request"} <= w.other_parents, w.other_parents
        assert w.lab_status[-1] == ("busy", w.msg_id), w.lab_status
        pids = [p.pid for p in job_processes()]
    finally:
        tf_kernel.km.interrupt_kernel()
        w.wait(60)
    assert wait_gone(pids, 10) == []
    err = w.error
    assert err and err["ename"] == "KeyboardInterrupt", err
    assert err["evalue"] == "tfdist job cut interrupted; all its processes were ended"
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err["traceback"]))
    assert len(shown.splitlines()) <= 2, shown
    for frame in ("magics.py", "queue.py", "threading.py", "Traceback"):
        assert frame not in shown, shown
    # the kernel's status stayed busy until the cell's own idle
    assert all(s == ("busy", w.msg_id) for s in w.lab_status[w.lab_status.index(others[-1]) + 1 : -1])
    assert w.lab_status[-1] == ("idle", w.msg_id)
    # one vocabulary: the job's own state, the list and the cell say the same
    view = job_view(tf_kernel.state_dir, "cut")
    assert (view.state, view.reason, view.message) == (
        "stopped",
        "interrupted",
        "interrupted from the notebook",
    )
    assert not [t for t, r in view.tasks.items() if r["state"] in LIVE_TASK_STATES], view.tasks
    listed = tf_kernel.execute("%tfdist list", timeout=60).text
    assert re.search(r"cut .* stopped .*interrupted from the notebook", listed), listed
    # one chart: the live widgets were replaced by the run's picture
    outs = w.outputs()
    assert [o for o in outs if "image/png" in o] and not [o for o in outs if WIDGET in o], outs
    assert sum(1 for o in outs if "image/png" in o) == 1
    # and every widget of the monitor was closed: nothing of it stays in the kernel or the saved state
    opened = {m["content"]["comm_id"] for m in w.msgs if m["msg_type"] == "comm_open"}
    closed = {m["content"]["comm_id"] for m in w.msgs if m["msg_type"] == "comm_close"}
    assert len(opened) > 30 and opened <= closed


def test_a_job_without_progress_is_called_stuck_with_its_cpu(tf_kernel):
    w = Watched(
        tf_kernel,
        "%%tfdist run --name quiet --workers 1 --ps 1 --stall-timeout 4\n"
        "import time\ntime.sleep(12)\ny = 7\n",  # stuck after 4 s of it, and 8 s more to say so
    )
    w.wait(240)
    assert w.error is None, w.error
    text = w.text
    assert "tfdist: job quiet looks stuck: no training progress for" in text, text
    assert re.search(r"CPU now: chief-0 \d+%, ps-0 \d+%, worker-0 \d+%", text), text
    assert "interrupt the kernel" in text and "Stop in the Distributed jobs panel" in text
    assert text.count("looks stuck") == 1  # said once, not every second
    assert tf_kernel.execute("print(y)", timeout=30).text.strip() == "7"  # the job went on and finished


def test_a_killed_kernel_leaves_a_job_that_says_so_with_no_task_starting(tmp_path):
    """Killed while its job starts (what the panel showed as chief-0 "starting" for ever)."""
    state = str(tmp_path / "state")
    k = Kernel(kernel_env(state), cwd=str(tmp_path))
    try:
        # the cell needs no TensorFlow in the kernel (it sleeps): the extension alone spares an import
        assert k.execute("%load_ext tfdist", timeout=60).error is None
        k.execute_in_background(
            "%%tfdist run --name orphan --workers 1 --ps 1\nimport time\ntime.sleep(60)\n"
        )
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(state, "orphan", "control.sock")) and time.time() < deadline:
            time.sleep(0.1)
        assert os.path.exists(os.path.join(state, "orphan", "control.sock")), (
            "the job's supervisor never came"
        )
        pids = [p.pid for p in job_processes()]
        assert pids, "no job process to outlive the kernel"
        os.kill(k.pid, signal.SIGKILL)
        assert wait_gone(pids, 15) == []
    finally:
        k.shutdown()
    view = job_view(state, "orphan")
    assert (view.state, view.reason) == ("stopped", "kernel-gone"), (view.state, view.reason, view.message)
    assert view.message == "the notebook kernel that started this job went away"
    assert view.tasks and not [t for t, r in view.tasks.items() if r["state"] in LIVE_TASK_STATES], view.tasks
