"""Kubernetes benchmarks against a real local control plane with kwok GPU nodes (issue 4, "Performance").

Run:  python benchmarks/bench_k8s.py [--nodes 100,300,1000] [--workers 1,4,16,64]
      (against the installed tfdist; needs the binaries of scripts/build-k8s). Prints JSON and writes
      benchmarks/results/k8s.json.

What it measures (targets from the issue):
1. The spawn form's GPU availability from the shared, watch-fed ClusterGpuView at 100/300/1,000 kwok nodes
   with 8 GPUs each (half H100, half A100 40GB): the view's initial sync (list + watch of nodes and pods),
   the time of one availability read (target < 200 ms; a cold read recomputes from the cache, a warm one
   hits the per-change memo) and the API requests the reads make (target: none; the view's own
   list+watch requests are reported apart). Node creation time is reported too.
2. A 64-worker job (2 PS, 1 GPU per worker): time for KubernetesBackend.submit to create all objects
   (target < 2 s) and time until all its pods are scheduled / all running, from the backend's watch.
3. API requests per job (submit + watch until running + stop) for several worker counts.

Requests are counted by wrapping kubernetes_asyncio's ApiClient.request (every REST call and every watch
goes through it), per ApiClient instance, so the view's and the backend's requests are told apart.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import statistics
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.kube_plane import ControlPlane, node_usable  # noqa: E402

H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-40GB"  # hub_config/profiles.yaml's "a100"
IMAGE = "example.org/tfdist-job:1"


# ------------------------------------------------------------------------------------ request counting


class RequestLog:
    """Every HTTP request a kubernetes_asyncio ApiClient makes: (client id, method, path, is_watch)."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, str, str, bool]] = []

    def install(self) -> None:
        from kubernetes_asyncio.client import ApiClient

        original = ApiClient.request
        entries = self.entries

        def request(client: Any, method: str, url: str, query_params: Any = None, *a: Any, **kw: Any):
            q = dict(query_params or [])
            path = urllib.parse.urlsplit(url).path
            entries.append((id(client), method, path, str(q.get("watch", "")).lower() == "true"))
            return original(client, method, url, query_params, *a, **kw)

        ApiClient.request = request  # type: ignore[method-assign]

    def mark(self) -> int:
        return len(self.entries)

    def since(self, mark: int, client: Any) -> list[tuple[str, str, bool]]:
        return [(m, p, w) for c, m, p, w in self.entries[mark:] if c == id(client)]


def summarize(reqs: list[tuple[str, str, bool]]) -> dict[str, Any]:
    kinds: collections.Counter[str] = collections.Counter()
    for method, path, is_watch in reqs:
        parts = path.rstrip("/").split("/")
        # .../namespaces/<ns>/<resource>[/<name>] -> resource, named or collection
        res = parts[-1]
        if "namespaces" in parts:
            i = parts.index("namespaces")
            rest = parts[i + 2 :]
            res = (rest[0] + ("/<name>" if len(rest) > 1 else "")) if rest else "namespaces"
        kinds[f"{'WATCH' if is_watch else method} {res}"] += 1
    return {
        "total": len(reqs),
        "watches": sum(1 for r in reqs if r[2]),
        "by_kind": dict(sorted(kinds.items())),
    }


# ------------------------------------------------------------------------------------------- nodes


def create_nodes(plane: ControlPlane, count: int, start_index: int, threads: int = 16) -> float:
    """`count` kwok nodes with 8 GPUs (alternating H100 / A100 40GB), POSTed from `threads` threads."""
    chunks = []
    per = max(1, (count + threads - 1) // threads)
    left, i = count, 0
    while left > 0:
        n = min(per, left)
        for model in (H100, A100):
            m = n // 2 if model == H100 else n - n // 2
            if m:
                chunks.append((m, model, f"kwok-{'h100' if model == H100 else 'a100'}-s{start_index}-c{i}"))
        left -= n
        i += 1
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futs = [
            pool.submit(plane.add_gpu_nodes, m, 8, model, name_prefix=prefix, wait=False)
            for m, model, prefix in chunks
        ]
        for f in futs:
            f.result()
    return time.monotonic() - t0


def usable_nodes(plane: ControlPlane) -> int:
    nodes = plane.request("GET", "/api/v1/nodes?labelSelector=type%3Dkwok", timeout=60)["items"]
    return sum(node_usable(node) for node in nodes)


def wait_usable(plane: ControlPlane, want: int, timeout: float = 300) -> float:
    t0 = time.monotonic()
    while True:
        have = usable_nodes(plane)
        if have >= want:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"only {have}/{want} kwok nodes Ready and untainted after {timeout}s")
        time.sleep(1)


# ------------------------------------------------------------------------------------ 1. availability


async def api_client(plane: ControlPlane) -> Any:
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=plane.kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)


async def bench_view(plane: ControlPlane, log: RequestLog, n_nodes: int) -> dict[str, Any]:
    from kubernetes_asyncio import client

    from tfdist.spawner.availability import ClusterGpuView
    from tfdist.spawner.profiles import load_profiles

    models = load_profiles(REPO / "hub_config" / "profiles.yaml").gpu_models
    api = await api_client(plane)
    view = ClusterGpuView(client.CoreV1Api(api))
    try:
        mark = log.mark()
        t0 = time.perf_counter()
        view.start()
        while not view.loaded:
            await asyncio.sleep(0.005)
        sync_s = time.perf_counter() - t0
        sync_reqs = log.since(mark, api)
        await asyncio.sleep(0.5)  # let the watches open (so they are not counted as the reads' requests)

        mark = log.mark()
        cold, warm = [], []
        for _ in range(50):
            view._version += 1  # as after a cluster change: the memo is stale, the read recomputes
            t = time.perf_counter()
            av = view.availability(models)
            cold.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            view.availability(models)
            warm.append((time.perf_counter() - t) * 1000)
        read_reqs = [r for r in log.since(mark, api) if not r[2]]  # watch re-opens are not the reads'
        assert av is not None
        cold.sort()
        return {
            "nodes_in_view": len(view.nodes),
            "gpu_pods_in_view": len(view.pods),
            "initial_sync_s": round(sync_s, 3),
            "initial_sync_requests": summarize(sync_reqs),
            "read_cold_ms_median": round(statistics.median(cold), 3),
            "read_cold_ms_max": round(max(cold), 3),
            "read_warm_ms_median": round(statistics.median(warm), 4),
            "reads": 100,
            "api_requests_during_reads": len(read_reqs),
            "target_ms": 200,
            "cold_read_vs_target": round(statistics.median(cold) / 200, 4),
            "availability": {k: {"free": v.free, "total": v.total} for k, v in av.items()},
            "expected_gpus_total": n_nodes * 8,
        }
    finally:
        await view.stop()
        await api.close()


# ---------------------------------------------------------------------------------------- 2 + 3. jobs


async def bench_job(plane: ControlPlane, log: RequestLog, ns: str, workers: int) -> dict[str, Any]:
    from tfdist.backends.base import Launch
    from tfdist.backends.kubernetes import KubernetesBackend
    from tfdist.jobspec import JobSpec
    from tfdist.settings import from_environ

    b = KubernetesBackend(
        from_environ({"TFDIST_NAMESPACE": ns, "TFDIST_WORKER_IMAGE": IMAGE, "USER": "bench"}),
        kubeconfig=plane.kubeconfig,
    )
    b.node_selector = {"nvidia.com/gpu.product": H100}
    name = f"w{workers}"
    ps = 2 if workers >= 16 else 1
    spec = JobSpec(
        name=name,
        user="bench",
        workers=workers,
        ps=ps,
        gpus_per_worker=1,
        backend="kubernetes",
        namespace=ns,
        image=IMAGE,
        timeout_s=300,
    )
    api = await backend_api(b)  # created before counting starts: its config load makes no request
    try:
        m0 = log.mark()
        t0 = time.perf_counter()
        await b.submit(spec, b"payload", Launch())
        submit_s = time.perf_counter() - t0
        m1 = log.mark()
        nodes: dict[str, str] = {}
        scheduled_s = running_s = None
        events = 0
        gen = b.watch(name)
        try:
            async with asyncio.timeout(300):
                async for ev in gen:
                    events += 1
                    if ev.type == "task" and ev.node:
                        nodes[str(ev.task)] = ev.node
                        if scheduled_s is None and len(nodes) == spec.task_count:
                            scheduled_s = time.perf_counter() - t0
                    if ev.type == "state" and ev.state == "running":
                        running_s = time.perf_counter() - t0
                        break
                    if ev.type == "state" and ev.state in ("failed", "stopped"):
                        raise RuntimeError(f"job {name} ended: {ev}")
        finally:
            await gen.aclose()
        m2 = log.mark()
        t = time.perf_counter()
        await b.stop(name)
        stop_s = time.perf_counter() - t
        m3 = log.mark()
        submit_r = [(mm, p, w) for c, mm, p, w in log.entries[m0:m1] if c == id(api)]
        watch_r = [(mm, p, w) for c, mm, p, w in log.entries[m1:m2] if c == id(api)]
        stop_r = [(mm, p, w) for c, mm, p, w in log.entries[m2:m3] if c == id(api)]
        return {
            "workers": workers,
            "ps": ps,
            "pods": spec.task_count,
            "submit_s": round(submit_s, 3),
            "all_pods_scheduled_s": round(scheduled_s, 3) if scheduled_s is not None else None,
            "all_pods_running_s": round(running_s, 3) if running_s is not None else None,
            "stop_s": round(stop_s, 3),
            "watch_events": events,
            "distinct_nodes": len(set(nodes.values())),
            "requests": {
                "submit": summarize(submit_r),
                "watch_until_running": summarize(watch_r),
                "stop": summarize(stop_r),
                "total": len(submit_r) + len(watch_r) + len(stop_r),
            },
        }
    finally:
        await b.close()


async def backend_api(b: Any) -> Any:
    """The backend's own ApiClient (the one its requests go through): `b.kube.api()` since the backend's
    API calls moved to tfdist.kube.cluster, `b.api()` in the bare-pod design the baseline runs."""
    return await (b.kube.api() if hasattr(b, "kube") else b.api())


def linear_fit(points: list[tuple[int, int]]) -> dict[str, float]:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points) or 1
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return {"requests_per_pod": round(slope, 3), "fixed_requests": round(my - slope * mx, 3)}


# -------------------------------------------------------------------------------------------- main


async def run(plane: ControlPlane, node_steps: list[int], worker_counts: list[int]) -> dict[str, Any]:
    log = RequestLog()
    log.install()
    out: dict[str, Any] = {"availability": [], "node_creation": []}
    have = 0
    for target in node_steps:
        add = target - have
        if add > 0:
            post_s = await asyncio.to_thread(create_nodes, plane, add, have)
            ready_s = await asyncio.to_thread(wait_usable, plane, target)
            out["node_creation"].append(
                {"added": add, "total": target, "post_s": round(post_s, 2), "then_ready_s": round(ready_s, 2)}
            )
            have = target
        out["availability"].append({"nodes": target, **await bench_view(plane, log, target)})
        cold = out["availability"][-1]["read_cold_ms_median"]
        print(f"{target} nodes: cold availability read {cold} ms", file=sys.stderr)

    ns = await asyncio.to_thread(plane.create_namespace, "bench")
    jobs = []
    for w in worker_counts:
        jobs.append(await bench_job(plane, log, ns, w))
        print(f"job w={w}: {jobs[-1]['requests']['total']} requests", file=sys.stderr)
    out["jobs"] = jobs
    out["requests_vs_pods"] = {
        "points": [[j["pods"], j["requests"]["total"]] for j in jobs],
        "fit": linear_fit([(j["pods"], j["requests"]["total"]) for j in jobs]) if len(jobs) > 1 else None,
        "watch_requests_per_job": [j["requests"]["watch_until_running"]["watches"] for j in jobs],
    }
    big = max(jobs, key=lambda j: j["workers"]) if jobs else None
    if big:
        out["job_targets"] = {
            "workers": big["workers"],
            "submit_s": big["submit_s"],
            "submit_vs_2s_target": round(big["submit_s"] / 2.0, 3),
            "all_pods_scheduled_s": big["all_pods_scheduled_s"],
            "all_pods_running_s": big["all_pods_running_s"],
        }
    # the view again with the cluster as it is now (the jobs are stopped; their pods may still be going)
    out["availability_after_jobs"] = {"nodes": have, **await bench_view(plane, log, have)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="100,300,1000")
    ap.add_argument("--workers", default="1,4,16,64")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "k8s.json"))
    args = ap.parse_args()
    node_steps = [int(x) for x in args.nodes.split(",") if x]
    worker_counts = [int(x) for x in args.workers.split(",") if x]

    plane = ControlPlane()
    try:
        plane.start()
        result: dict[str, Any] = {"plane_start_s": round(plane.start_seconds or 0, 2)}
        result.update(asyncio.run(run(plane, node_steps, worker_counts)))
    finally:
        plane.stop()
    result["machine"] = machine()
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
