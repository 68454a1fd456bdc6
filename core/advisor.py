"""How to distribute a model: a small performance model behind `%tfdist plan`. Pure: no TensorFlow.

Inputs are what can be measured on one device in seconds (the step time of the cell's model and batch, the
size of each variable in creation order) and what the admin or a default says about the hardware (nodes,
devices per node, network bandwidth). Outputs are predicted steps/s, examples/s and epoch time for one
worker, N workers with k parameter servers, and all-reduce with N workers, and one recommended run line.

The model (docs/users.md, "How `%tfdist plan` predicts"):

* A step of one worker is serial: pull the variables from the PS, compute, push the gradients. So a
  PS step costs t_compute + t_pull + t_push; pull and push each take the busiest link's bytes in that
  phase over its bandwidth, with all workers in phase (conservative for async PS training).
* A gradient that comes as IndexedSlices (an embedding's) moves only the rows the batch touches, and the
  lookup pulls only those: the probe measures each variable's bytes per step (`Measured.step_bytes`).
* Variables sit on the PS round-robin in creation order (TensorFlow's default placement, no partitioner),
  so one huge variable (VGG-16's fc6: 411 MB) loads one PS however many there are.
* Tasks are spread round-robin over nodes (PS j on node j mod nodes); traffic between tasks on one node
  uses the local bandwidth, across nodes the network's. Links are full duplex.
* All-reduce (ring): each step moves 2(N-1)/N of the gradient bytes in and out of every worker, with no
  overlap with compute (MultiWorkerMirroredStrategy all-reduces after the backward pass). Under
  all-reduce the dataset's batch is the global one: the cell as written runs its batch split over the N
  replicas (`split=True`, what `%tfdist plan` compares, with the step time measured at that per-replica
  batch); with `split=False` each replica keeps the cell's batch (the dataset batched N x). PS workers
  each take the cell's batch. Layouts are compared by examples/s, so by time to the same epochs; steps/s
  are always steps of the cell's batch.
* Workers of a local CPU job share the server's cores: their compute time-slices (a GPU is one worker's).
* A fixed cost per step for dispatch and RPC latency (PS: the coordinator schedules each step through
  Keras's fit loop as a closure, and a worker's step makes remote calls per variable; all-reduce: Keras's
  fit loop and the collective's launch). `%tfdist plan` measures them where it runs (the probe,
  `tfdist.runtime.probe`); `with_costs` puts them in, and `Hardware.measured` says
  which were measured. The constants below are the fallback, from this project's CI machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GBIT = 1e9 / 8  # bytes/s in one Gbit/s
DEFAULT_BANDWIDTH = {"kubernetes": 10 * GBIT, "local": 2e9}  # 10 GbE; loopback gRPC (serialising)
DEFAULT_LOCAL_BANDWIDTH = {"kubernetes": 10e9, "local": 2e9}  # within a node (PCIe / memory copies)
# Fixed costs per step, measured with benchmarks/bench_advisor.py on this project's 2-core CI machine (a
# tiny model, where nothing else counts): a PS worker's step pays RPC round trips and the closure's
# scheduling; the coordinator dispatches steps one at a time (Python, serial), more so with more PS; an
# all-reduce step pays the collective's launch over gRPC and Keras's per-step work.
PS_STEP_LATENCY_S = 0.0156
PS_DISPATCH_S = 0.0238
PS_DISPATCH_PER_EXTRA_PS_S = 0.0047
ALLREDUCE_STEP_OVERHEAD_S = 0.028


@dataclass(frozen=True)
class Measured:
    """What one device measured for the cell's model and batch."""

    step_s: float  # one training step (forward, backward, update) of `batch` examples on one device
    batch: int
    var_bytes: tuple[int, ...]  # every variable the PS would hold, in creation order
    grad_bytes: int | None = None  # trainable variables only (what all-reduce moves); None: all of them
    steps_per_epoch: int | None = None
    cores_used: float | None = None  # CPU time / wall time of the measured steps (None: all of them)
    split_step_s: tuple[tuple[int, float], ...] = ()  # (smaller batch, its step) where it was measured
    epochs: int | None = None  # the fit's epochs, for the time to train them
    step_bytes: tuple[int, ...] = ()  # per variable, what a step pulls and pushes (sparse: rows); () = all

    @property
    def moved_bytes(self) -> tuple[int, ...]:
        """Per variable, in creation order, the bytes one step moves each way between a worker and a PS."""
        return self.step_bytes if len(self.step_bytes) == len(self.var_bytes) else self.var_bytes

    def step_at(self, batch: int) -> float:
        """One step at `batch` examples: measured where it was, else linear in the batch between (or
        beyond) the measured points; with one point, proportional to the batch."""
        points = sorted({(self.batch, self.step_s), *self.split_step_s})
        for b, t in points:
            if b == batch:
                return t
        if len(points) == 1:
            return self.step_s * batch / self.batch
        (b0, t0), (b1, t1) = (points[0], points[1]) if batch < points[1][0] else points[-2:]
        slope = (t1 - t0) / (b1 - b0) if b1 != b0 else 0.0
        return max(t0 * min(1.0, batch / b0) if b0 else 0.0, t0 + slope * (batch - b0), 1e-6)

    @property
    def param_bytes(self) -> int:
        return sum(self.var_bytes)

    @property
    def gradient_bytes(self) -> int:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes


@dataclass(frozen=True)
class Hardware:
    nodes: int = 1
    devices_per_node: int = 1  # GPUs per node, or worker slots on a CPU node
    bandwidth: float = DEFAULT_BANDWIDTH["kubernetes"]  # bytes/s per node NIC and direction
    local_bandwidth: float = DEFAULT_LOCAL_BANDWIDTH["kubernetes"]  # bytes/s within a node
    shared_cpu_cores: int | None = None  # local CPU job: workers share these cores (None: own devices)
    allreduce_bandwidth: float | None = None  # all-reduce's own rate where it differs (CPU collectives)
    ps_overhead_s: float = PS_STEP_LATENCY_S  # per worker step
    ps_dispatch_s: float = PS_DISPATCH_S  # per step at the coordinator, one at a time
    ps_dispatch_per_ps_s: float = PS_DISPATCH_PER_EXTRA_PS_S
    ps_per_variable_s: float = 0.0  # per worker step, per variable beyond the first (its remote calls)
    allreduce_overhead_s: float = ALLREDUCE_STEP_OVERHEAD_S
    measured: tuple[str, ...] = ()  # which of the costs above were measured here (the rest: assumed)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass
class Prediction:
    strategy: str  # "single", "ps", "allreduce"
    workers: int
    ps: int
    steps_per_s: float  # steps of the cell's batch, all workers together
    examples_per_s: float
    epoch_s: float | None
    bound: str  # what limits it: compute, shared CPU, PS bandwidth, network, all-reduce bandwidth, dispatch
    detail: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    replica_batch: int = 0  # examples one worker computes per step (PS: the cell's; all-reduce: split)
    tried: bool = False  # the numbers are the layout's own trial here, not the model's sum of costs

    @property
    def key(self) -> str:
        """The layout as `tfdist.runtime.probetrials` names it: 2x1 (workers x PS), ar2 (all-reduce)."""
        return f"ar{self.workers}" if self.strategy == "allreduce" else f"{self.workers}x{max(1, self.ps)}"

    def train_s(self, epochs: int | None) -> float | None:
        """Time to train `epochs` epochs (every layout sees the same examples per epoch)."""
        return self.epoch_s * epochs if self.epoch_s is not None and epochs else None

    @property
    def label(self) -> str:
        if self.strategy == "single":
            return "1 worker, 1 PS"
        if self.strategy == "ps":
            return f"{self.workers} workers, {self.ps} PS"
        return f"all-reduce, {self.workers} workers"

    def run_line(self) -> str:
        if self.strategy == "single":
            return "%%tfdist run --workers 1 --ps 1"
        if self.strategy == "allreduce":
            return f"%%tfdist run --strategy allreduce --workers {self.workers}"
        return f"%%tfdist run --workers {self.workers} --ps {max(1, self.ps)}"


def shard(var_bytes: tuple[int, ...] | list[int], k: int) -> list[int]:
    """Bytes on each of k PS: variables placed round-robin in creation order (TF's default)."""
    out = [0] * k
    for i, b in enumerate(var_bytes):
        out[i % k] += b
    return out


def size(n: float) -> str:
    """Bytes for people: 528 MB, 77 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _compute_s(m: Measured, hw: Hardware, workers: int, replica_batch: int) -> float:
    t = m.step_at(replica_batch)
    if hw.shared_cpu_cores is not None:  # a CPU server: the workers' compute time-slices its cores
        used = m.cores_used if m.cores_used is not None else hw.shared_cpu_cores
        t *= max(1.0, workers * min(used, hw.shared_cpu_cores) / hw.shared_cpu_cores)
    return t


def _compute_bound(hw: Hardware, workers: int) -> str:
    shared = hw.shared_cpu_cores is not None and workers > 1
    return f"shared CPU ({hw.shared_cpu_cores} cores)" if shared else "compute"


def _epoch(m: Measured, steps_per_s: float) -> float | None:
    return m.steps_per_epoch / steps_per_s if m.steps_per_epoch and steps_per_s > 0 else None


def predict_single(m: Measured, hw: Hardware) -> Prediction:
    """One worker with one PS on its node: what `%%tfdist run --workers 1 --ps 1` does."""
    p = predict_ps(m, replace(hw, nodes=1), 1, 1)
    p.strategy = "single"
    return p


def _phase_s(m: Measured, hw: Hardware, workers: int, ps: int) -> tuple[float, str, str]:
    """One phase (pull, or push: the same bytes the other way): the busiest link's time, its name and why."""
    shards = shard(m.moved_bytes, ps)
    node_of_worker = [w % hw.nodes for w in range(workers)]
    node_of_ps = [j % hw.nodes for j in range(ps)]
    nic_out = [0.0] * hw.nodes  # PS -> remote workers (pull); the push mirrors it
    nic_in = [0.0] * hw.nodes
    local = [0.0] * hw.nodes
    for wn in node_of_worker:
        for j, pn in enumerate(node_of_ps):
            if wn == pn:
                local[pn] += shards[j]
            else:
                nic_out[pn] += shards[j]
                nic_in[wn] += shards[j]
    t_nic = max(max(nic_out), max(nic_in)) / hw.bandwidth
    t_local = max(local) / hw.local_bandwidth
    why = (
        f"each step moves {size(2 * sum(m.moved_bytes) * workers)} through {ps} PS "
        f"(the busiest holds {size(max(shard(m.var_bytes, ps)))})"
    )
    if t_nic >= t_local:
        return t_nic, "PS bandwidth" if ps < workers or hw.nodes == 1 else "network", why
    return t_local, "PS bandwidth", why


def predict_ps(m: Measured, hw: Hardware, workers: int, ps: int) -> Prediction:
    compute = _compute_s(m, hw, workers, m.batch)
    phase, link, why = _phase_s(m, hw, workers, ps)
    overhead = hw.ps_overhead_s + hw.ps_per_variable_s * max(0, len(m.var_bytes) - 1)
    step = compute + 2 * phase + overhead
    dispatch = hw.ps_dispatch_s + hw.ps_dispatch_per_ps_s * (ps - 1)
    steps = min(workers / step, 1 / dispatch)
    if 1 / dispatch < workers / step:
        bound = "coordinator dispatch"
    elif compute >= 2 * phase + overhead:
        bound = _compute_bound(hw, workers)
    else:
        bound = "step latency" if overhead > 2 * phase else link
    return Prediction(
        "ps",
        workers,
        ps,
        steps,
        steps * m.batch,
        _epoch(m, steps),
        bound,
        why,
        {"compute": compute, "pull": phase, "push": phase, "overhead": overhead},
        m.batch,
    )


def predict_allreduce(m: Measured, hw: Hardware, workers: int, split: bool = False) -> Prediction:
    """split: the cell's batch is the global one, split over the replicas (the cell as written); else each
    replica keeps the cell's batch (the dataset batched N x), so a step processes workers x batch."""
    replica = max(1, m.batch // workers) if split else m.batch
    compute = _compute_s(m, hw, workers, replica)
    moved = 2 * (workers - 1) / workers * m.gradient_bytes  # in, and out, of every worker
    if workers == 1:
        comm = 0.0
    else:
        # a ring over nodes crosses each NIC once per direction; within a node it runs over local links
        t_nic = moved / hw.bandwidth if hw.nodes > 1 else 0.0
        t_local = moved / hw.local_bandwidth if hw.devices_per_node > 1 or hw.nodes == 1 else 0.0
        comm = max(t_nic, t_local)
        if hw.allreduce_bandwidth:
            comm = max(comm, moved / hw.allreduce_bandwidth)
    overhead = hw.allreduce_overhead_s if workers > 1 else 0.0
    step = compute + comm + overhead
    examples = workers * replica / step
    if compute >= comm + overhead:
        bound = _compute_bound(hw, workers)
    else:
        bound = "all-reduce bandwidth" if comm >= overhead else "step latency"
    why = f"each step all-reduces {size(m.gradient_bytes)} of gradients over {workers} workers"
    if split:
        why += f" (batch {replica} per replica)"
    return Prediction(
        "allreduce",
        workers,
        0,
        examples / m.batch,
        examples,
        _epoch(m, examples / m.batch),
        bound,
        why,
        {"compute": compute, "all-reduce": comm, "overhead": overhead},
        replica,
    )


def ps_counts(workers: int, n_vars: int) -> list[int]:
    """The PS counts worth comparing: 1, 2, 4, ... up to the workers and the variables there are."""
    top = max(1, min(workers, n_vars))
    out, k = [], 1
    while k < top:
        out.append(k)
        k *= 2
    return sorted({*out, top})


def plan(m: Measured, hw: Hardware, workers: int | None = None, split: bool = False) -> list[Prediction]:
    """Every candidate: one worker; N workers with each k PS that matters; all-reduce with N workers
    (split: at the cell's batch split over them, as the cell runs; else at N x the cell's batch)."""
    n = workers or max(2, hw.devices)
    preds = [predict_single(m, hw)]
    preds += [predict_ps(m, hw, n, k) for k in ps_counts(n, len(m.var_bytes))]
    preds.append(predict_allreduce(m, hw, n, split))
    return preds


def tried(p: Prediction, m: Measured, pace_s: float) -> Prediction:
    """`p` with the pace of its layout's trial on this machine (`tfdist.runtime.probetrials`): a step of
    the cell's batch every `pace_s`, its epochs' ends included (every layout's step is of the cell's
    batch: PS workers each take it, all-reduce splits it); the bound and why stay the model's reading."""
    steps = 1 / max(pace_s, 1e-6)
    return replace(p, steps_per_s=steps, examples_per_s=steps * m.batch, epoch_s=_epoch(m, steps), tried=True)


COSTS = (
    "ps_overhead_s",
    "ps_per_variable_s",
    "ps_dispatch_s",
    "ps_dispatch_per_ps_s",
    "allreduce_overhead_s",
    "allreduce_bandwidth",
    "link_bandwidth",  # both `bandwidth` and `local_bandwidth`: one machine's loopback
)
# what a measurement in the user's server says about a job's pods elsewhere: only the coordinator's pace
REMOTE_COSTS = ("ps_dispatch_s", "ps_dispatch_per_ps_s")


def with_costs(hw: Hardware, costs: dict[str, float], local: bool = True) -> Hardware:
    """`hw` with the fixed costs measured where the plan runs (the others stay assumed). A job on other
    machines (Kubernetes) takes only the coordinator's pace from them: latency and rates there differ."""
    keys = COSTS if local else REMOTE_COSTS
    rates = ("allreduce_bandwidth", "link_bandwidth")  # a rate of 0 is no measurement; a cost of 0 is one
    got = {
        k: float(v)
        for k, v in costs.items()
        if k in keys and v is not None and (float(v) > 0 if k in rates else float(v) >= 0)
    }
    link = got.pop("link_bandwidth", None)
    if link is not None:
        got |= {"bandwidth": link, "local_bandwidth": link}
    measured = tuple(k for k in COSTS if k in got or (k == "link_bandwidth" and link is not None))
    return replace(hw, **got, measured=measured)


def recommend(preds: list[Prediction]) -> tuple[Prediction, str]:
    """The fastest candidate (by examples/s; within 5 %: one worker, else fewer tasks) and one sentence
    saying why."""
    best_rate = max(p.examples_per_s for p in preds)
    near = [p for p in preds if p.examples_per_s >= 0.95 * best_rate]
    best = min(near, key=lambda p: (p.strategy != "single", p.workers + p.ps, p.strategy != "allreduce"))
    single = preds[0]
    ps_best = max((p for p in preds if p.strategy == "ps"), key=lambda p: p.examples_per_s, default=None)
    speed = best.examples_per_s / single.examples_per_s
    if best.strategy == "single":
        worst = ps_best or best
        detail = f": {worst.detail}" if worst.bound in ("PS bandwidth", "network") else ""
        reason = (
            f"one worker: distributing does not pay ({worst.label}: "
            f"{worst.examples_per_s / single.examples_per_s:.2f}x, {worst.bound} bound{detail})"
        )
    elif best.strategy == "allreduce":
        vs = f"; the best PS layout ({ps_best.label}) is {ps_best.bound} bound" if ps_best else ""
        reason = f"all-reduce is {speed:.1f}x one worker{vs}: {ps_best.detail if ps_best else best.detail}"
    else:
        reason = f"{best.label} is {speed:.1f}x one worker ({best.bound} bound; {best.detail})"
    return best, reason


def parse_bandwidth(text: str) -> float:
    """Bytes/s from '10Gbps', '25gbit', '1.5GB/s', '800MB/s' or a number of bytes/s."""
    t = text.strip().lower().replace(" ", "")
    units = [
        ("gbps", GBIT),
        ("gbit", GBIT),
        ("mbps", GBIT / 1000),
        ("mbit", GBIT / 1000),
        ("gb/s", 1e9),
        ("mb/s", 1e6),
    ]
    for suffix, scale in units:
        if t.endswith(suffix):
            t, mult = t[: -len(suffix)], scale
            break
    else:
        mult = 1.0
    try:
        value = float(t) * mult
    except ValueError:
        raise ValueError(
            f"bandwidth {text!r}: use e.g. 10Gbps, 25gbit, 1.5GB/s or bytes per second"
        ) from None
    if not value > 0 or math.isinf(value):
        raise ValueError(f"bandwidth {text!r} must be positive")
    return value
