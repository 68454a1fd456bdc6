"""The fixed costs of a distributed step, measured on this machine for `%tfdist plan`'s probe
(`tfdist.runtime.probe`): a PS round trip, the coordinator's dispatch and the link's rate
(`measure_ps_costs`, TF servers in the probe's own process; the coordinator's pace is its Keras fit
loop's, `keras_fit_pace`), and the all-reduce's launch and rate
(`Collective`, two worker processes). Each runs under `within`, so a stuck server cannot keep the probe
waiting; the plan stands on assumed costs where one fails.

Usage (the all-reduce workers): python -m tfdist.runtime.probecosts RANK PORTS OUT_JSON
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tfdist.runtime.probehelpers import HelperLauncher

PS_CLOSURES = 30
COLLECTIVE_ROUNDS = 8
COLLECTIVE_MAX_BYTES = 32 << 20
RATE_MIN_BYTES = 4 << 20  # below this a transfer is all latency: no rate to read from it
COLLECTIVE_TIMEOUT_S = 60.0
FIXED_COSTS_TIMEOUT_S = 70.0
FIT_STEPS_SHORT, FIT_STEPS_LONG = 10, 90
PER_VARIABLE_VARS = 8


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
    variable instead of a tiny one, the link's rate; one over 8 tiny variables instead of 1, what each
    further variable of a step costs (the worker reads and updates each with its own remote calls)."""
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
        many = [tf.Variable(tf.zeros([64])) for _ in range(PER_VARIABLE_VARS)]

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

    one, two, big, several = step_fn([a]), step_fn([a, b]), step_fn([c]), step_fn(many)

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
    per_variable = (serial(several, PS_CLOSURES // 2) - small) / (PER_VARIABLE_VARS - 1)
    fit_pace = keras_fit_pace(strategy)
    _KEEP.append((servers, coord, it))  # ended with this process: tearing them down takes seconds
    return {
        "ps_dispatch_s": max(dispatch, fit_pace),
        "ps_dispatch_per_ps_s": max(0.0, dispatch_two - dispatch),
        "ps_overhead_s": max(0.0, small - dispatch),
        "ps_per_variable_s": max(0.0, per_variable),
        "link_bandwidth": 2 * nbytes / max(large - small, 1e-6),  # pulled and pushed
    }


def keras_fit_pace(strategy: Any) -> float:
    """The pace per step of Keras's own fit loop under `strategy` (a one-layer model: nothing but the
    loop's work and, under all-reduce, its collective): what a job pays per step beyond its model, several
    times a bare closure's dispatch or collective launch on a CPU machine (PS: 7 ms against 2.3 on 2
    cores). Fits of two lengths, so a fit's start and end cancel."""
    import tensorflow as tf

    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input((8,)), tf.keras.layers.Dense(2)])
        model.compile(
            optimizer=tf.keras.optimizers.legacy.SGD(0.01),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    data = tf.data.Dataset.from_tensors((tf.ones([8, 8]), tf.zeros([8], tf.int64))).repeat()

    def fit(steps: int) -> float:
        t0 = time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
        return time.perf_counter() - t0

    fit(FIT_STEPS_SHORT)  # traced here
    extra = FIT_STEPS_LONG - FIT_STEPS_SHORT
    paces = [(fit(FIT_STEPS_LONG) - fit(FIT_STEPS_SHORT)) / extra for _ in range(2)]
    return max(0.0, min(paces))  # the machine's pace, not a moment another process took the core


def collective_worker(out_path: str, rank: int, ports: list[int]) -> None:
    """One of two MultiWorkerMirroredStrategy workers: once up, says so (a file) and waits for the
    probe's word (a byte count on stdin, so its imports overlap the probe's and its timing does not),
    then all-reduces a tiny tensor (the collective's launch) and one of that size (its rate), as an
    all-reduce job's step does, and paces Keras's fit loop under the strategy (the step's fixed cost).
    Its stdin closing (the probe gone) ends it."""
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
    pace = keras_fit_pace(strategy)  # both workers fit in step: each step's collective joins them
    moved = 2 * (2 - 1) / 2 * nbytes  # a ring of two: half the bytes out and in, twice
    if rank == 0:
        rate = moved / max(big - small, 1e-6)
        with open(out_path, "w") as f:
            json.dump({"allreduce_overhead_s": max(small, pace), "allreduce_bandwidth": rate}, f)


class Collective:
    """Two all-reduce workers, started before the probe imports TensorFlow, timed after its model."""

    def __init__(self, launcher: HelperLauncher | None = None) -> None:
        import tempfile

        from tfdist.runtime.probehelpers import HelperLauncher, helper_env

        self.failed = ""
        self._dir = tempfile.TemporaryDirectory(prefix="tfdist-probe-")
        self.out = os.path.join(self._dir.name, "collective.json")
        ports = ",".join(map(str, _free_ports(2)))
        launch, env = launcher or HelperLauncher(), helper_env()
        self.procs = [
            launch.spawn("tfdist.runtime.probecosts", [str(r), ports, self.out], env, f"{self.out}.err{r}")
            for r in range(2)
        ]

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
            if p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()
        self._dir.cleanup()  # idempotent


def within(fn: Any, *args: Any) -> dict[str, float]:
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


def main(argv: list[str]) -> int:
    """An all-reduce worker of `Collective`: RANK PORTS (comma-separated) OUT_JSON."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    collective_worker(argv[2], int(argv[0]), [int(p) for p in argv[1].split(",")])
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # its result is written: no TensorFlow teardown to wait for
