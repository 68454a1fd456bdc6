"""A real IPython kernel for tests (jupyter_client), plus helpers to find a job's processes.

Used instead of an in-process shell so interrupts, kernel death and widget/display messages behave
exactly as in JupyterLab.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
from jupyter_client.manager import KernelManager

from tfdist.backends.pool import STATE_PREFIX
from tfdist.settings import KernelSettings


@dataclass
class Result:
    outputs: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        parts = []
        for o in self.outputs:
            if o["msg_type"] == "stream":
                parts.append(o["content"]["text"])
            elif o["msg_type"] in ("execute_result", "display_data"):
                parts.append(o["content"]["data"].get("text/plain", ""))
        return "".join(parts)

    @property
    def error_text(self) -> str:
        if not self.error:
            return ""
        import re

        tb = "\n".join(self.error.get("traceback", []))
        return re.sub(r"\x1b\[[0-9;]*m", "", f"{self.error['ename']}: {self.error['evalue']}\n{tb}")

    def mimetypes(self) -> set[str]:
        out: set[str] = set()
        for o in self.outputs:
            if o["msg_type"] in ("execute_result", "display_data"):
                out |= set(o["content"]["data"])
        return out


class Kernel:
    def __init__(self, env: dict[str, str], cwd: str):
        # IPC sockets, not TCP: jupyter_client picks free TCP ports before the kernel binds them, and on a
        # machine full of TF servers and API servers another process took one in between (CI: "Address
        # already in use", the kernel dead at start). A short absolute path: AF_UNIX's 107 bytes.
        self._ipc_dir = tempfile.mkdtemp(prefix="tfdk-", dir="/tmp")
        self.km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(self._ipc_dir, "k"))
        self.km.start_kernel(env=env, cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid  # type: ignore[union-attr]

    def execute(self, code: str, timeout: float = 300) -> Result:
        msg_id = self.kc.execute(code)
        return self.collect(msg_id, timeout)

    def collect(self, msg_id: str, timeout: float) -> Result:
        res = Result()
        deadline = time.time() + timeout
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                raise TimeoutError(
                    f"cell did not finish in {timeout}s; outputs so far: {res.text[-2000:]}"
                ) from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            t = msg["msg_type"]
            if t == "status" and msg["content"]["execution_state"] == "idle":
                return res
            if t == "error":
                res.error = msg["content"]
            elif t in ("stream", "display_data", "execute_result"):
                res.outputs.append(msg)

    def execute_in_background(self, code: str, timeout: float = 300) -> tuple[threading.Thread, list[Result]]:
        box: list[Result] = []
        msg_id = self.kc.execute(code)

        def run() -> None:
            try:
                box.append(self.collect(msg_id, timeout))
            except Exception:  # the kernel may be killed on purpose mid-cell
                pass

        th = threading.Thread(target=run, daemon=True)
        th.start()
        return th, box

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
        except Exception:
            pass
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


# Every kernel the tests start carries this mark, and every job process inherits it: so the checks see
# this run's jobs only, not those of another run on the same machine.
RUN_MARK = f"tfdist-test-{os.getpid()}"
# ... and so does every process this one starts itself (jobs a test submits through a backend directly,
# not from a kernel): the checks would not see those otherwise
os.environ["TFDIST_TEST_RUN"] = RUN_MARK


def job_processes() -> list[psutil.Process]:
    """Every live process of a tfdist job started by this test run (supervisors, tasks, coordinators,
    pooled processes that became one); not the idle warm pool of a living kernel (see below)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "tfdist.runtime." not in " ".join(p.info.get("cmdline") or []) or idle_pool_of_live_kernel(p):
                continue
            if p.environ().get("TFDIST_TEST_RUN") == RUN_MARK and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def idle_pool_of_live_kernel(p: psutil.Process) -> bool:
    """Whether `p` is part of a waiting warm pool (tfdist.backends.pool) whose kernel still runs: such a
    pool is the kernel's, not a job. Told by what the process is, not by its name (IDLE_NAME is set only
    once TensorFlow is imported): its command line (python -m tfdist.runtime.warmpool / .forkserver) and
    what it still holds while it waits. A fork server waits with its socket as stdin, and a task forked
    from it has /dev/null there; the warm supervisor writes to the pool's log (STATE_PREFIX*.log) until it
    takes a job, then to that job's supervisor.log. A pool whose kernel is gone counts as left behind."""
    try:
        cmd = p.cmdline()
        if "tfdist.runtime.forkserver" in cmd:
            if not os.readlink(f"/proc/{p.pid}/fd/0").startswith("socket:"):
                return False  # a forked task
            pool = p.parent()
        elif "tfdist.runtime.warmpool" in cmd:
            pool = p
        else:
            return False
        if pool is None or "tfdist.runtime.warmpool" not in pool.cmdline():
            return False  # a job's own fork server
        if not os.path.basename(os.readlink(f"/proc/{pool.pid}/fd/1")).startswith(STATE_PREFIX):
            return False  # the warm supervisor took a job: it and its tasks are that job's
        kernel = pool.parent()
        return (
            kernel is not None
            and kernel.status() != psutil.STATUS_ZOMBIE
            and "ipykernel" in " ".join(kernel.cmdline())
        )
    except (OSError, psutil.Error):
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.time() + timeout
    alive = list(pids)
    while alive and time.time() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def product_kernel_env(state_dir: str, **extra: str) -> dict[str, str]:
    """A kernel's environment with the product's defaults, as a hub's server gives it: every admin knob
    (KernelSettings: the warm pool of 4, forking, isolation, ...) at its default whatever the shell running
    the tests says, and TensorFlow's log level 2 as both spawners set it (its errors show, its info does
    not). The user's path (the magic tests' `tf_kernel`) runs in these."""
    env = dict(os.environ)
    for var in KernelSettings.variables():
        env.pop(var.name, None)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # no GPU here; a test that fakes one says so
    env.update(
        {
            "TFDIST_TEST_RUN": RUN_MARK,
            "TFDIST_STATE_DIR": state_dir,
            "TF_CPP_MIN_LOG_LEVEL": "2",  # what TfdistLocalSpawner and TfdistKubeSpawner set
            # Python's own warnings (a library's DeprecationWarning) are not tfdist's output, and the tests
            # compare cell output as text; test_main_job runs under the hub without this and checks that the
            # first cell shows no stderr at all
            "PYTHONWARNINGS": "ignore",
        }
    )
    env.update(extra)
    return env


def kernel_env(state_dir: str, **extra: str) -> dict[str, str]:
    """`product_kernel_env` with the warm pool off, for the kernels of tests that are not the user's path:
    a pool keeps a warm supervisor and a fork server with TensorFlow imported (0.45-0.9 GiB RSS measured,
    a TF import of CPU after each job) per kernel, on a 2-core machine running two test workers. The pool
    itself is tested in test_warm_pool.py and on the user's path (`tf_kernel`, test_main_job.py)."""
    return product_kernel_env(state_dir, **({"TFDIST_POOL_SIZE": "0"} | extra))


# Data paced to a known least time per batch: a fit that must outlast a fault the test injects (a PS or a
# worker killed mid-fit) lasts long enough on any CPU. A sleep in the tf.data pipeline, not work, so it
# costs no CPU, and it travels in the dataset's graph to every worker. Unpaced, a fast CPU (AVX-512/AMX)
# ended the fits in 1.5-2 s, before the kill.
PACE_IMPORT = "from tensorflow.python.data.experimental.ops import testing as _tfdata_testing\n"


def paced(dataset: str, seconds_per_batch: float = 0.1) -> str:
    """Source of `dataset` with each worker's batches `seconds_per_batch` apart (needs PACE_IMPORT)."""
    return f"{dataset}.apply(_tfdata_testing.sleep({round(seconds_per_batch * 1e6)}))"


def jobs_in(state_dir: str) -> list[str]:
    """What the state directory holds but the kernel's warm pool: its record and log come and go with the
    pool (started at the extension's load, again after each job), whatever a cell does."""
    from tfdist.backends.pool import STATE_PREFIX

    if not os.path.isdir(state_dir):
        return []
    return sorted(n for n in os.listdir(state_dir) if not n.startswith(STATE_PREFIX))
