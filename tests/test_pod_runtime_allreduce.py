"""All-reduce jobs' pod entry points (`podmain chief` as replica 0 with the agent, `podmain
allreduce-worker` for the others) run here as local processes on 127.0.0.1 and driven by the notebook's
AgentClient, as test_pod_runtime.py does for PS jobs: kwok runs no containers, so this is where an
all-reduce worker pod's code (payload from the chief's agent, the cell as a MWMS replica, its samples, its
end with the job) trains for real. The same code in real pods: test_k8s_realnode_allreduce.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from tests.digits_payload import digits_payload
from tests.realpods import runs_in_real_pods
from tests.test_pod_runtime import free_ports
from tfdist import payload, tf_config
from tfdist.kube.agent_client import AgentClient

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"


def allreduce_payload(epochs: int) -> tuple[bytes, dict]:
    return digits_payload(f"history = model.fit(ds, epochs={epochs}, steps_per_epoch=20)\n")


def start_pods(tmp_path, agent_port: int, workers: int = 2) -> list[subprocess.Popen]:
    """chief-0 and worker-0..N-2 as the pods start them: TFDIST_CLUSTER + the Job controller's index, no
    TF_CONFIG (podmain builds it), the strategy from TFDIST_STRATEGY."""
    addrs = tf_config.local_addresses(workers, 0, free_ports(workers), strategy="allreduce")
    cluster = json.dumps(tf_config.cluster(addrs, "allreduce"))
    base = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "TFDIST_TASK", "http_proxy")}
    base |= {
        "TFDIST_TOKEN": TOKEN,
        "TFDIST_AGENT_URL": f"http://127.0.0.1:{agent_port}",
        "TFDIST_CLUSTER": cluster,
        "TFDIST_STRATEGY": "allreduce",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "GRPC_FAIL_FAST": "use_caller",
        "TF_USE_LEGACY_KERAS": "1",
    }
    procs = []
    for task in tf_config.task_names(workers, 0, "allreduce"):
        role, index = tf_config.split_task(task)
        env = base | {"JOB_COMPLETION_INDEX": str(index)}
        if role == "chief":
            env["TFDIST_AGENT_PORT"] = str(agent_port)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tfdist.runtime.podmain",
                    f"allreduce-{role}",
                ],
                env=env,
                stdout=open(tmp_path / f"{task}.log", "wb"),
                stderr=subprocess.STDOUT,
            )
        )
    return procs


async def reachable(client: AgentClient) -> None:
    deadline = time.time() + 60
    while not await client.reachable():
        assert time.time() < deadline, "the chief's agent never listened"
        await asyncio.sleep(0.2)


def end_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            for c in psutil.Process(p.pid).children(recursive=True):
                c.kill()
            p.kill()
            p.wait()


@runs_in_real_pods("tests/test_k8s_realnode_allreduce.py")
def test_allreduce_pods_train_and_the_chief_returns_results_once(tmp_path):
    blob, ns = allreduce_payload(epochs=3)
    before = ns["model"].get_weights()[0].copy()
    (agent_port,) = free_ports(1)
    procs = start_pods(tmp_path, agent_port)
    client = AgentClient(f"http://127.0.0.1:{agent_port}", TOKEN)
    try:

        async def drive():
            try:
                await reachable(client)
                await client.upload(blob)
                evs = [ev async for ev in client.events()]
                res = await client.result()
                await client.done()
            finally:
                await client.close()
            return evs, res

        evs, res = asyncio.run(asyncio.wait_for(drive(), 300))
        logs = {
            p: (tmp_path / p).read_text(errors="replace")[-3000:] for p in ("chief-0.log", "worker-0.log")
        }
        assert evs[-1].state == "succeeded", (evs[-1], logs)
        epochs = [e for e in evs if e.type == "progress" and e.logs]
        assert [e.epoch for e in epochs] == [1, 2, 3]  # once each: only chief-0 reports
        sampled = {t for e in evs if e.type == "metrics" for t in e.tasks}
        assert {"chief-0", "worker-0"} <= sampled, sampled  # every replica's use reached the monitor
        payload.apply_results(res, ns)
        assert not np.allclose(ns["model"].get_weights()[0], before)
        assert ns["history"].history["loss"][-1] < ns["history"].history["loss"][0]
        for p in procs:  # both "pods" end by themselves, successfully
            p.wait(60)
        assert [p.returncode for p in procs] == [0, 0], logs
        assert "running the cell as an all-reduce replica" in (tmp_path / "worker-0.log").read_text()
    finally:
        end_all(procs)


def test_a_worker_pod_ends_when_the_chief_is_gone_mid_fit(tmp_path):
    """Nothing outlives the job: the chief's pod SIGKILLed mid-fit (its replica blocks every collective),
    and the worker pod with its replica ends within the orphan limit (30 s) on its own."""
    blob, _ = allreduce_payload(epochs=500)
    (agent_port,) = free_ports(1)
    procs = start_pods(tmp_path, agent_port)
    chief, worker = procs
    client = AgentClient(f"http://127.0.0.1:{agent_port}", TOKEN)
    try:

        async def first_epoch():
            try:
                await reachable(client)
                await client.upload(blob)
                async for ev in client.events():
                    if ev.type == "progress" and ev.logs:
                        return
                    assert ev.type != "state" or ev.state not in ("failed", "succeeded"), ev
            finally:
                await client.close()

        asyncio.run(asyncio.wait_for(first_epoch(), 300))
        replica = psutil.Process(worker.pid).children()
        assert replica, "the worker pod runs no replica"
        chief.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        worker.wait(60)
        took = time.monotonic() - t0
        _, alive = psutil.wait_procs(replica, timeout=10)
        assert not alive, "the worker's replica outlived its pod"
        log = (tmp_path / "worker-0.log").read_text(errors="replace")
        # either TensorFlow aborts the replica's collective (the peer reset the connection) or, blocked
        # for good, the pod ends it once the agent has been gone for 30 s
        how = "orphaned" if "the chief's agent was unreachable" in log else "collective aborted"
        assert how == "orphaned" or "Collective ops is aborted" in log, log[-2000:]
        print(f"\nchief killed -> worker pod ended ({how}, exit {worker.returncode}): {took:.1f}s")
    finally:
        end_all(procs)


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Answers at the chief's address with a payload, but without the job's signature."""

    def do_GET(self):
        body = b"not the job's payload"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_worker_pod_runs_nothing_an_impostor_sends(tmp_path):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"} | {
        "TFDIST_TOKEN": TOKEN,
        "TFDIST_AGENT_URL": f"http://127.0.0.1:{srv.server_address[1]}",
        "TFDIST_CLUSTER": json.dumps({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}),
        "TFDIST_STRATEGY": "allreduce",
    }
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tfdist.runtime.podmain", "allreduce-worker"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        srv.shutdown()
    assert out.returncode == 3, out
    assert "without the job's signature; not running it" in out.stdout, out.stdout
    assert "running the cell" not in out.stdout


def test_a_collective_aborted_by_a_lost_replica_names_it():
    from tfdist.runtime.allreduce import peer_lost

    unhealthy = {
        "type": "UnavailableError",
        "message": "Collective ops is aborted by: Error reported from /job:worker/task:0: The following "
        "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have "
        "crashed.",
        "traceback": "Traceback (on the coordinator):\n  cell, line 1",
    }
    err = peer_lost(unhealthy, "chief-0")
    assert err is not None and err["reason"] == "task-failed" and err["type"] == "WorkerLost"
    assert err["message"].startswith("all-reduce worker worker-1 stopped"), err
    assert err["traceback"] == unhealthy["traceback"]
    reset = {
        "message": "Collective ops is aborted by: recvmsg:Connection reset by peer\nAdditional GRPC "
        "error information from remote target /job:chief/replica:0/task:0 while calling RecvBuf"
    }
    assert peer_lost(reset, "worker-0")["message"].startswith("all-reduce worker chief-0 stopped")
    assert peer_lost(reset, "chief-0")["message"].startswith("an all-reduce replica stopped")
    # the cell's own errors stay what they are
    assert peer_lost({"type": "ValueError", "message": "shapes (3,) and (4,) differ"}, "chief-0") is None
