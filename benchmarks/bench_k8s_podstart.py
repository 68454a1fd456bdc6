"""When the pods of a `%%tfdist run --backend kubernetes` job exist, are bound and run, from the cell's start
(issue 26: what of the pods' start-up is ours).

Run as root under the real node's lock, with the cluster up (this script never takes it down):
    flock /run/lock/tfdist-dev-realnode.lock python benchmarks/bench_k8s_podstart.py [--repeat 3]
Prints JSON (`--out FILE` also writes it).

The job is bench_k8s_realnode's cell (1 PS + 2 workers, every pod `--cpu 0.45 --memory 1536Mi`), cut to one
short epoch: what is measured ends when the last pod runs. Per pod, from the API server's own records
(which the machine's load distorts less than the kernel's wall time): its creationTimestamp, its
PodScheduled and its Ready condition (no readiness probe: the container runs), each in seconds from the
cell's start. Those have one-second resolution, so `bound` is the scheduler's Scheduled event (to the
microsecond) and `seen_*` the first poll of the pods (every 0.1 s) that saw each. Per run: the first and
the last pod of each; `bound_spread`, how far apart the first and the last pod were bound (created); when
the backend's submit began and returned (the kernel's clock: the checks and our API calls); the end of the
first epoch. Medians over the runs, after one job per kernel that is not counted (it builds the backend).

`--baseline DIR` compares two versions in the same session: a second kernel imports `tfdist` from DIR (a
copy of the installed package with another version's modules, e.g. the submit path of an earlier commit:
`git show REV:core/backends/kubesubmit.py > DIR/tfdist/backends/kubesubmit.py`), and each repeat runs
the job once in each kernel, alternating which goes first; `ratios` are the baseline's medians over these.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import bench_k8s_realnode as brk
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
    start_notebook_pod,
    wait_gone,
)

POLL_S = 0.1


def stamp(text: str | None) -> float | None:
    """An API server timestamp (RFC 3339, seconds) as epoch seconds."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else None


def condition(pod: dict[str, Any], kind: str) -> float | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind and c.get("status") == "True":
            return stamp(c.get("lastTransitionTime"))
    return None


class PodRecorder(threading.Thread):
    """Each pod of a job as last seen with the condition times it ever had (a pod's Ready goes False again
    when its container ends, and the pods are gone soon after the cell), and when a poll first saw it."""

    def __init__(self, cluster: RealCluster, ns: str, job: str):
        super().__init__(daemon=True)
        self.cluster, self.ns, self.job = cluster, ns, job
        self.pods: dict[str, dict[str, float | str | None]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.time()
            for p in job_pods(self.cluster, self.ns, self.job):
                name = p["metadata"]["name"]
                rec = self.pods.setdefault(name, {"role": p["metadata"]["labels"].get("tfdist.io/role")})
                rec.setdefault("created", stamp(p["metadata"].get("creationTimestamp")))
                rec.setdefault("seen", now)
                for key, kind in (("scheduled", "PodScheduled"), ("ready", "Ready")):
                    if rec.get(key) is None and (t := condition(p, kind)) is not None:
                        rec[key], rec[f"seen_{key}"] = t, now
            time.sleep(POLL_S)


# in the kernel: when the backend's submit (the checks and every API call up to the last Job's resume) began
# and returned, for either version (the method is looked up on the class at each call)
SUBMIT_CLOCK = """
from tfdist.backends import kubesubmit as _ks
_submit_times = []
if not hasattr(_ks.KubeSubmit, "_bench_submit"):
    _ks.KubeSubmit._bench_submit = _ks.KubeSubmit.submit
    async def _timed_submit(self, *a, **k):
        t = _t.time()
        try:
            return await _ks.KubeSubmit._bench_submit(self, *a, **k)
        finally:
            _submit_times.append([t, _t.time()])
    _ks.KubeSubmit.submit = _timed_submit
_submit_times.clear()
"""


def bound_at(cluster: RealCluster, ns: str, pods: list[str]) -> dict[str, float]:
    """When the scheduler bound each pod, to the microsecond: its Scheduled event's eventTime (the events
    API keeps them after the pods are gone). A pod is bound within milliseconds of its creation on this
    one-node cluster, so these show how far apart the pods were created."""
    out = {}
    for ev in (cluster.get(f"/apis/events.k8s.io/v1/namespaces/{ns}/events") or {"items": []})["items"]:
        name = (ev.get("regarding") or {}).get("name")
        if ev.get("reason") == "Scheduled" and name in pods and ev.get("eventTime"):
            out[name] = datetime.fromisoformat(ev["eventTime"].replace("Z", "+00:00")).timestamp()
    return out


def one_run(k: Any, cluster: RealCluster, ns: str, name: str) -> dict[str, Any]:
    for code in (brk.RECORD, SUBMIT_CLOCK):
        r = k.run(code, timeout=60)
        assert r.error is None, r.error_text
    rec = PodRecorder(cluster, ns, name)
    rec.start()
    t0 = time.time()
    r = k.run(brk.cell(name), timeout=1200)
    rec.stop.set()
    rec.join()
    assert r.error is None, r.error_text
    ends = brk.kernel_value(k, "ends")
    (began, returned), *_ = brk.kernel_value(k, "_submit_times")
    for name_, t in bound_at(cluster, ns, list(rec.pods)).items():
        rec.pods[name_]["bound"] = t
    pods = {n: {key: (round(v - t0, 2) if isinstance(v, float) else v) for key, v in p.items()}
            for n, p in sorted(rec.pods.items())}  # fmt: skip
    out: dict[str, Any] = {"submit_began": round(began - t0, 3), "submit_returned": round(returned - t0, 3)}
    for key in ("created", "bound", "scheduled", "ready", "seen", "seen_scheduled", "seen_ready"):
        vals = [p[key] for p in pods.values() if p.get(key) is not None]
        if len(vals) == len(pods) and vals:
            out[f"first_{key}"], out[f"last_{key}"] = min(vals), max(vals)
    if "last_bound" in out:
        out["bound_spread"] = round(out["last_bound"] - out["first_bound"], 3)
    out["epoch_1"] = round(ends[0] - t0, 2)
    out["pods"] = pods
    return out


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k in runs[0] if k != "pods"] if runs else []
    out = {}
    for key in keys:
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            out[key] = round(statistics.median(vals), 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="steps of the one epoch")
    ap.add_argument("--note", default="", help="what this run measures (e.g. before or after a cut)")
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--baseline", default="", help="a folder holding the tfdist package to compare with")
    args = ap.parse_args()
    brk.EPOCHS, brk.STEPS = 1, args.steps
    if not realnode.status()["healthy"]:
        print('the cluster is not up: eval "$(sudo scripts/cluster up)"', file=sys.stderr)
        return 2
    cluster = RealCluster().ensure()
    image = build_job_image()
    work = Path(tempfile.mkdtemp(prefix="bench-podstart-"))
    tenant = make_tenant(cluster, "podstart", work)
    ways = ["current", "baseline"] if args.baseline else ["current"]
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    loads: list[list[float]] = []
    kernels: dict[str, Any] = {}
    try:
        start_notebook_pod(cluster, tenant)
        try:
            kernels["current"] = digits_kernel(tenant, image, work)
            if args.baseline:
                kernels["baseline"] = digits_kernel(tenant, image, work, PYTHONPATH=args.baseline)
            for way in ways:  # the first job of a kernel also builds its backend (imports, kubeconfig)
                one_run(kernels[way], cluster, tenant.namespace, f"podstart-warm-{way[0]}")
                wait_gone(cluster, tenant.namespace, f"podstart-warm-{way[0]}", 120)
            for i in range(args.repeat):
                loads.append([round(x, 2) for x in os.getloadavg()])
                for way in ways if i % 2 == 0 else ways[::-1]:
                    name = f"podstart-{way[0]}{i}"
                    runs[way].append(one_run(kernels[way], cluster, tenant.namespace, name))
                    wait_gone(cluster, tenant.namespace, name, 120)
                    brief = {key: v for key, v in runs[way][-1].items() if key != "pods"}
                    print(json.dumps({way: brief}), file=sys.stderr, flush=True)
        finally:
            for k in kernels.values():
                k.shutdown()
    finally:
        drop_tenant(cluster, tenant)
    med = {w: medians(r) for w, r in runs.items()}
    summary: dict[str, Any] = {"median": med}
    if args.baseline:
        summary["ratios_baseline_over_current"] = {
            key: round(v / med["current"][key], 2)
            for key, v in med["baseline"].items()
            if med["current"].get(key) and v > 0 and med["current"][key] > 0
        }
    summary |= {
        "repeats": args.repeat,
        "how": "seconds from the cell's start; created/scheduled/ready: the API server's creationTimestamp, "
        "PodScheduled and Ready times (1 s resolution); bound: the scheduler's Scheduled event (us); "
        "seen_*: first seen by a poll every 0.1 s",
        "job": f"{brk.PS} PS, {brk.WORKERS} workers, 1 epoch x {args.steps} steps, every pod cpu {brk.CPU} "
        f"(request = limit), memory {brk.MEMORY}",
        "note": args.note,
        "baseline": args.baseline,
        "load_average_at_each_repeat": loads,
        "runs": runs,
        "machine": machine(),
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
