"""A preempted `--checkpoint-every` job resumes when readmitted (issue 25), pod side and kernel side, without
a cluster: the pods' entry points (tfdist.runtime.podmain) run as local processes on 127.0.0.1 (as in
tests/test_pod_runtime.py), the kernel's keeper (tfdist.kube.checkpoints.follow) fetches the newest
checkpoint from the coordinator's agent while the fit runs, every "pod" is SIGKILLed mid-fit (Kueue
deletes a preempted group's pods all at once), and the job's second run, new pods with a new token, gets
the kept checkpoint before its payload (checkpoints.hand_back): its fit continues at the epoch it had
reached, one History of every epoch, weights trained."""

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
from tests.test_pod_runtime import local_pods, pod_argv
from tfdist import payload, tf_config
from tfdist.job import checkpoint as ck
from tfdist.job.events import Event
from tfdist.kube import checkpoints
from tfdist.kube.agent_client import AgentClient
from tfdist.runtime import psrecovery

pytestmark = pytest.mark.slow
EPOCHS, STEPS = 4, 20


def start_pods(tmp_path, run: str) -> tuple[dict[str, subprocess.Popen], AgentClient]:
    """One run of the job: chief (agent + coordinator), a worker and a PS, as the manifests give them with
    --checkpoint-every 5; a new token and new ports for each run, as a resubmitted job has."""
    cluster, base, agent_port, token = local_pods(1, 1)
    procs = {}
    for task in tf_config.task_names(1, 1):
        role = tf_config.split_task(task)[0]
        env = base | {"TF_CONFIG": tf_config.tf_config(cluster, task), "TFDIST_TASK": task}
        if role == "chief":
            env |= {psrecovery.ENV_EVERY: "5", "TFDIST_CLUSTER": json.dumps(cluster)}
        procs[task] = subprocess.Popen(
            pod_argv(role),
            env=env,
            stdout=open(tmp_path / f"{run}-{task}.log", "wb"),
            stderr=subprocess.STDOUT,
        )
    return procs, AgentClient(f"http://127.0.0.1:{agent_port}", token)


async def reachable(client: AgentClient) -> None:
    deadline = time.time() + 90
    while not await client.reachable():
        assert time.time() < deadline, "the coordinator's agent never answered"
        await asyncio.sleep(0.2)


def test_a_preempted_job_resumes_from_the_kernels_checkpoint_in_its_new_pods(tmp_path):
    blob, ns = digits_payload(
        f"{PACE_IMPORT}history = model.fit({paced('ds')}, epochs={EPOCHS}, steps_per_epoch={STEPS})\n"
    )
    before = ns["model"].get_weights()[0].copy()
    kept = checkpoints.kept_path(str(tmp_path / "state"), "ns", "job", checkpoints.payload_digest(blob))
    runs: list[dict[str, subprocess.Popen]] = []
    t: dict[str, float] = {}

    async def drive():
        # the first run: the kernel keeps the newest checkpoint until Kueue takes the pods away
        t["start"] = time.monotonic()
        procs, client = start_pods(tmp_path, "first")
        runs.append(procs)
        first: list[Event] = []
        try:
            await reachable(client)
            t["first_up"] = time.monotonic()
            await client.upload(blob)
            keeper = asyncio.ensure_future(checkpoints.follow(client, kept, every_s=0.5))
            async for ev in client.events():
                first.append(ev)
                got = checkpoints.info(kept)
                if got is not None and got.epoch >= 1:  # a checkpoint of the second epoch reached the kernel
                    break
            t["preempted"] = time.monotonic()
            for p in procs.values():  # evicted whole
                p.send_signal(signal.SIGKILL)
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        finally:
            await client.close()
        resume = checkpoints.prepare_resume(kept)
        assert resume is not None and 1 <= resume.epoch < EPOCHS
        # readmitted: new pods, the checkpoint handed back before the payload
        procs, client = start_pods(tmp_path, "second")
        runs.append(procs)
        second: list[Event] = []
        try:
            await reachable(client)
            t["readmitted"] = time.monotonic()
            back = await checkpoints.hand_back(client, kept, time.time(), 120)
            assert back == resume
            await client.upload(blob)
            async for ev in client.events():
                second.append(ev)
            res = await client.result()
            await client.done()
        finally:
            await client.close()
        t["done"] = time.monotonic()
        return first, resume, second, res

    try:
        first, resume, second, res = asyncio.run(asyncio.wait_for(drive(), 300))
        logs = "".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-2000:] for p in sorted(tmp_path.glob("*.log"))
        )
        assert second[-1].type == "state" and second[-1].state == "succeeded", (second[-1], logs)
        lines = [line for e in second if e.type == "log" for _, line in e.lines]
        assert f"tfdist: {ck.Resume(epoch=resume.epoch, step=resume.step).sentence()}" in lines, lines
        # the second run trained only the epochs the first had not finished
        finished_first = [e.epoch for e in first if e.type == "progress" and e.logs]
        finished_second = [e.epoch for e in second if e.type == "progress" and e.logs]
        assert finished_first[: resume.epoch] == list(range(1, resume.epoch + 1)), finished_first
        assert finished_second == list(range(resume.epoch + 1, EPOCHS + 1)), (finished_second, logs)
        # one History: the first run's epochs (from the checkpoint's progress), then the second run's
        payload.apply_results(res, ns)
        history = ns["history"]
        assert history.epoch == list(range(EPOCHS)) and len(history.history["loss"]) == EPOCHS
        first_losses = [e.logs["loss"] for e in first if e.type == "progress" and e.logs]
        assert history.history["loss"][: resume.epoch] == pytest.approx(first_losses[: resume.epoch])
        assert not np.allclose(ns["model"].get_weights()[0], before)
        print(
            f"\npreempted at epoch {resume.epoch + 1} (step {resume.step}); first run's agent up -> "
            f"preempted {t['preempted'] - t['first_up']:.1f}s; second run's agent up -> done "
            f"{t['done'] - t['readmitted']:.1f}s; whole drive {t['done'] - t['start']:.1f}s"
        )
        for p in runs[-1].values():  # every "pod" of the second run ends by itself
            p.wait(60)
    finally:
        for procs in runs:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
