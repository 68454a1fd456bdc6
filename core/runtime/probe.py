"""Measure a cell's fit for `%tfdist plan`: a short-lived process, never the kernel (the kernel's own
TensorFlow stays untouched, and nothing connects to a cluster).

Usage: python -m tfdist.runtime.probe BUNDLE OUT_JSON [SPLIT]

The bundle is the one `%%tfdist run` would ship: the cell's source and the notebook names it reads. The
cell runs here as it would on the job's coordinator, up to its first `fit`, which is caught, not run: its
model and arguments (evaluated where the run would evaluate them) are what is measured. A few steps are
trained (the first ones trace the graph and are not counted), at the cell's batch and, with SPLIT, at
the cell's batch split over SPLIT replicas (all-reduce's per-replica batch). Then the fixed costs of a
distributed step are measured on this machine (`measure_ps_costs`, `Collective`). Writes a `ProbeResult` as
JSON; on failure {"error": ...}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tfdist.settings import KernelSettings

WARMUP_STEPS = 3
MAX_STEPS = 30
MAX_MEASURE_S = KernelSettings().probe_seconds
CELL_FILENAME = "<tfdist cell>"


@dataclass
class ProbeResult:
    """What the probe measured: the model and batch of the cell's fit, and this machine's fixed costs."""

    step_s: float  # median step at the cell's batch
    steps_timed: int
    cores_used: float
    batch: int
    var_bytes: list[int]
    var_names: list[str]
    grad_bytes: int
    params: int
    split_step_s: list[tuple[int, float]] = field(default_factory=list)  # (per-replica batch, median step)
    steps_per_epoch: int | None = None  # the fit's own (evaluated), else the dataset's cardinality
    epochs: int | None = None
    costs: dict[str, float] = field(default_factory=dict)  # measured here: advisor.COSTS names
    costs_error: str = ""  # why the fixed costs could not be measured (the plan then assumes them)


class FitCaught(BaseException):
    """Raised in place of the cell's first fit: a BaseException, so a cell's `except Exception` keeps
    out of the way."""

    def __init__(self, model: Any, args: tuple, kwargs: dict):
        super().__init__("fit")
        self.model, self.args, self.kwargs = model, args, kwargs


def catch_fit(source: str, line_offset: int, namespace: dict[str, Any]) -> FitCaught:
    """Run the cell in `namespace` as the coordinator would, up to its first fit."""
    import tensorflow as tf

    code = compile("\n" * line_offset + source, CELL_FILENAME, "exec")
    original = tf.keras.Model.fit

    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise FitCaught(self, args, kwargs)

    tf.keras.Model.fit = fit
    try:
        exec(code, namespace)
    except FitCaught as caught:
        return caught
    finally:
        tf.keras.Model.fit = original
    raise ValueError("the cell ran to its end without calling fit, so there is no training step to measure")


def fit_dataset(caught: FitCaught) -> tuple[Any, int | None, int | None]:
    """The fit's data as the batched dataset fit would iterate, its steps per epoch and its epochs."""
    import tensorflow as tf

    a, kw = caught.args, caught.kwargs
    x = a[0] if a else kw.get("x")
    y = a[1] if len(a) > 1 else kw.get("y")
    batch_size = a[2] if len(a) > 2 else kw.get("batch_size")
    epochs = a[3] if len(a) > 3 else kw.get("epochs", 1)
    steps = kw.get("steps_per_epoch")
    if x is None:
        raise ValueError("the cell's fit is given no data (no x)")
    if isinstance(x, tf.data.Dataset):
        ds = x
    else:
        try:
            ds = tf.data.Dataset.from_tensor_slices((x, y) if y is not None else x).batch(batch_size or 32)
        except Exception as exc:
            raise ValueError(
                f"the fit's data ({type(x).__name__}) is neither a tf.data dataset nor arrays fit can batch "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
    if steps is None:
        card = int(ds.cardinality())
        steps = card if card > 0 else None
    return ds, (int(steps) if steps else None), (int(epochs) if epochs else None)


def _batch_size(batch: Any) -> int:
    import tensorflow as tf

    first = tf.nest.flatten(batch)[0]
    return int(first.shape[0])


def time_steps(model: Any, dataset: Any) -> tuple[float, int, float]:
    """Median step time of the model's own train step on batches of `dataset`, steps timed, cores used."""
    it = iter(dataset.repeat())  # a tf.data iterator, as fit passes it (input time included, as in fit)
    fn = model.make_train_function(force=True)
    for _ in range(WARMUP_STEPS):  # the first traces the step function
        fn(it)
    times: list[float] = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    t_end = time.perf_counter() + MAX_MEASURE_S
    while len(times) < MAX_STEPS and (len(times) < 5 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        out = fn(it)
        for v in out.values():  # wait for the step's result, not just its dispatch
            v.numpy()
        times.append(time.perf_counter() - t0)
    cores_used = (time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
    times.sort()
    return times[len(times) // 2], len(times), round(cores_used, 2)


def measure(model: Any, dataset: Any, split: int = 1) -> ProbeResult:
    batch = _batch_size(next(iter(dataset.take(1))))
    step_s, timed, cores = time_steps(model, dataset)
    split_step: list[tuple[int, float]] = []
    if split > 1 and batch // split >= 1:  # all-reduce runs the cell's batch split over the replicas
        per_replica = batch // split
        split_step.append((per_replica, time_steps(model, dataset.unbatch().batch(per_replica))[0]))
    variables = list(model.variables)
    return ProbeResult(
        step_s=step_s,
        steps_timed=timed,
        cores_used=cores,
        batch=batch,
        var_bytes=[int(v.shape.num_elements() * v.dtype.size) for v in variables],
        var_names=[v.name for v in variables],
        grad_bytes=int(sum(v.shape.num_elements() * v.dtype.size for v in model.trainable_variables)),
        params=int(sum(v.shape.num_elements() for v in model.trainable_variables)),
        split_step_s=split_step,
    )


# ------------------------------------------------------------------------------------------ fixed costs
PS_CLOSURES = 30
COLLECTIVE_ROUNDS = 8
COLLECTIVE_MAX_BYTES = 32 << 20
RATE_MIN_BYTES = 4 << 20  # below this a transfer is all latency: no rate to read from it
COLLECTIVE_TIMEOUT_S = 60.0
FIXED_COSTS_TIMEOUT_S = 70.0


_KEEP: list[Any] = []


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def measure_ps_costs(grad_bytes: int) -> dict[str, float]:
    """A real PS round trip on this machine: TF servers (2 PS, 2 workers) in this process on loopback
    gRPC and a ClusterCoordinator, as the job's coordinator schedules steps. A step one at a time is
    the per-step latency; steps scheduled back to back pace the coordinator's dispatch; a step that
    touches both PS instead of one, the cost per extra PS; one that pulls and pushes a gradient-sized
    variable instead of a tiny one, the link's rate."""
    import tensorflow as tf

    ports = _free_ports(4)
    spec = {"worker": [f"localhost:{p}" for p in ports[:2]], "ps": [f"localhost:{p}" for p in ports[2:]]}
    cluster = tf.train.ClusterSpec(spec)
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = 4  # fewer deadlocks the in-process servers' closures
    servers = [
        tf.distribute.Server(cluster, job_name=job, task_index=i, protocol="grpc", config=config, start=True)
        for job in spec
        for i in range(len(spec[job]))
    ]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coord = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    nbytes = max(RATE_MIN_BYTES, min(COLLECTIVE_MAX_BYTES, grad_bytes)) // 4 * 4
    with strategy.scope():  # placed round-robin: a and c on ps 0, b on ps 1
        a, b = tf.Variable(tf.zeros([64])), tf.Variable(tf.zeros([64]))
        c = tf.Variable(tf.zeros([nbytes // 4]))

    # a step takes its batch from a per-worker dataset's iterator, as Keras's train step does
    batches = coord.create_per_worker_dataset(lambda: tf.data.Dataset.from_tensors(tf.ones([64])).repeat())
    it = iter(batches)

    def step_fn(variables: list[Any]) -> Any:
        @tf.function
        def step(iterator: Any) -> Any:
            def replica(x: Any) -> Any:
                for v in variables:  # a pull and a push per PS, as a training step does
                    v.assign_add(tf.ones_like(v) * tf.reduce_mean(x))
                return tf.add_n([tf.reduce_sum(v) for v in variables])

            return strategy.run(replica, args=(next(iterator),))

        return step

    one, two, big = step_fn([a]), step_fn([a, b]), step_fn([c])

    def paced(fn: Any) -> float:
        for _ in range(3):
            coord.schedule(fn, args=(it,))
        coord.join()
        t0 = time.perf_counter()
        for _ in range(PS_CLOSURES):
            coord.schedule(fn, args=(it,))
        coord.join()
        return (time.perf_counter() - t0) / PS_CLOSURES

    def serial(fn: Any, n: int) -> float:
        coord.schedule(fn, args=(it,)).fetch()
        t0 = time.perf_counter()
        for _ in range(n):
            coord.schedule(fn, args=(it,)).fetch()
        return (time.perf_counter() - t0) / n

    dispatch = paced(one)
    dispatch_two = paced(two)
    small = serial(one, PS_CLOSURES // 2)
    large = serial(big, COLLECTIVE_ROUNDS)
    _KEEP.append((servers, coord, it))  # ended with this process: tearing them down takes seconds
    return {
        "ps_dispatch_s": dispatch,
        "ps_dispatch_per_ps_s": max(0.0, dispatch_two - dispatch),
        "ps_overhead_s": max(0.0, small - dispatch),
        "link_bandwidth": 2 * nbytes / max(large - small, 1e-6),  # pulled and pushed
    }


def collective_worker(out_path: str, rank: int, ports: list[int]) -> None:
    """One of two MultiWorkerMirroredStrategy workers: once up, says so (a file) and waits for the
    probe's word (a byte count on stdin, so its imports overlap the probe's and its timing does not),
    then all-reduces a tiny tensor (the collective's launch) and one of that size (its rate), as an
    all-reduce job's step does. Its stdin closing (the probe gone) ends it."""
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}
    )
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    open(f"{out_path}.ready{rank}", "w").close()
    word = sys.stdin.readline().strip()
    if not word.isdigit():
        return
    nbytes = int(word)

    def timed(n: int) -> float:
        @tf.function
        def reduce() -> Any:
            def replica() -> Any:
                ctx = tf.distribute.get_replica_context()
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.ones([n]))

            return strategy.run(replica)

        for _ in range(2):
            reduce()
        t0 = time.perf_counter()
        for _ in range(COLLECTIVE_ROUNDS):
            strategy.experimental_local_results(reduce())[0].numpy()
        return (time.perf_counter() - t0) / COLLECTIVE_ROUNDS

    small, big = timed(1), timed(nbytes // 4)
    moved = 2 * (2 - 1) / 2 * nbytes  # a ring of two: half the bytes out and in, twice
    if rank == 0:
        rate = moved / max(big - small, 1e-6)
        with open(out_path, "w") as f:
            json.dump({"allreduce_overhead_s": small, "allreduce_bandwidth": rate}, f)


class Collective:
    """Two all-reduce workers, started before the probe imports TensorFlow, timed after its model."""

    def __init__(self) -> None:
        import subprocess
        import tempfile

        self.failed = ""
        self._dir = tempfile.TemporaryDirectory(prefix="tfdist-probe-")
        self.out = os.path.join(self._dir.name, "collective.json")
        ports = ",".join(map(str, _free_ports(2)))
        argv = [sys.executable, "-m", "tfdist.runtime.probe", "--collective", self.out]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        self.procs = []
        for r in range(2):
            with open(f"{self.out}.err{r}", "w") as err:  # a file: a pipe nobody reads would fill
                self.procs.append(
                    subprocess.Popen(
                        [*argv, str(r), ports],
                        env=env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        text=True,
                    )
                )

    def wait_ready(self, timeout: float = COLLECTIVE_TIMEOUT_S) -> None:
        if self.failed:  # waited for once already
            raise RuntimeError(self.failed)
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(f"{self.out}.ready{r}") for r in range(2)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.failed = "the all-reduce workers did not come up: " + self._tail()
                raise RuntimeError(self.failed)
            time.sleep(0.05)

    def measure(self, grad_bytes: int) -> dict[str, float]:
        self.wait_ready()
        nbytes = max(RATE_MIN_BYTES, min(COLLECTIVE_MAX_BYTES, grad_bytes)) // 4 * 4
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"{nbytes}\n")
            p.stdin.flush()
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not os.path.exists(self.out):
            raise RuntimeError("the all-reduce workers wrote nothing: " + self._tail())
        with open(self.out) as f:
            return json.load(f)

    def _tail(self) -> str:
        for r in range(2):
            with open(f"{self.out}.err{r}") as f:
                lines = [ln for ln in f.read().strip().splitlines() if "Error" in ln or "error" in ln]
            if lines:
                return " / ".join(lines[-2:])
        return "no word from them"

    def close(self) -> None:
        """Nothing outlives the probe."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self._dir.cleanup()  # idempotent


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--collective":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        collective_worker(argv[1], int(argv[2]), [int(p) for p in argv[3].split(",")])
        return 0
    bundle_path, out_path = argv[0], argv[1]
    split = int(argv[2]) if len(argv) > 2 else 1
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    collective = Collective()  # its imports overlap ours
    try:
        return _probe(bundle_path, out_path, split, collective)
    finally:
        collective.close()


def _probe(bundle_path: str, out_path: str, split: int, collective: Collective) -> int:
    try:
        import cloudpickle

        from tfdist import payload
        from tfdist.taskenv import ensure_threads

        ensure_threads()
        import tensorflow as tf

        with open(bundle_path, "rb") as f:
            bundle = payload.unpack(f.read())
        custom = cloudpickle.loads(bundle.custom_objects) if bundle.custom_objects else {}
        namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        namespace.update(custom)
        for name, (kind, data) in bundle.entries.items():
            namespace[name] = payload.decode(kind, data, custom)
        namespace["tfdist_strategy"] = tf.distribute.get_strategy()  # as the job's cell sees one
        caught = catch_fit(bundle.source, bundle.line_offset, namespace)
        dataset, steps, epochs = fit_dataset(caught)
        try:  # its imports would slow the model's steps
            collective.wait_ready()
        except RuntimeError:
            pass  # said below, where its costs are measured
        result = measure(caught.model, dataset, split)
        result.steps_per_epoch, result.epochs = steps, epochs
    except Exception as exc:
        with open(out_path, "w") as f:
            json.dump({"error": f"{type(exc).__name__}: {str(exc)[:500]}"}, f)
        return 1
    errors = []
    for what, fn in (("PS", measure_ps_costs), ("all-reduce", collective.measure)):
        try:  # the plan still stands without them, on assumed costs, and says so
            result.costs |= _within(fn, result.grad_bytes)
        except TimeoutError:
            errors.append(f"{what}: no answer in {FIXED_COSTS_TIMEOUT_S:g} s")
        except Exception as exc:
            errors.append(f"{what}: {type(exc).__name__}: {str(exc)[:300]}")
    result.costs_error = "; ".join(errors)
    with open(out_path, "w") as f:
        json.dump(asdict(result), f)
    return 0  # a stuck in-process server cannot keep the probe waiting: it ends with os._exit


def _within(fn: Any, *args: Any) -> dict[str, float]:
    """fn(*args) in a thread, given FIXED_COSTS_TIMEOUT_S."""
    import threading

    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn(*args))
        except Exception as exc:
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(FIXED_COSTS_TIMEOUT_S)
    if not box:
        raise TimeoutError
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the output is written and the helpers ended: no TensorFlow teardown to wait for
