"""A parameter server that comes back on the real node (`--checkpoint-every N`, Kubernetes backend).

The example's `%%tfdist run` with checkpoints every few steps; the PS pod is deleted once the coordinator
says its first checkpoint is written. The PS Job brings it back at the same hostname, the coordinator pod
ends its coordinator, waits until the PS answers and starts it again, and the fit resumes from that
checkpoint (not from the start): the cell succeeds with one history of exactly the asked epochs, the
weights changed, the monitor said the PS was restarted, and nothing of the job is left afterwards.

In pods the checkpoint's files must be written by the coordinator: TensorFlow writes each variable's
shard on the PS that holds it unless told otherwise, and the coordinator pod's directory is not in the
PS pod. Before that was fixed no checkpoint was ever written here, and the failed save on the PS
cancelled the fit's steps ("the resumed coordinator lost its connection") until the restarts ran out.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from tests import realnode
from tests.realnode_jobs import (
    digits_kernel,
    epochs_shown,
    job_pods,
    notebook_cells,
    restarts_shown,
    run_line,
    running,
    start_notebook_pod,
    wait_first_epoch,
    wait_for,
    wait_gone,
)
from tfdist.kube import names as kn

pytestmark = [pytest.mark.k8s, pytest.mark.realnode]

EPOCHS = 16
CHECKPOINT_WRITTEN = re.compile(r"tfdist: checkpoint written at step (\d+)")


def follow_logs(ns: str, pods: list[dict], where) -> list[subprocess.Popen]:
    """`kubectl logs -f` of each pod into a file: what the coordinator and workers said, even once the job's
    pods are deleted (printed when the cell fails)."""
    state = realnode.load_state()
    kubectl = str(realnode.plane_bin_dir() / "kubectl")
    out = []
    for p in pods:
        name = p["metadata"]["name"]
        with open(where / f"{name}.log", "w") as f:
            out.append(
                subprocess.Popen(
                    [kubectl, "--kubeconfig", state["kubeconfig"], "logs", "-f", "-n", ns, name],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            )
    return out


@pytest.mark.timeout(1500)
def test_a_deleted_ps_pod_comes_back_and_the_fit_resumes(real_cluster, job_image, tenants, tmp_path):
    tenant = tenants("psr")
    ns = tenant.namespace
    start_notebook_pod(real_cluster, tenant)
    k = digits_kernel(tenant, job_image, tmp_path)
    followers: list[subprocess.Popen] = []
    try:
        since = k.mark()
        line = run_line("psback", "--checkpoint-every 10").replace("epochs=8", f"epochs={EPOCHS}")
        cell = k.submit(line)
        # the PS Job and the coordinator's pod as the manifests made them
        ps_job = wait_for(
            "the PS Job",
            lambda: real_cluster.get(f"/apis/batch/v1/namespaces/{ns}/jobs/psback-ps"),
            120,
        )
        assert ps_job["spec"]["backoffLimitPerIndex"] == 3 and ps_job["spec"]["maxFailedIndexes"] == 0
        wait_first_epoch(real_cluster, k, cell, since, ns, "psback")
        written = wait_for(
            "the coordinator's first checkpoint",
            lambda: [int(m[1]) for t in k.widget_texts(since) for m in CHECKPOINT_WRITTEN.finditer(t)],
            120,
        )
        assert written[0] >= 10, written
        assert epochs_shown(k.widget_texts(since)) < EPOCHS - 4  # the PS goes mid-fit
        (victim,) = job_pods(real_cluster, ns, "psback", "ps")
        logs = tmp_path / "pod-logs"
        logs.mkdir()
        pods = job_pods(real_cluster, ns, "psback")
        others = [p for p in pods if p["metadata"]["labels"][kn.L_ROLE] != "ps"]
        followers += follow_logs(ns, others, logs)
        real_cluster.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{victim['metadata']['name']}")
        t0 = time.monotonic()

        def replacement():
            return [
                p
                for p in running(job_pods(real_cluster, ns, "psback", "ps"))
                if p["metadata"]["uid"] != victim["metadata"]["uid"]
            ]

        try:
            (new_ps,) = wait_for("ps-0 replaced by the PS Job", replacement, 180)
        except AssertionError as exc:  # say why: the node's 2 cores may be held by another job's pods
            states = [
                (
                    p["metadata"]["name"],
                    p.get("status", {}).get("phase"),
                    p.get("status", {}).get("conditions"),
                )
                for p in job_pods(real_cluster, ns, "psback", "ps")
            ]
            raise AssertionError(f"{exc}; the PS pods: {states}") from None
        t_pod = time.monotonic() - t0
        followers += follow_logs(ns, [new_ps], logs)  # what the replacement PS said
        assert new_ps["spec"]["hostname"] == victim["spec"]["hostname"] == "psback-ps-0"
        wait_for(
            "the coordinator restarted",
            lambda: any("coordinator resumes from" in t for t in k.widget_texts(since)),
            300,
        )
        t_resumed = time.monotonic() - t0
        r = k.wait(cell, timeout=900)
        t_end = time.monotonic() - t0
        texts = k.widget_texts(since)
        said = list(dict.fromkeys(m for t in texts for m in re.findall(r"tfdist: [^<\n]+", t)))
        print("\n" + "\n".join(said))  # the checkpoints and restarts, each with its reason
        if r.error is not None:
            for f in sorted(logs.iterdir()):  # what the coordinator pod said
                print(f"--- {f.name}\n" + "\n".join(f.read_text().splitlines()[-40:]))
        assert r.error is None, r.error_text
        assert not [line for line in said if "could not be written" in line], said
        assert [line for line in said if "coordinator resumes from the checkpoint at step" in line], said
        written = [int(m[1]) for line in said for m in [CHECKPOINT_WRITTEN.search(line)] if m]
        # each run says its first; the resumed run counts on from the restored optimizer's steps
        assert len(written) >= 2 and written == sorted(set(written)), said
        lost = [t for t in texts if "parameter server ps-0" in t]
        assert lost and "restarting it and the coordinator" in lost[-1], texts[-5:]
        back = [m for t in texts for m in re.findall(r"answer after ([0-9.]+)s", t)]
        print(
            f"\nPS pod deleted -> new PS pod running {t_pod:.1f}s, coordinator resumed {t_resumed:.1f}s "
            f"(lost -> answering again {back[-1] if back else '?'}s in the pod), cell ended {t_end:.1f}s;"
            f" ps-0 restarts shown {max(restarts_shown(texts, 'ps-0') or [0])}"
        )
        r = k.run("print('epochs', len(history.history['loss']), history.epoch)")
        assert f"epochs {EPOCHS} " in r.text and str(list(range(EPOCHS))) in r.text, r.text
        r = k.run(notebook_cells()[3])
        assert r.error is None and "weights changed: True" in r.text, r.error_text or r.text
        pods = job_pods(real_cluster, ns, "psback")
        took = wait_gone(real_cluster, ns, "psback", 60)
        print(f"cell end -> every object gone {took:.1f}s ({len(pods)} pods left at the end of the cell)")
        assert not job_pods(real_cluster, ns, "psback", "ps")
        assert kn.A_PS_RESTARTS in (new_ps["metadata"].get("annotations") or {})
    finally:
        for proc in followers:
            proc.kill()
            proc.wait()
        k.shutdown()
