"""Kubernetes jobs run by the cluster (issue 10, "Measured"), against a real local control plane with kwok GPU
nodes. Run:  python benchmarks/bench_k8s_jobs.py [--workers 1,4,16,64] [--idle 60]
(against the installed tfdist). Prints JSON and writes benchmarks/results/k8s_jobs.json.

1. API requests per job (submit + watch until running + stop) and per pod, counted the same way as
   benchmarks/bench_k8s.py (whose results/k8s.json holds the same numbers for the bare-pod design before).
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
import sys
import time
from pathlib import Path
from typing import Any

from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_k8s import H100, IMAGE, RequestLog, bench_job, linear_fit, summarize  # noqa: E402

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
    api = await b.api()
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


async def run(plane: ControlPlane, worker_counts: list[int], idle_s: float) -> dict[str, Any]:
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
    before = json.loads((REPO / "benchmarks" / "results" / "k8s.json").read_text())
    out["before_bare_pods"] = {
        "points": before["requests_vs_pods"]["points"],
        "fit": before["requests_vs_pods"]["fit"],
    }
    out.update(await bench_idle_and_replacement(plane, log, ns, idle_s))
    return out


def _private_agent_port() -> None:
    """kwok pod IPs (10.244.0.0/16) may belong to real pods of this machine's one-node cluster: use an
    agent port nothing serves (as the tests do)."""
    import socket

    from tfdist.kube import manifests as mf

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mf.AGENT_PORT = s.getsockname()[1]


def main() -> None:
    _private_agent_port()
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="1,4,16,64")
    ap.add_argument("--idle", type=float, default=60.0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "k8s_jobs.json"))
    args = ap.parse_args()
    plane = ControlPlane()
    try:
        plane.start()
        plane.add_gpu_nodes(10, 8, H100)
        result = asyncio.run(run(plane, [int(x) for x in args.workers.split(",") if x], args.idle))
    finally:
        plane.stop()
    result["machine"] = machine()
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
