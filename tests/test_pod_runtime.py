"""What the Kubernetes pods run (tfdist.runtime.podmain: agent + coordinator, servers + samplers), run
here as local processes on 127.0.0.1 and driven by the notebook's AgentClient: kwok runs no containers,
so this is where the pod-side code trains for real."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.digits_payload import digits_payload
from tests.realpods import runs_in_real_pods
from tfdist import payload, tf_config
from tfdist.kube.agent_client import AgentClient, AgentForged

pytestmark = pytest.mark.slow


def pod_argv(role: str) -> list[str]:
    """A pod's entry point as a local process with its own /tmp, as a container has: a job directory the
    coordinator makes there is not the PS's or a worker's (a PS that saved its checkpoint shard into the
    coordinator's directory worked here, and failed in every real pod). Root runs the suite (the real
    node needs it); elsewhere the processes share /tmp as before."""
    argv = [sys.executable, "-m", "tfdist.runtime.podmain", role]
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return argv
    private_tmp = 'mount -t tmpfs -o mode=1777,size=1g tfdist-pod-tmp /tmp && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", private_tmp, "pod", *argv]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def local_pods(workers: int, ps: int) -> tuple[dict, dict[str, str], int, str]:
    """(cluster, environment, agent port, token) for the pods' entry points run as local processes: what the
    manifests give every pod, on free local ports."""
    *tf_ports, agent_port = free_ports(workers + ps + 2)
    cluster = tf_config.cluster(tf_config.local_addresses(workers, ps, tf_ports))
    token = "s3cret-token"
    base = {
        **os.environ,
        "TFDIST_TOKEN": token,
        "TFDIST_AGENT_URL": f"http://127.0.0.1:{agent_port}",
        "TFDIST_AGENT_PORT": str(agent_port),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "GRPC_FAIL_FAST": "use_caller",
        "TF_USE_LEGACY_KERAS": "1",
    }
    return cluster, base, agent_port, token


@runs_in_real_pods("tests/test_k8s_realnode_jobs.py")
def test_pod_entrypoints_train_and_return_results_through_the_agent(tmp_path):
    blob, ns = digits_payload("history = model.fit(ds, epochs=3, steps_per_epoch=20)\n")
    before = ns["model"].get_weights()[0].copy()

    cluster, base, agent_port, token = local_pods(2, 1)
    procs = []
    try:
        for task in tf_config.task_names(2, 1):
            role = tf_config.split_task(task)[0]
            env = base | {"TF_CONFIG": tf_config.tf_config(cluster, task), "TFDIST_TASK": task}
            procs.append(
                subprocess.Popen(
                    pod_argv(role),
                    env=env,
                    stdout=open(tmp_path / f"{task}.log", "wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        client = AgentClient(f"http://127.0.0.1:{agent_port}", token)
        bad = AgentClient(f"http://127.0.0.1:{agent_port}", "wrong")

        async def drive():
            deadline = time.time() + 60
            while not await client.reachable():
                assert time.time() < deadline
                await asyncio.sleep(0.2)
            with pytest.raises(AgentForged, match="refused the job"):  # wrong token: nothing
                await bad.upload(b"x")
            try:
                await client.upload(blob)
                evs = [ev async for ev in client.events()]
                res = await client.result()
                await client.done()
            finally:
                await client.close()
                await bad.close()
            return evs, res

        evs, res = asyncio.run(asyncio.wait_for(drive(), 240))
        assert evs[-1].state == "succeeded", evs[-1]
        epochs = [e for e in evs if e.type == "progress" and e.logs]
        assert [e.epoch for e in epochs] == [1, 2, 3]
        tasks_sampled = {t for e in evs if e.type == "metrics" for t in e.tasks}
        assert tasks_sampled & {"worker-0", "worker-1", "ps-0"}  # samplers in the server "pods" reported
        payload.apply_results(res, ns)
        assert not np.allclose(ns["model"].get_weights()[0], before)
        assert ns["history"].history["loss"][-1] < ns["history"].history["loss"][0]
        for p in procs:  # every "pod" ends by itself once the coordinator is done
            p.wait(60)
        assert procs[0].returncode == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_a_server_pods_tensorflow_server_dies_with_its_entry_point(tmp_path):
    """Outside a container nothing ends a pod's children for us: a SIGKILLed entry point takes its TF
    server along (PR_SET_PDEATHSIG), so a killed test or crashed pod process leaves no orphan behind."""
    import psutil

    tf_ports = free_ports(4)
    cluster = tf_config.cluster(tf_config.local_addresses(2, 1, tf_ports))
    env = dict(
        os.environ,
        TF_CONFIG=tf_config.tf_config(cluster, "worker-0"),
        TFDIST_TASK="worker-0",
        TFDIST_TOKEN="t",
        TFDIST_AGENT_URL=f"http://127.0.0.1:{free_ports(1)[0]}",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    pod = subprocess.Popen([sys.executable, "-m", "tfdist.runtime.podmain", "worker"], env=env, cwd=tmp_path)
    try:
        deadline = time.time() + 60
        children: list[psutil.Process] = []
        while time.time() < deadline and not children:
            children = psutil.Process(pod.pid).children()
            time.sleep(0.2)
        assert children, "the entry point started no TF server"
        pod.kill()
        pod.wait()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"orphaned: {[p.pid for p in alive]}"
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait()
