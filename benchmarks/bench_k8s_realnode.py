"""The example's job on the one-machine cluster's real node vs the local backend (issue 8, "Measured").

Run as root with the cluster up (`eval "$(sudo scripts/cluster up)"`; this script never takes it down):
    python benchmarks/bench_k8s_realnode.py [--repeat 1]
Prints JSON and writes benchmarks/results/k8s_realnode.json.

The same cell (`examples/digits.ipynb`'s `%%tfdist run --workers 2 --ps 1`, 8 epochs of 40 steps, with
`--cpu 0.45 --memory 1536Mi` so that four pods fit the node's two cores) runs in a real host kernel, once
with the Kubernetes backend (a user namespace prepared by the spawner's code, the kernel acting as the
user's notebook service account) and once with the local backend. Measured: cell start -> end of the
first epoch, and the cell's whole time, for both (ratio), plus the Kubernetes breakdown:

  create     cell start -> the root Job exists (the magic packed the payload, the backend created the Jobs)
  scheduled  -> every pod of the job bound to the node
  running    -> every pod's container running (image present: no pull)
  payload    -> the payload handed to the coordinator pod's agent (the kernel reads the agent's events
                only after that: their first one arrives then)
  coordinator-> the coordinator process started with the payload (TensorFlow imported)
  servers    -> the coordinator connected to every TF server (its "loading" phase: TF servers ready)
  fit start  -> the cell's fit began (the model and data rebuilt in the coordinator)
  first step -> the first training step counted (the coordinator's heartbeat, every 2 s: an epoch shorter
                than that counts its end)
  epoch 1    -> the end of the first epoch

Pod times come from polling the API server every 0.2 s from the host; the coordinator's phases from the
events the kernel received (its JobView.apply, wrapped in this kernel only; steps and epochs carry the
coordinator's own clock, which is this machine's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import realnode  # noqa: E402
from tests.realnode_fixtures import RealCluster  # noqa: E402
from tests.realnode_jobs import (  # noqa: E402
    build_job_image,
    digits_kernel,
    drop_tenant,
    job_pods,
    make_tenant,
    run_line,
    start_notebook_pod,
    wait_gone,
)

RECORD = """
import json as _j, time as _t
from tfdist import jobview as _jv
_bench_events = []
if not hasattr(_jv.JobView, "_bench_orig"):
    _jv.JobView._bench_orig = _jv.JobView.apply
    def _bench_apply(self, ev, _orig=_jv.JobView._bench_orig):
        if ev.get("type") in ("progress", "task", "state"):
            _bench_events.append([_t.time(), {k: ev[k] for k in ("type", "phase", "epoch", "step", "t",
                                                                   "task", "state") if k in ev}])
        return _orig(self, ev)
    _jv.JobView.apply = _bench_apply
"""


def kernel_events(k: Any) -> list[tuple[float, dict]]:
    r = k.run("print(_j.dumps(_bench_events))", timeout=60)
    assert r.error is None, r.error_text
    return [(t, ev) for t, ev in json.loads(r.text.strip().splitlines()[-1])]


def phases(events: list[tuple[float, dict]], t0: float) -> dict[str, float | None]:
    """Seconds from the cell's start to the coordinator's milestones (first occurrence)."""

    def first(pred) -> float | None:
        for t, ev in events:
            if pred(ev):
                return round(ev.get("t", t) - t0, 2)
        return None

    prog = "progress"
    out = {
        "tasks_running": None,
        "payload": first(lambda e: e["type"] == prog and e.get("phase") == "waiting for the payload"),
        "coordinator": first(lambda e: e["type"] == prog and e.get("phase") == "connecting"),
        "servers": first(lambda e: e["type"] == prog and e.get("phase") == "loading"),
        "fit_start": first(lambda e: e["type"] == prog and e.get("phase") == "fit"),
        "first_step": first(lambda e: e["type"] == prog and (e.get("step") or 0) > 0 and "t" in e),
        "epoch_1": first(lambda e: e["type"] == prog and (e.get("epoch") or 0) >= 1 and "t" in e),
        "cell": None,
    }
    # the heartbeat reads the step counter every 2 s: an epoch shorter than that shows its steps after it
    if out["first_step"] is not None and out["epoch_1"] is not None:
        out["first_step"] = min(out["first_step"], out["epoch_1"])
    return out


class PodClock(threading.Thread):
    """When (host time) the root Job appeared, and every pod of the job was scheduled / running."""

    def __init__(self, cluster: RealCluster, ns: str, job: str, pods: int = 4):
        super().__init__(daemon=True)
        self.cluster, self.ns, self.job, self.n = cluster, ns, job, pods
        self.times: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and "running" not in self.times:
            now = time.time()
            if "create" not in self.times and self.cluster.get(
                f"/apis/batch/v1/namespaces/{self.ns}/jobs/{self.job}"
            ):
                self.times["create"] = now
            pods = job_pods(self.cluster, self.ns, self.job)
            if len(pods) >= self.n:
                if "scheduled" not in self.times and all(p["spec"].get("nodeName") for p in pods):
                    self.times["scheduled"] = now
                if all((p.get("status") or {}).get("phase") == "Running" for p in pods):
                    self.times["running"] = now
            time.sleep(0.2)


def run_cell(k: Any, line: str, clock: PodClock | None = None) -> dict[str, Any]:
    k.run(RECORD, timeout=60)
    if clock:
        clock.start()
    t0 = time.time()
    r = k.run(line, timeout=1200)
    cell = time.time() - t0
    if clock:
        clock.stop.set()
    assert r.error is None, r.error_text
    out = phases(kernel_events(k), t0)
    out["cell"] = round(cell, 2)
    evs = kernel_events(k)
    running = [t for t, e in evs if e["type"] == "task" and e.get("state") == "running"]
    out["tasks_running"] = round(max(running) - t0, 2) if running else None
    if clock:
        for key, t in clock.times.items():
            out[f"k8s_{key}"] = round(t - t0, 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if not realnode.status()["healthy"]:
        print('the cluster is not up: eval "$(sudo scripts/cluster up)"', file=sys.stderr)
        return 2
    cluster = RealCluster().ensure()
    image = build_job_image()
    work = Path(tempfile.mkdtemp(prefix="bench-realnode-"))
    tenant = make_tenant(cluster, "bench", work)
    results: dict[str, list] = {"kubernetes": [], "local": []}
    try:
        start_notebook_pod(cluster, tenant)
        k = digits_kernel(tenant, image, work)
        try:
            for i in range(args.repeat):
                name = f"bench-{i}"
                clock = PodClock(cluster, tenant.namespace, name)
                results["kubernetes"].append(run_cell(k, run_line(name), clock))
                wait_gone(cluster, tenant.namespace, name, 120)
                local = run_line(f"local-{i}").replace("%%tfdist run", "%%tfdist run --backend local", 1)
                results["local"].append(run_cell(k, local))
        finally:
            k.shutdown()
    finally:
        drop_tenant(cluster, tenant)

    def best(rows: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return min(vals) if vals else None

    k8s_epoch, local_epoch = best(results["kubernetes"], "epoch_1"), best(results["local"], "epoch_1")
    summary = {
        "cell_start_to_first_epoch_s": {"kubernetes": k8s_epoch, "local": local_epoch},
        "ratio_first_epoch": round(k8s_epoch / local_epoch, 2) if k8s_epoch and local_epoch else None,
        "cell_s": {
            "kubernetes": best(results["kubernetes"], "cell"),
            "local": best(results["local"], "cell"),
        },
        "runs": results,
        "job": "examples/digits.ipynb: 1 PS, 2 workers, 8 epochs x 40 steps; --cpu 0.45 --memory 1536Mi",
        "machine": machine(),  # read from the machine; the node is this machine (containerd + runc)
    }
    text = json.dumps(summary, indent=1)
    print(text)
    out = REPO / "benchmarks" / "results" / "k8s_realnode.json"
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
