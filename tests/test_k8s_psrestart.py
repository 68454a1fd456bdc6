"""A PS that comes back on Kubernetes, without pods: the manifests (PS Job restarts, the coordinator's
checkpoint setting), the state derivation (a lost PS pod of such a job is not the job's end), and the
coordinator pod's PS watch (tfdist.runtime.pspod) against a real listening socket and a real coordinator
stand-in process. The whole path on real pods: tests/test_k8s_realnode_psrestart.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tfdist.jobspec import JobSpec
from tfdist.kube import manifests as mf
from tfdist.kube import names as kn
from tfdist.kube import status as st
from tfdist.runtime import pspod, psrecovery, psrestart
from tfdist.runtime.pspod import PsWatch, ps_addresses


def spec(**kw) -> JobSpec:
    return JobSpec(name="j", user="ann", namespace="ns", image="img", backend="kubernetes", **kw)


def env_of(job: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_checkpoint_every_makes_the_ps_job_replace_its_pods_and_tells_the_coordinator():
    s = spec(checkpoint_every=25)
    ps = mf.task_job(s, "ps", None)
    assert ps["spec"]["backoffLimitPerIndex"] == psrestart.MAX_PS_RESTARTS
    assert ps["spec"]["maxFailedIndexes"] == 0  # a PS out of restarts fails the PS Job
    assert ps["spec"]["podReplacementPolicy"] == "TerminatingOrFailed"
    assert "backoffLimit" not in ps["spec"]
    assert ps["spec"]["template"]["metadata"]["annotations"] == {kn.A_PS_RESTARTS: "3"}
    root = mf.root_job(s, None)
    assert env_of(root)[psrecovery.ENV_EVERY] == "25"
    assert root["spec"]["backoffLimit"] == 0  # the coordinator pod restarts its coordinator itself
    # the checkpoint directory is the coordinator pod's own job dir, chosen where it runs
    assert psrecovery.ENV_DIR not in env_of(root)
    worker = mf.task_job(s, "worker", None)
    assert (
        psrecovery.ENV_EVERY not in env_of(worker)
        and "annotations" not in worker["spec"]["template"]["metadata"]
    )


def test_without_checkpoints_a_ps_loss_still_ends_the_job():
    s = spec()
    ps = mf.task_job(s, "ps", None)
    assert ps["spec"]["backoffLimit"] == 0 and "backoffLimitPerIndex" not in ps["spec"]
    assert "annotations" not in ps["spec"]["template"]["metadata"]
    assert psrecovery.ENV_EVERY not in env_of(mf.root_job(s, None))
    failed = pod("ps", "Failed", annotations=None)
    assert st.pod_task_state(failed) == ("failed", "Error")
    assert st.outcome({"chief-0": ("running", ""), "ps-0": ("failed", "Error")}).state == "failed"


def pod(role: str, phase: str, annotations: dict | None) -> dict:
    meta = {"name": f"j-{role}-0", "labels": {kn.L_ROLE: role, kn.L_INDEX: "0"}}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "status": {"phase": phase, "reason": "Error"}}


def test_a_failed_ps_pod_of_a_checkpointing_job_is_being_replaced_not_the_end():
    failed = pod("ps", "Failed", {kn.A_PS_RESTARTS: "3"})
    state = st.pod_task_state(failed)
    assert state[0] == "restarting" and "being replaced" in state[1]
    tasks: st.TaskStates = {"chief-0": ("running", "")}
    events = st.task_events([failed], tasks)
    assert events[0].state == "restarting"
    assert st.outcome(tasks) is None
    # the coordinator pod is the judge: once it fails (PS out of restarts), the job has failed
    tasks["chief-0"] = ("failed", "Error")
    assert st.outcome(tasks).state == "failed"


class FakePs:
    """A TF server's address: a real listening socket, closed and reopened on the same port."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._accepting = threading.Thread(target=self._accept, args=(self.sock,), daemon=True)
        self._accepting.start()

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
                conn.close()
            except OSError:
                return

    def lose(self) -> None:
        self.sock.close()

    def come_back(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.sock,), daemon=True).start()


def coordinator() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


@pytest.fixture
def ps():
    p = FakePs()
    yield p
    p.lose()


def test_the_ps_addresses_come_from_the_cluster_spec(tmp_path):
    cluster = {"chief": ["c:1"], "ps": ["j-ps-0.j.ns.svc:2222", "j-ps-1.j.ns.svc:2222"], "worker": ["w:2"]}
    assert ps_addresses(cluster) == {"ps-0": ("j-ps-0.j.ns.svc", 2222), "ps-1": ("j-ps-1.j.ns.svc", 2222)}
    env = {"TFDIST_CLUSTER": json.dumps(cluster)}
    assert PsWatch.from_env(str(tmp_path), print, env) is None  # no --checkpoint-every: nothing to watch
    w = PsWatch.from_env(str(tmp_path), print, {**env, psrecovery.ENV_EVERY: "7"})
    assert w is not None and w.every == 7 and set(w.addrs) == {"ps-0", "ps-1"}
    assert w.coordinator_env() == {
        psrecovery.ENV_EVERY: "7",
        psrecovery.ENV_DIR: os.path.join(str(tmp_path), "ckpt"),
    }


def test_a_lost_ps_ends_the_coordinator_and_the_watch_resumes_once_it_answers(ps, tmp_path):
    events: list[dict] = []
    w = PsWatch(5, str(tmp_path), {"ps-0": ("127.0.0.1", ps.port)}, events.append)
    proc = coordinator()
    try:
        w.follow(proc)
        deadline = time.time() + 10
        while "ps-0" not in w.up and time.time() < deadline:
            time.sleep(0.1)
        assert "ps-0" in w.up
        os.makedirs(tmp_path / "ckpt")
        (tmp_path / "ckpt" / "progress.json").write_text(
            json.dumps({"step": 30, "epoch": 1, "epoch_logs": []})
        )
        (tmp_path / "error.json").write_text('{"type": "UnavailableError", "message": "ps gone"}')
        ps.lose()
        code = proc.wait(timeout=15)  # the watch ended it: it cannot go on without its PS
        assert code == -9
        threading.Timer(2.0, ps.come_back).start()
        t0 = time.time()
        assert w.resume(code) is True
        assert time.time() - t0 >= 1.5  # it waited until the PS answered again
    finally:
        proc.kill()
        w.close()
    assert not (tmp_path / "error.json").exists()  # the next coordinator's outcome is its own
    logs = [line for e in events if e["type"] == "log" for _, line in e["lines"]]
    assert "restarting it and the coordinator" in logs[0] and "(1/3)" in logs[0]
    assert "resumes from the checkpoint at step 30 (epoch 2)" in logs[-1]
    states = [(e["task"], e["state"]) for e in events if e["type"] == "task"]
    assert states == [("ps-0", "restarting"), ("ps-0", "running"), ("chief-0", "restarting")]


def test_a_cell_error_with_every_ps_answering_is_not_a_ps_loss(ps, tmp_path):
    w = PsWatch(5, str(tmp_path), {"ps-0": ("127.0.0.1", ps.port)}, lambda e: None)
    assert w.resume(0) is False
    assert w.resume(1) is False and w.restarts == 0


def test_after_a_ps_restart_a_coordinator_cut_off_from_the_cluster_is_started_again(
    ps, tmp_path, monkeypatch
):
    """A server's channel may still point at the old PS address for a while: TensorFlow's connection error
    then ends the resumed coordinator, and it is resumed once more within the restart budget. The same
    error in a job that never lost a PS, or the cell's own error, ends the job as without checkpoints."""
    monkeypatch.setattr(pspod, "CUT_OFF_PAUSE_S", 0.1)
    events: list[dict] = []
    w = PsWatch(5, str(tmp_path), {"ps-0": ("127.0.0.1", ps.port)}, events.append)
    error = tmp_path / "error.json"
    error.write_text('{"type": "CancelledError", "message": "RemoteExecuteNode::RunAsync"}')
    assert w.resume(1) is False  # no PS was lost before: as without checkpoints
    w.restarts = 1
    error.write_text('{"type": "ValueError", "message": "the cell\'s own"}')
    assert w.resume(1) is False and w.restarts == 1
    error.write_text('{"type": "CancelledError", "message": "RemoteExecuteNode::RunAsync"}')
    assert w.resume(1) is True and w.restarts == 2 and not error.exists()
    logs = [line for e in events if e["type"] == "log" for _, line in e["lines"]]
    assert (
        "lost its connection to the cluster (CancelledError); restarting it" in logs[0] and "(2/3)" in logs[0]
    )
    w.restarts = psrestart.MAX_PS_RESTARTS
    error.write_text('{"type": "UnavailableError", "message": "Socket closed"}')
    assert w.resume(1) is False
    assert "(UnavailableError) again after 3 restarts" in json.loads(error.read_text())["message"]


def test_a_ps_lost_after_its_restarts_ends_the_job_saying_so(ps, tmp_path):
    events: list[dict] = []
    w = PsWatch(5, str(tmp_path), {"ps-0": ("127.0.0.1", ps.port)}, events.append)
    w.restarts = psrestart.MAX_PS_RESTARTS
    ps.lose()
    assert w.resume(1) is False
    err = json.loads((tmp_path / "error.json").read_text())
    assert err["type"] == "ParameterServerLost"
    assert "lost again after 3 restarts (--checkpoint-every allows 3)" in err["message"]


def test_a_ps_that_does_not_come_back_ends_the_job_saying_so(ps, tmp_path):
    w = PsWatch(5, str(tmp_path), {"ps-0": ("127.0.0.1", ps.port)}, lambda e: None, return_wait_s=2)
    ps.lose()
    assert w.resume(1) is False and w.restarts == 1
    err = json.loads((tmp_path / "error.json").read_text())
    assert "did not come back within 2s" in err["message"]
