"""Kubernetes jobs run by the cluster (issue 10, "Measured"), against a real local control plane with kwok GPU
nodes. Run:  python benchmarks/bench_k8s_jobs.py [--workers 1,4,16,64] [--idle 60]
(against the installed tfdist). Prints JSON and writes benchmarks/results/k8s_jobs.json.

1. API requests per job (submit + watch until running + stop) and per pod, counted the same way as
   benchmarks/bench_k8s.py, with the baseline measured in the same run on the same plane: the bare-pod
   design of before (`--baseline` commit, the last one with it), its `core/` taken from git into a
   temporary folder and run in a child process as `tfdist`, through the same `bench_k8s.bench_job`.
2. The lifeline's cost: API requests per minute of one running job while nobody watches (the background
   payload delivery's watch and the root Job's deadline renewals), over `--idle` seconds.
3. Time from a worker pod's deletion to its replacement running, with no kernel watching (the Job
   controller's work; the bare-pod design replaced a pod only while a kernel watched, and never a deleted
   one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_k8s import H100, IMAGE, RequestLog, backend_api, bench_job, linear_fit, summarize  # noqa: E402

from tests.kube_plane import ControlPlane  # noqa: E402


def _backend(plane: ControlPlane, ns: str) -> Any:
    from tfdist.backends.kubernetes import KubernetesBackend
    from tfdist.settings import from_environ

    return KubernetesBackend(
        from_environ({"TFDIST_NAMESPACE": ns, "TFDIST_WORKER_IMAGE": IMAGE, "USER": "bench"}),
        kubeconfig=plane.kubeconfig,
    )


def _pods(plane: ControlPlane, ns: str, sel: str) -> list[dict]:
    return plane.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={sel}")["items"]


def _running(pods: list[dict]) -> list[dict]:
    return [
        p
        for p in pods
        if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


async def bench_idle_and_replacement(plane: ControlPlane, log: RequestLog, ns: str, idle_s: float) -> dict:
    from tfdist.backends.base import Launch
    from tfdist.jobspec import JobSpec

    b = _backend(plane, ns)
    api = await backend_api(b)
    name = "idle"
    try:
        await b.submit(JobSpec(name=name, user="bench", workers=2, backend="kubernetes"), b"p", Launch())
        while len(_running(_pods(plane, ns, f"tfdist.io/job%3D{name}"))) < 4:
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)  # the delivery's list + watch are open
        mark = log.mark()
        t0 = time.perf_counter()
        await asyncio.sleep(idle_s)
        reqs = log.since(mark, api)
        idle = {
            "seconds": idle_s,
            "requests": summarize(reqs),
            "requests_per_minute": round(len(reqs) * 60 / (time.perf_counter() - t0), 2),
            "renewals_per_minute": round(
                sum(1 for m, p, _ in reqs if m == "PUT" and "/jobs/" in p) * 60 / (time.perf_counter() - t0),
                2,
            ),
        }
        times = []
        for _ in range(3):
            sel = (
                f"tfdist.io/job%3D{name},tfdist.io/role%3Dworker,batch.kubernetes.io/job-completion-index%3D0"
            )
            old = _running(_pods(plane, ns, sel))[0]
            t = time.perf_counter()
            plane.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{old['metadata']['name']}")
            while not [
                p for p in _running(_pods(plane, ns, sel)) if p["metadata"]["uid"] != old["metadata"]["uid"]
            ]:
                await asyncio.sleep(0.05)
            times.append(round(time.perf_counter() - t, 3))
            await asyncio.sleep(1)
        return {"idle_running_job": idle, "worker_deleted_to_replacement_running_s": times}
    finally:
        await b.stop(name)
        await b.close()


# the last commit of the bare-pod design (the next one, 3477aff, made the cluster run the job)
BARE_PODS = "3477aff^"


def measure_baseline(plane: ControlPlane, commit: str, worker_counts: list[int]) -> dict[str, Any]:
    """`bench_job` for each worker count with the backend of `commit`, on this plane, in a child process
    (its own `tfdist`: `core/` of that commit from git). Returns {"commit": full hash, "jobs": [...]}."""
    full = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", commit], capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", full, "core"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        os.rename(os.path.join(tmp, "core"), os.path.join(tmp, "tfdist"))
        env = {**os.environ, "PYTHONPATH": tmp}
        cmd = [sys.executable, __file__, "--baseline-child", plane.kubeconfig, "--workers"]
        out = subprocess.run(
            [*cmd, ",".join(map(str, worker_counts))], env=env, capture_output=True, text=True, timeout=1800
        )
    if out.returncode != 0:
        raise RuntimeError(f"the baseline ({commit}) failed:\n{out.stderr[-3000:]}")
    return {"commit": full, "jobs": json.loads(out.stdout)}


async def baseline_child(kubeconfig: str, worker_counts: list[int]) -> list[dict]:
    """In the child: the old backend's jobs, in a namespace of their own on the parent's plane."""
    import tfdist

    assert tfdist.__file__.startswith(os.environ["PYTHONPATH"]), "the baseline must run the old tfdist"
    plane = ControlPlane.__new__(ControlPlane)  # only its kubeconfig: the parent owns the plane
    plane.kubeconfig = kubeconfig
    log = RequestLog()
    log.install()
    ns = f"bench-before-{os.getpid()}"
    await asyncio.to_thread(_create_namespace, kubeconfig, ns)
    jobs = []
    for w in worker_counts:
        jobs.append(await bench_job(plane, log, ns, w))
        print(f"baseline job w={w}: {jobs[-1]['requests']['total']} requests", file=sys.stderr)
    return jobs


def _create_namespace(kubeconfig: str, ns: str) -> None:
    async def create() -> None:
        from kubernetes_asyncio import client, config

        cfg = client.Configuration()
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        async with client.ApiClient(cfg) as api:
            await client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})

    asyncio.run(create())


async def run(
    plane: ControlPlane, worker_counts: list[int], idle_s: float, baseline: str | None = BARE_PODS
) -> dict[str, Any]:
    log = RequestLog()
    log.install()
    out: dict[str, Any] = {}
    ns = await asyncio.to_thread(plane.create_namespace, "bench")
    jobs = []
    for w in worker_counts:
        jobs.append(await bench_job(plane, log, ns, w))
        print(f"job w={w}: {jobs[-1]['requests']['total']} requests", file=sys.stderr)
    out["jobs"] = jobs
    out["requests_vs_pods"] = {
        "points": [[j["pods"], j["requests"]["total"]] for j in jobs],
        "fit": linear_fit([(j["pods"], j["requests"]["total"]) for j in jobs]) if len(jobs) > 1 else None,
    }
    if baseline:
        before = await asyncio.to_thread(measure_baseline, plane, baseline, worker_counts)
        out["before_bare_pods"] = {
            "commit": before["commit"],
            "points": [[j["pods"], j["requests"]["total"]] for j in before["jobs"]],
            "fit": linear_fit([(j["pods"], j["requests"]["total"]) for j in before["jobs"]])
            if len(before["jobs"]) > 1
            else None,
            "jobs": before["jobs"],
        }
    out.update(await bench_idle_and_replacement(plane, log, ns, idle_s))
    return out


def _private_agent_port() -> None:
    """kwok pod IPs (10.244.0.0/16) may belong to real pods of this machine's one-node cluster: use an
    agent port nothing serves (as the tests do)."""
    import socket

    from tfdist.kube import names as kn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        kn.AGENT_PORT = s.getsockname()[1]


def main() -> None:
    _private_agent_port()
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="1,4,16,64")
    ap.add_argument("--idle", type=float, default=60.0)
    ap.add_argument(
        "--baseline", default=BARE_PODS, help="commit of the design to compare with ('' for none)"
    )
    ap.add_argument("--baseline-child", metavar="KUBECONFIG", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "k8s_jobs.json"))
    args = ap.parse_args()
    workers = [int(x) for x in args.workers.split(",") if x]
    if args.baseline_child:
        print(json.dumps(asyncio.run(baseline_child(args.baseline_child, workers))))
        return
    plane = ControlPlane()
    try:
        plane.start()
        plane.add_gpu_nodes(10, 8, H100)
        result = asyncio.run(run(plane, workers, args.idle, args.baseline or None))
    finally:
        plane.stop()
    result["machine"] = machine()
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
