"""A PS that comes back, pod side, without a cluster: the pods' entry points (tfdist.runtime.podmain) run as
local processes on 127.0.0.1 (as in tests/test_pod_runtime.py), the PS "pod" is SIGKILLed mid-fit and a
new one started at the same address (what the PS Job does), and the coordinator pod ends its coordinator,
waits for the PS and resumes the fit from its checkpoint: one history of every epoch, weights trained."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.digits_payload import digits_payload
from tests.kernels import PACE_IMPORT, paced
from tests.realpods import runs_in_real_pods
from tests.test_pod_runtime import local_pods, pod_argv
from tfdist import payload, tf_config
from tfdist.kube.agent_client import AgentClient
from tfdist.runtime import psrecovery

pytestmark = pytest.mark.slow
EPOCHS = 6


@runs_in_real_pods("tests/test_k8s_realnode_psrestart.py")
def test_a_killed_ps_pod_replaced_at_its_address_resumes_the_fit(tmp_path):
    # paced data (tests.kernels.paced): >= 9 s for the 180 steps on any CPU; the first heartbeat past step
    # 35 (every 2 s) comes by step 75 at the latest, >= 5 s before the fit's end
    blob, ns = digits_payload(
        f"{PACE_IMPORT}history = model.fit({paced('ds')}, epochs={EPOCHS}, steps_per_epoch=30)\n"
    )
    before = ns["model"].get_weights()[0].copy()

    cluster, base, agent_port, token = local_pods(2, 1)
    procs: dict[str, subprocess.Popen] = {}

    def start(task: str, log: str) -> subprocess.Popen:
        role = tf_config.split_task(task)[0]
        env = base | {"TF_CONFIG": tf_config.tf_config(cluster, task), "TFDIST_TASK": task}
        if role == "chief":  # what the manifests give the coordinator pod with --checkpoint-every 5
            env |= {psrecovery.ENV_EVERY: "5", "TFDIST_CLUSTER": json.dumps(cluster)}
        return subprocess.Popen(
            pod_argv(role),
            env=env,
            stdout=open(tmp_path / log, "wb"),
            stderr=subprocess.STDOUT,
        )

    try:
        for task in tf_config.task_names(2, 1):
            procs[task] = start(task, f"{task}.log")
        client = AgentClient(f"http://127.0.0.1:{agent_port}", token)
        times: dict[str, float] = {}

        async def drive():
            deadline = time.time() + 90
            while not await client.reachable():
                assert time.time() < deadline
                await asyncio.sleep(0.2)
            evs = []
            try:
                await client.upload(blob)
                async for ev in client.events():
                    evs.append(ev)
                    # the PS "pod" lost in epoch 2, after a heartbeat past step 35 (so a checkpoint exists)
                    if ev.type == "progress" and (ev.step or 0) >= 35 and "killed" not in times:
                        procs["ps-0"].send_signal(signal.SIGKILL)
                        procs["ps-0"].wait()
                        times["killed"] = time.monotonic()
                        procs["ps-0"] = start("ps-0", "ps-0-replacement.log")  # the PS Job's replacement
                    if ev.type == "log" and "resumes from" in str(ev.lines):
                        times.setdefault("resumed", time.monotonic())
                res = await client.result()
                await client.done()
            finally:
                await client.close()
            return evs, res

        evs, res = asyncio.run(asyncio.wait_for(drive(), 480))
        chief_log = (tmp_path / "chief-0.log").read_text(errors="replace")
        assert evs[-1].state == "succeeded", (evs[-1], chief_log[-3000:])
        lines = [line for e in evs if e.type == "log" for _, line in e.lines]
        assert any("parameter server ps-0" in s and "restarting it and the coordinator" in s for s in lines)
        assert any("resumes from the checkpoint at step" in s for s in lines), lines
        restarted = [e for e in evs if e.type == "task" and e.state == "restarting"]
        assert {str(e.task) for e in restarted} == {"ps-0", "chief-0"}
        print(f"\nPS killed -> coordinator resumed: {times['resumed'] - times['killed']:.1f}s")
        payload.apply_results(res, ns)
        assert len(ns["history"].history["loss"]) == EPOCHS and ns["history"].epoch == list(range(EPOCHS))
        assert not np.allclose(ns["model"].get_weights()[0], before)
        for p in procs.values():  # every "pod" ends by itself once the coordinator is done
            p.wait(60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
