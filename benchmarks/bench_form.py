"""Spawn-form benchmarks: render + validation per request, and GPU availability for a big cluster.

Run:  python benchmarks/bench_form.py   (against the installed tfdist) -> benchmarks/results/form.json
Goal (issue 3): render under 50 ms, and one cached cluster view shared by all users instead of a list call
per request. The cluster is generated in the shape of recorded API objects: 1,000 nodes (4 GPU models,
some cordoned/tainted) and 10,000 pods (GPU and CPU pods, init containers, finished pods).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

from tfdist.spawner.availability import ClusterGpuView, gpu_availability
from tfdist.spawner.form import render_form
from tfdist.spawner.profiles import load_profiles
from tfdist.spawner.validation import UserContext, validate_options

REPO = Path(__file__).resolve().parent.parent
PRODUCTS = {
    "h100": "NVIDIA-H100-80GB-HBM3",
    "a100": "NVIDIA-A100-SXM4-40GB",
}


def timeit(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    """Median and p95 in milliseconds."""
    fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.95) - 1]


def make_cluster(n_nodes: int = 1000, n_pods: int = 10_000, seed: int = 3) -> tuple[list[dict], list[dict]]:
    rnd = random.Random(seed)
    nodes = []
    for i in range(n_nodes):
        kind = rnd.choice(["h100", "a100", "mig", "cpu"])
        labels = {
            "kubernetes.io/hostname": f"node-{i:04d}",
            "node.kubernetes.io/instance-type": f"type-{kind}",
            "topology.kubernetes.io/zone": f"zone-{i % 3}",
        }
        alloc = {"cpu": "96", "memory": "1056947576Ki", "pods": "110", "ephemeral-storage": "900Gi"}
        taints = []
        if kind in PRODUCTS:
            labels["nvidia.com/gpu.product"] = PRODUCTS[kind]
            alloc["nvidia.com/gpu"] = "8"
            taints.append({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"})
        elif kind == "mig":
            labels["nvidia.com/mig.config"] = "all-1g.10gb"
            alloc["nvidia.com/mig-1g.10gb"] = "56"
            taints.append({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"})
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": f"node-{i:04d}",
                    "uid": f"uid-{i}",
                    "resourceVersion": str(1000 + i),
                    "labels": labels,
                    "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                },
                "spec": {
                    "podCIDR": f"10.{i // 250}.{i % 250}.0/24",
                    "taints": taints,
                    "unschedulable": rnd.random() < 0.02,
                },
                "status": {
                    "capacity": dict(alloc),
                    "allocatable": alloc,
                    "conditions": [
                        {"type": "MemoryPressure", "status": "False"},
                        {"type": "Ready", "status": "True" if rnd.random() > 0.01 else "False"},
                    ],
                    "nodeInfo": {"kubeletVersion": "v1.36.3", "containerRuntimeVersion": "containerd://2.1"},
                },
            }
        )
    pods = []
    for j in range(n_pods):
        nd = nodes[rnd.randrange(n_nodes)]
        res: dict[str, Any] = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
        a = nd["status"]["allocatable"]
        if "nvidia.com/gpu" in a and rnd.random() < 0.5:
            res["limits"]["nvidia.com/gpu"] = str(rnd.choice([1, 1, 2]))
        elif "nvidia.com/mig-1g.10gb" in a and rnd.random() < 0.5:
            res["limits"]["nvidia.com/mig-1g.10gb"] = "1"
        pods.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"pod-{j:05d}",
                    "namespace": f"ns-{j % 40}",
                    "uid": f"p-{j}",
                    "labels": {"app": "train", "component": "worker"},
                    "resourceVersion": str(5000 + j),
                },
                "spec": {
                    "nodeName": nd["metadata"]["name"] if rnd.random() > 0.03 else None,
                    "containers": [
                        {"name": "main", "image": "img:1", "resources": res},
                        {
                            "name": "sidecar",
                            "image": "side:1",
                            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                        },
                    ],
                    "initContainers": [{"name": "init", "image": "init:1", "resources": {}}],
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                },
                "status": {
                    "phase": rnd.choice(["Running"] * 8 + ["Pending", "Succeeded"]),
                    "podIP": f"10.0.{j // 250}.{j % 250}",
                },
            }
        )
    return nodes, pods


def main() -> None:
    fig: dict[str, Any] = {}  # every printed figure, written to results/form.json with the machine
    cfg = load_profiles(REPO / "hub_config" / "profiles.yaml")
    models = cfg.gpu_models
    nodes, pods = make_cluster()
    print(
        f"cluster: {len(nodes)} nodes, {len(pods)} pods; profiles: {len(cfg.profiles)}, models: {len(models)}"
    )

    med, p95 = timeit(lambda: gpu_availability(nodes, pods, models), 20)
    fig["availability_uncached_ms"] = {"median": med, "p95": p95}
    print(f"availability from raw API objects (no cache):        median {med:7.2f} ms  p95 {p95:7.2f} ms")

    view = ClusterGpuView(api=None)
    t = time.perf_counter()
    for n in nodes:
        view.apply_node("ADDED", n)
    for p in pods:
        view.apply_pod("ADDED", p)
    view._loaded = {"nodes": True, "pods": True}
    fig["cluster_view_initial_load_ms"] = (time.perf_counter() - t) * 1000
    print(
        f"cluster view initial load (11,000 ADDED events): {fig['cluster_view_initial_load_ms']:7.2f} ms once"
    )
    med, p95 = timeit(lambda: view.availability(models), 2000)
    fig["availability_cached_us"] = {"median": med * 1000, "p95": p95 * 1000}
    print(
        f"availability per request, cached, no change: median {med * 1000:7.2f} us  p95 {p95 * 1000:7.2f} us"
    )
    gpu_pods = [
        p
        for p in pods
        if p["spec"]["nodeName"]
        and p["status"]["phase"] != "Succeeded"
        and len(p["spec"]["containers"][0]["resources"]["limits"]) > 1
    ]
    k = [0]

    def after_event() -> None:  # a GPU pod finishes or comes back: the cache must recompute
        k[0] += 1
        p = gpu_pods[k[0] % len(gpu_pods)]
        phase = "Succeeded" if (k[0] // len(gpu_pods)) % 2 == 0 else "Running"
        view.apply_pod("MODIFIED", {**p, "status": {"phase": phase}})
        view.availability(models)

    med, p95 = timeit(after_event, 200)
    fig["availability_after_pod_event_ms"] = {"median": med, "p95": p95}
    print(f"availability after one pod event (recompute):        median {med:7.2f} ms  p95 {p95:7.2f} ms")

    av = view.availability(models)
    ctx = UserContext(
        groups=frozenset({"ml-team", "ml-admins"}),
        gpus_held_elsewhere=1,
        free_gpus={key: a.free for key, a in (av or {}).items()},
    )
    last = {
        "profile": "gpu",
        "cpu": 8,
        "memory": 64,
        "gpus": 1,
        "gpu_model": "a100",
        "image": "quay.io/jupyter/tensorflow-notebook:cuda-2026-06-01",
    }
    med, p95 = timeit(lambda: render_form(cfg, ctx, av, remembered=(last,)), 500)
    size = len(render_form(cfg, ctx, av, remembered=(last,)))
    fig["form_render_ms"] = {"median": med, "p95": p95, "html_kib": size // 1024}
    print(f"form render ({size // 1024} KiB of HTML): median {med:7.3f} ms  p95 {p95:7.3f} ms")
    form = {
        "profile": "gpu",
        "cpu": "8",
        "memory": "64",
        "gpus": "1",
        "gpu_model": "a100",
        "image": "registry.example.org/ml/tf-custom:2.21",
    }
    med, p95 = timeit(lambda: validate_options(form, cfg, ctx), 5000)
    fig["validation_us"] = {"median": med * 1000, "p95": p95 * 1000}
    print(f"validation of one form POST: median {med * 1000:7.2f} us  p95 {p95 * 1000:7.2f} us")
    out = REPO / "benchmarks" / "results" / "form.json"
    rounded = json.loads(json.dumps(fig), parse_float=lambda x: round(float(x), 3))
    out.write_text(
        json.dumps(
            {"machine": machine(), "cluster": {"nodes": len(nodes), "pods": len(pods)}, **rounded}, indent=2
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
