"""`%%tfdist run --backend kubernetes` on the real node against bare pods and the local backend (issue 26).

Run as root under the real node's lock, with the cluster up (this script never takes it down):
    flock /run/lock/tfdist-dev-realnode.lock python benchmarks/bench_k8s_realnode.py [--repeat 3]
Prints JSON and writes benchmarks/results/k8s_bare.json (`--out`).

One job, three ways, interleaved in each repeat: the bare coordinator's model and data
(`shared/baseline/bare_ps/coordinator.py`: Dense 256 on 4096 x 32 random rows, batch 64,
steps_per_execution 10), 1 PS + 2 workers, 4 epochs of 200 steps, every pod `--cpu 0.45 --memory 1536Mi`
(four pods fit the node's two cores):
  kubernetes  the cell below in a real host kernel (a user namespace prepared by the spawner's code, the
              kernel acting as the user's notebook service account), `%%tfdist run --backend kubernetes`
  bare        benchmarks/bare_pods.py: the unmodified server.py/coordinator.py as plain pods, TF_CONFIG by
              hand, a headless Service, the same image and limits, in a namespace of its own
  local       the same cell with `--backend local` (fresh tasks: the kernel's warm pool is off)
The cell trains what the bare coordinator trains, with the same code (built in the cell, under the
job's strategy as the bare file builds it under its own).

Measured from the cell's start (bare: LAUNCH_T0, when the benchmark creates the first object) to:
  k8s_scheduled / k8s_running  every pod bound to the node / every container running (API polled 0.2 s)
  k8s_serving  tfdist: every PS/worker pod's TF server serving (its log line, polled: ~0.3 s late at most)
  tf_imported  bare: the last pod's TensorFlow imported (bare_pods.WRAPPER's marks)
  payload      tfdist: the payload handed to the coordinator pod's agent
  coordinator  tfdist: the coordinator process started with the payload
  servers      the coordinator connected to every TF server (strategy made)
  fit_start    the fit called
  first_step   tfdist only: the first step its heartbeat counted (every 2 s; bare: Keras allows no batch
               callback under ParameterServerStrategy)
  epoch_1      the end of the first epoch (the headline; bare: the file's own JSON line)
and steps/s after the first epoch (epochs 2..4); from the cell's start to the end of the first epoch, CPU
seconds: the whole machine busy (cpu_machine_busy_s), the kernel process (cpu_kernel_s), every container
(cpu_containers_s: the job's pods and the notebook pod's) and the seconds their CFS limits throttled them
(throttled_containers_s), from the cgroups, sampled every 0.2 s; from the start to the coordinator connected
(`servers`), each container process's CPU seconds by its part (cpu_to_connect_<role>_s: the chief pod's
agent and coordinator, the server pods' entry points and TF servers, the bare coordinator and servers,
from /proc), and the same to the end of the first epoch (cpu_to_epoch_1_<role>_s). Each figure is the
median of the repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bare_pods
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

WORKERS, PS, EPOCHS, STEPS = 2, 1, 4, 200
CPU, MEMORY = 0.45, "1536Mi"

CELL = """%%tfdist run --workers {workers} --ps {ps} --name {name} --cpu {cpu} --memory {memory}{backend}
import time
import tensorflow as tf
keras = tf.keras
model = keras.Sequential(
    [keras.layers.Input((32,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)]
)
model.compile(optimizer="sgd", loss="mse", steps_per_execution=10)
x = tf.random.normal((4096, 32), seed=1)
y = tf.reduce_sum(x, axis=1, keepdims=True)
ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)
ends = []
clock = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: ends.append(time.time()))
hist = model.fit(ds, epochs={epochs}, steps_per_epoch={steps}, verbose=0, callbacks=[clock])
"""

RECORD = """
import json as _j, time as _t
from tfdist import jobview as _jv
from tfdist.job import events as _ev
_bench_events = []
if not hasattr(_jv.JobView, "_bench_orig"):
    _jv.JobView._bench_orig = _jv.JobView.apply
    def _bench_apply(self, ev, _orig=_jv.JobView._bench_orig):
        try:  # the results file holds the wire form: records (and dicts) written once, here
            w = _ev.to_wire(_ev.parse(ev))
        except ValueError:
            w = {}
        if w.get("type") in ("progress", "task", "state"):
            _bench_events.append([_t.time(), {k: w[k] for k in ("type", "phase", "epoch", "step", "t",
                                                                  "task", "state") if k in w}])
        return _orig(self, ev)
    _jv.JobView.apply = _bench_apply
_bench_events.clear()
"""


def cell(name: str, backend: str = "") -> str:
    return CELL.format(
        workers=WORKERS,
        ps=PS,
        name=name,
        cpu=CPU,
        memory=MEMORY,
        backend=f" --backend {backend}" if backend else "",
        epochs=EPOCHS,
        steps=STEPS,
    )


def steps_per_s(ends: list[float]) -> float | None:
    later = ends[-1] - ends[0] if len(ends) > 1 else 0
    return round(STEPS * (len(ends) - 1) / later, 1) if later > 0 else None


def kernel_value(k: Any, expr: str) -> Any:
    r = k.run(f"print(_j.dumps({expr}))", timeout=60)
    assert r.error is None, r.error_text
    return json.loads(r.text.strip().splitlines()[-1])


def phases(events: list[tuple[float, dict]], t0: float) -> dict[str, float | None]:
    """Seconds from the cell's start to the coordinator's milestones (first occurrence)."""

    def first(pred) -> float | None:
        for t, ev in events:
            if pred(ev):
                return round(ev.get("t", t) - t0, 2)
        return None

    prog = "progress"
    out = {
        "payload": first(lambda e: e["type"] == prog and e.get("phase") == "waiting for the payload"),
        "coordinator": first(lambda e: e["type"] == prog and e.get("phase") == "connecting"),
        "servers": first(lambda e: e["type"] == prog and e.get("phase") == "loading"),
        "fit_start": first(lambda e: e["type"] == prog and e.get("phase") == "fit"),
        "first_step": first(lambda e: e["type"] == prog and (e.get("step") or 0) > 0 and "t" in e),
    }
    return out


class PodClock(threading.Thread):
    """When (host time) every pod of a job was bound to the node, every container running, and every
    PS/worker pod's TF server serving (its log's "serving at" line, polled: ~0.3 s resolution)."""

    def __init__(
        self,
        pods: Callable[[], list[dict]],
        n: int,
        logs: Callable[[str], str] | None = None,
        servers: int = 0,
    ):
        super().__init__(daemon=True)
        self.pods, self.n, self.logs, self.servers = pods, n, logs, servers
        self.times: dict[str, float] = {}
        self.serving: set[str] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        done = "serving" if self.logs is not None else "running"
        while not self.stop.is_set() and done not in self.times:
            now = time.time()
            pods = self.pods()
            if len(pods) >= self.n:
                if "scheduled" not in self.times and all(p["spec"].get("nodeName") for p in pods):
                    self.times["scheduled"] = now
                if "running" not in self.times and all(
                    (p.get("status") or {}).get("phase") == "Running" for p in pods
                ):
                    self.times["running"] = now
                for p in pods if self.logs is not None else []:
                    name = p["metadata"]["name"]
                    if name not in self.serving and (p.get("status") or {}).get("phase") == "Running":
                        try:
                            if " serving at " in (self.logs(name) or ""):
                                self.serving.add(name)
                        except Exception:
                            pass
                if self.logs is not None and len(self.serving) >= self.servers:
                    self.times["serving"] = time.time()
            time.sleep(0.2)


CGROUP_CPU = Path("/sys/fs/cgroup/cpu/k8s.io")  # containerd's containers (cgroup v1, cgroupfs driver)
CGROUP_ACCT = Path("/sys/fs/cgroup/cpuacct/k8s.io")


def _containers() -> dict[str, tuple[float, float]]:
    """Each container's CPU seconds used and seconds throttled by its CFS limit, so far."""
    out: dict[str, tuple[float, float]] = {}
    for d in CGROUP_ACCT.glob("*/cpuacct.usage"):
        cid = d.parent.name
        try:
            used = int(d.read_text()) / 1e9
            stat = dict(line.split() for line in (CGROUP_CPU / cid / "cpu.stat").read_text().splitlines())
            out[cid] = (used, int(stat.get("throttled_time", 0)) / 1e9)
        except (OSError, ValueError):
            continue
    return out


# A container process's part in the job, from its command line (the chief pod runs two: its agent and,
# beside it, the coordinator; a server pod its entry point and the TF server under it)
ROLES = (
    ("tfdist.runtime.podmain chief", "chief_agent"),
    ("tfdist.runtime.podmain coordinator", "coordinator"),
    ("tfdist.runtime.coordinator", "coordinator"),
    ("tfdist.runtime.task", "server_task"),
    ("tfdist.runtime.podmain worker", "server_entry"),
    ("tfdist.runtime.podmain ps", "server_entry"),
    ("/bare/coordinator.py", "bare_coordinator"),
    ("/bare/server.py", "bare_server"),
)


class Processes:
    """CPU seconds of every container process with a role in ROLES, by PID (host /proc: the node is this
    machine), so a run can say where its pods' CPU went before each milestone."""

    def __init__(self) -> None:
        self.role: dict[int, str | None] = {}  # "": no part in a job; None: not known yet
        self.cpu: dict[int, float] = {}
        self.tick = os.sysconf("SC_CLK_TCK")

    def _role(self, pid: int) -> str | None:
        """Its role; "" for no container's process (never asked again); None for a container process
        with none yet: runc starts each container as `runc init`, which then executes the entry point."""
        try:
            if "k8s.io" not in Path(f"/proc/{pid}/cgroup").read_text():
                return ""
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""
        return next((role for mark, role in ROLES if mark in line), None)

    def sample(self) -> dict[str, float]:
        """Each role's CPU seconds so far (a process gone keeps its last reading)."""
        for entry in os.listdir("/proc"):
            if entry.isdigit() and self.role.get(int(entry)) is None:
                self.role[int(entry)] = self._role(int(entry))
        for pid, role in self.role.items():
            if not role:
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                self.cpu[pid] = (int(f[11]) + int(f[12])) / self.tick
        out: dict[str, float] = {}
        for pid, used in self.cpu.items():
            role = self.role[pid] or ""
            out[role] = out.get(role, 0.0) + used
        return out


class CpuClock(threading.Thread):
    """Where the machine's CPU went from a run's start: the kernel process, every container (the job's
    pods, and the notebook's), the whole machine busy, and the containers' CFS throttling, sampled every
    0.2 s; `until(t)` sums them up to the last sample before t."""

    def __init__(self, kernel_pid: int | None):
        super().__init__(daemon=True)
        import psutil

        self.kernel = psutil.Process(kernel_pid) if kernel_pid else None
        self.samples: list[tuple[float, float, float, dict[str, tuple[float, float]]]] = []
        self.procs = Processes()
        self.roles: list[tuple[float, dict[str, float]]] = []
        self.stop = threading.Event()

    def _sample(self) -> None:
        import psutil

        t = psutil.cpu_times()
        busy = t.user + t.nice + t.system + t.irq + t.softirq + t.steal
        kernel = 0.0
        if self.kernel is not None:
            with contextlib.suppress(psutil.Error):
                c = self.kernel.cpu_times()
                kernel = c.user + c.system
        now = time.time()
        self.samples.append((now, busy, kernel, _containers()))
        self.roles.append((now, self.procs.sample()))

    def by_role(self, t_end: float | None, prefix: str) -> dict[str, float]:
        """Each role's CPU seconds from the first sample to the last one before `t_end` (a milestone)."""
        if t_end is None or not self.roles:
            return {}
        first = self.roles[0][1]
        last = [r for t, r in self.roles if t <= t_end] or [first]
        return {f"{prefix}_{k}_s": round(v - first.get(k, 0.0), 2) for k, v in sorted(last[-1].items())}

    def run(self) -> None:
        while not self.stop.is_set():
            self._sample()
            time.sleep(0.2)

    def until(self, t_end: float) -> dict[str, float]:
        first = self.samples[0]
        last = [s for s in self.samples if s[0] <= t_end][-1]
        used = throttled = 0.0
        for cid, (u, th) in last[3].items():
            u0, th0 = first[3].get(cid, (0.0, 0.0))
            used, throttled = used + u - u0, throttled + th - th0
        return {
            "cpu_machine_busy_s": round(last[1] - first[1], 2),
            "cpu_kernel_s": round(last[2] - first[2], 2),
            "cpu_containers_s": round(used, 2),
            "throttled_containers_s": round(throttled, 2),
        }


def run_tfdist(k: Any, line: str, clock: PodClock | None = None) -> dict[str, Any]:
    k.run(RECORD, timeout=60)
    cpu = CpuClock(getattr(k, "pid", None))
    cpu._sample()
    cpu.start()
    if clock:
        clock.start()
    t0 = time.time()
    r = k.run(line, timeout=1200)
    cell_s = time.time() - t0
    cpu.stop.set()
    if clock:
        clock.stop.set()
    assert r.error is None, r.error_text
    out: dict[str, Any] = {}
    if clock:
        out |= {f"k8s_{key}": round(t - t0, 2) for key, t in clock.times.items()}
    out |= phases([(t, ev) for t, ev in kernel_value(k, "_bench_events")], t0)
    ends = kernel_value(k, "ends")
    out["epoch_1"] = round(ends[0] - t0, 2)
    out |= cpu.until(ends[0])
    out |= cpu.by_role(t0 + out["servers"] if out.get("servers") is not None else None, "cpu_to_connect")
    out |= cpu.by_role(ends[0], "cpu_to_epoch_1")
    if out["first_step"] is not None:  # the heartbeat reads the step counter every 2 s
        out["first_step"] = min(out["first_step"], out["epoch_1"])
    out["steps_per_s"] = steps_per_s(ends)
    out["cell"] = round(cell_s, 2)
    return out


# ------------------------------------------------------------------------------------------ bare pods

KINDS = {"pods": "/api/v1/namespaces/{ns}/pods", "services": "/api/v1/namespaces/{ns}/services",
         "configmaps": "/api/v1/namespaces/{ns}/configmaps"}  # fmt: skip


def bare_left(cluster: RealCluster, ns: str, name: str) -> list[str]:
    sel = f"?labelSelector={bare_pods.LABEL}%3D{name}"
    out = []
    for kind, path in KINDS.items():
        items = (cluster.get(path.format(ns=ns) + sel) or {"items": []})["items"]
        out += [f"{kind}/{o['metadata']['name']}" for o in items]
    return out


def run_bare(cluster: RealCluster, ns: str, name: str, image: str, files: dict[str, str]) -> dict[str, Any]:
    """One bare launch: create, read the coordinator's line, delete everything (asserted gone)."""
    sel = f"?labelSelector={bare_pods.LABEL}%3D{name}"
    clock = PodClock(lambda: cluster.get(KINDS["pods"].format(ns=ns) + sel)["items"], 1 + WORKERS + PS)
    t0 = time.time()
    objs = bare_pods.bare_objects(
        name,
        image=image,
        files=files,
        workers=WORKERS,
        ps=PS,
        epochs=EPOCHS,
        steps=STEPS,
        cpu=f"{int(CPU * 1000)}m",
        memory=MEMORY,
        launch_t0=t0,
        node=realnode.NODE_NAME,
    )
    cpu = CpuClock(None)
    cpu._sample()
    cpu.start()
    clock.start()
    try:
        for o in objs:
            cluster.request("POST", KINDS[o["kind"].lower() + "s"].format(ns=ns), o)
        chief = bare_pods.pod_name(name, "chief-0")
        pod = cluster.wait_pod(ns, chief, ("Succeeded", "Failed"), timeout=900)
        clock.stop.set()
        logs = {
            t: cluster.logs(ns, bare_pods.pod_name(name, t)) or "" for t in bare_pods.task_names(WORKERS, PS)
        }
        failed = f"the bare coordinator failed:\n{logs['chief-0'][-3000:]}"
        assert pod["status"]["phase"] == "Succeeded", failed
    finally:
        clock.stop.set()
        for o in objs:
            path = KINDS[o["kind"].lower() + "s"].format(ns=ns) + "/" + o["metadata"]["name"]
            try:
                cluster.request("DELETE", path)
            except Exception:  # never created
                pass
    got = bare_pods.result(logs["chief-0"])
    assert got, f"no JSON line from the bare coordinator:\n{logs['chief-0'][-3000:]}"
    m = {t: bare_pods.marks(log) for t, log in logs.items()}
    out: dict[str, Any] = {f"k8s_{key}": round(t - t0, 2) for key, t in clock.times.items()}
    imported = [x.get("tf_imported") for x in m.values()]
    out["tf_imported"] = round(max(imported) - t0, 2) if all(imported) else None
    for key in ("servers", "fit_start"):
        out[key] = round(m["chief-0"][key] - t0, 2) if key in m["chief-0"] else None
    out["epoch_1"] = got["launch_to_first_epoch_s"]
    cpu.stop.set()
    out |= cpu.until(t0 + got["launch_to_first_epoch_s"])
    out |= cpu.by_role(m["chief-0"].get("servers"), "cpu_to_connect")
    out |= cpu.by_role(t0 + got["launch_to_first_epoch_s"], "cpu_to_epoch_1")
    out["steps_per_s"] = got["steps_per_s_after_first_epoch"]
    deadline = time.monotonic() + 120
    while rest := bare_left(cluster, ns, name):
        assert time.monotonic() < deadline, f"left after 120 s: {rest}"
        time.sleep(0.5)
    return out


def median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 2) if vals else None


def summarize(results: dict[str, list[dict]]) -> dict[str, Any]:
    keys = ["k8s_scheduled", "k8s_running", "k8s_serving", "tf_imported", "payload", "coordinator", "servers",
            "fit_start", "first_step", "epoch_1", "steps_per_s", "cell", "cpu_machine_busy_s", "cpu_kernel_s",
            "cpu_containers_s", "throttled_containers_s"]  # fmt: skip
    keys += sorted({k for rows in results.values() for r in rows for k in r if k.startswith("cpu_to_")})
    med = {way: {k: v for k in keys if (v := median(rows, k)) is not None} for way, rows in results.items()}

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = med.get(a, {}).get(key), med.get(b, {}).get(key)
        return round(x / y, 2) if x and y else None

    return {
        "median": med,
        "ratios": {
            "first_epoch_kubernetes_over_bare": ratio("kubernetes", "bare", "epoch_1"),
            "steps_per_s_kubernetes_over_bare": ratio("kubernetes", "bare", "steps_per_s"),
            "first_epoch_local_over_bare_pods": ratio("local", "bare", "epoch_1"),
            "first_epoch_kubernetes_over_local": ratio("kubernetes", "local", "epoch_1"),
        },
    }


def main() -> int:
    global EPOCHS, STEPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--no-local", action="store_true", help="skip the local backend")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "k8s_bare.json"))
    ap.add_argument("--note", default="", help="what this run measures (e.g. which cut), kept in the file")
    args = ap.parse_args()
    EPOCHS, STEPS = args.epochs, args.steps
    if not realnode.status()["healthy"]:
        print('the cluster is not up: eval "$(sudo scripts/cluster up)"', file=sys.stderr)
        return 2
    cluster = RealCluster().ensure()
    image = build_job_image()
    files = bare_pods.baseline_files()
    work = Path(tempfile.mkdtemp(prefix="bench-realnode-"))
    tenant = make_tenant(cluster, "bench", work)
    bare_ns = cluster.create_namespace(f"bench-bare-{uuid.uuid4().hex[:6]}")
    results: dict[str, list] = {"kubernetes": [], "bare": [], "local": []}
    loads: list[list[float]] = []
    try:
        start_notebook_pod(cluster, tenant)
        k = digits_kernel(tenant, image, work)
        try:
            for i in range(args.repeat):
                loads.append([round(x, 2) for x in __import__("os").getloadavg()])
                name = f"bench-{i}"
                clock = PodClock(
                    lambda n=name: job_pods(cluster, tenant.namespace, n),
                    1 + WORKERS + PS,
                    lambda pod: cluster.logs(tenant.namespace, pod),
                    WORKERS + PS,
                )
                results["kubernetes"].append(run_tfdist(k, cell(name), clock))
                wait_gone(cluster, tenant.namespace, name, 120)
                results["bare"].append(run_bare(cluster, bare_ns, f"bare-{i}", image, files))
                if not args.no_local:
                    results["local"].append(run_tfdist(k, cell(f"local-{i}", "local")))
                print(json.dumps({w: r[-1] for w, r in results.items() if r}), file=sys.stderr, flush=True)
        finally:
            k.shutdown()
    finally:
        drop_tenant(cluster, tenant)
        cluster.request("DELETE", f"/api/v1/namespaces/{bare_ns}")
    summary = {
        **summarize({w: r for w, r in results.items() if r}),
        "repeats": args.repeat,
        "how": "median of the repeats, interleaved kubernetes, bare, local in each; seconds from the cell's "
        "start (bare: LAUNCH_T0, the first object's creation)",
        "job": f"bare_ps coordinator's model and data: {PS} PS, {WORKERS} workers, {EPOCHS} epochs x {STEPS} "
        f"steps, batch 64, steps_per_execution 10; every pod cpu {CPU} (request = limit), memory {MEMORY}",
        "note": args.note,
        "load_average_at_each_repeat": loads,
        "runs": results,
        "machine": machine(),  # read from the machine; the node is this machine (containerd + runc)
    }
    text = json.dumps(summary, indent=1)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
