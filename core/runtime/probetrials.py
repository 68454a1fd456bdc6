"""Each layout `%tfdist plan` offers on a CPU-only local server, tried in miniature at plan time.

On a shared CPU the fixed costs of a step do not add up: the coordinator, the PS and the workers take
turns on the same cores, and a layout's pace is what they leave each other. So for a local CPU plan the
probe (`tfdist.runtime.probe`) runs the cell's own fit under each layout's real strategy for a few steps,
the cell executed under the strategy's scope as the job's coordinator executes it:

* PS: worker and PS servers in processes of their own (`serve`), as the job runs them, shared by every
  PS layout in turn, and one coordinator process per layout (a process cannot reconnect to another
  cluster; a server takes each new coordinator's cluster, as it does after a coordinator's restart).
  Servers inside the coordinator's process were measured here to hide what a second worker gains:
  workers there share its pools (with the job's two inter-op threads they deadlock), and a PS there
  put 2 workers at 0.90-1.10x one where the job measured 1.08-1.40x (advisor-rerun-2026-12-03.json).
* All-reduce: MultiWorkerMirroredStrategy over its N worker processes.

Each layout fits in two rounds, the layouts in mirrored order (A B C D, then D C B A): each round a fit of
1 + R epochs of K steps (K the fit's own steps per epoch where that is affordable) whose first epoch is
not timed (it traces, or follows a pause); the median of the timed epochs of both rounds over K is the
pace per step, an epoch's end (the coordinator's join, the logs' fetch) included as the cell's own epochs
pay it. One round in one order put each layout's trial at one moment and one place in line: on 2 shared
cores the same layout's pace moved 10-20 % between minutes, and the layouts the plan must rank are often
that close. Measured here on 2 cores, the difference of two epoch lengths (to split the pace from the
epoch's end) was noise; one epoch length is not. The layouts still within CONTEND (25 %) of the best
pace after those two rounds (the ones the recommendation could pick wrongly between) fit in two more
rounds, again mirrored, and the others end: on a wide model two rounds put 2 workers with 1 PS 5 % ahead
of 2 with 2 PS, which the jobs then ran 10 % faster (advisor.json of 2026-12-04).

The processes start with the probe (their imports overlap its own) and wait for a word on stdin: each word
a round, its JSON written as `OUT_JSON.N`; they end on stdin's end and die with the probe
(PR_SET_PDEATHSIG).

Usage: python -m tfdist.runtime.probetrials LAYOUT RANK PORTS BUNDLE OUT_JSON
(LAYOUT: WxP for W workers and P PS, arN for all-reduce over N workers, `serveW` for the servers of the
PS layouts, W of them workers and the rest PS; PORTS comma-separated: workers' first, then the PS's.)
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tfdist.runtime.probehelpers import ForkedHelper, HelperLauncher

TRIAL_TIMEOUT_S = 90.0
READY_TIMEOUT_S = 90.0
STEP_BUDGET_S = 0.4  # K steps take about this long; a trial times about four times that
MIN_STEPS, MAX_STEPS = 3, 40
MIN_EPOCHS, MAX_EPOCHS = 2, 8  # timed epochs (R), the ROUNDS rounds together (contenders: twice that)
ROUNDS = 2
EXTRA_ROUNDS = 2  # for the layouts still in contention after ROUNDS (the probe's run_trials)
# no extra rounds once the first ROUNDS took this long: they cost up to as much again, and the plan's probe
# has PROBE_TIMEOUT_S (360 s) for the model's timing, the fixed costs and every trial
EXTRA_AFTER_S = 90.0
CONTEND = 0.25  # a layout is in contention within this fraction of the best pace (2 shared cores: a
# trial put 2 workers 21 % behind one, which the jobs then ran 8 % faster: advisor.json of 2026-12-05)


@dataclass(frozen=True)
class Layout:
    workers: int
    ps: int  # 0: all-reduce

    @property
    def key(self) -> str:
        return f"ar{self.workers}" if self.ps == 0 else f"{self.workers}x{self.ps}"

    @property
    def processes(self) -> int:
        """All-reduce runs one process per worker; a PS layout one, its coordinator (its servers shared)."""
        return self.workers if self.ps == 0 else 1

    @classmethod
    def parse(cls, key: str) -> Layout:
        if key.startswith("ar"):
            return cls(int(key[2:]), 0)
        w, p = key.split("x")
        return cls(int(w), int(p))


@dataclass(frozen=True)
class Trial:
    """What a layout's fit took here: the pace per step (of the cell's batch), and per epoch beyond it."""

    pace_s: float
    steps: int  # K
    epochs_s: tuple[float, ...] = ()  # the timed epochs (after the traced one)


def trial_shape(step_s: float, steps_per_epoch: int | None) -> tuple[int, int]:
    """(K, R) for a model whose one-device step is `step_s`: epochs of the fit's own length where it is
    short enough, and enough of them to read a pace; few enough steps to keep the plan to seconds (a
    distributed step costs at least the step and a few ms of dispatch)."""
    budget = max(MIN_STEPS, min(MAX_STEPS, round(STEP_BUDGET_S / (step_s + 0.005))))
    k = min(budget, steps_per_epoch) if steps_per_epoch else budget
    return k, max(MIN_EPOCHS, min(MAX_EPOCHS, round(4 * budget / k)))


def pace_of(epochs_s: list[float], steps: int) -> Trial:
    """The median timed epoch over its K steps."""
    ordered = sorted(epochs_s)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return Trial(pace_s=median / steps, steps=steps, epochs_s=tuple(round(t, 4) for t in epochs_s))


# ------------------------------------------------------------------------------------- in the trial process
def _timed_fit(fit: Any, caught: Any, dataset: Any, steps: int, epochs: int) -> Trial:
    import tensorflow as tf

    class EpochTimer(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            self.t: list[float] = []

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.t.append(time.perf_counter() - self.t0)

    timer = EpochTimer()
    data = dataset.repeat()  # a trial's steps never run out of data; the job's own fit is the cell's
    fit(caught.model, data, epochs=1 + epochs, steps_per_epoch=steps, callbacks=[timer], verbose=0)
    return pace_of(timer.t[1:], steps)  # the first traced


def _run_cell(strategy: Any, bundle_path: str) -> Any:
    """The cell, under the strategy's scope as the coordinator runs it, up to its first fit (caught)."""
    import cloudpickle

    from tfdist import payload
    from tfdist.runtime.probe import catch_fit

    with open(bundle_path, "rb") as f:
        bundle = payload.unpack(f.read())
    custom = cloudpickle.loads(bundle.custom_objects) if bundle.custom_objects else {}
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    namespace.update(custom)
    with strategy.scope():
        for name, (kind, data) in bundle.entries.items():
            namespace[name] = payload.decode(kind, data, custom, namespace)
        namespace["tfdist_strategy"] = strategy
        return catch_fit(bundle.source, bundle.line_offset, namespace)


def _spec(workers: list[int], ps: list[int]) -> dict[str, list[str]]:
    return {"worker": [f"localhost:{p}" for p in workers], "ps": [f"localhost:{p}" for p in ps]}


def _ps_strategy(layout: Layout, ports: list[int]) -> Any:
    """The layout's strategy over the first of the shared `serve` processes: its workers, then its PS."""
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(_spec(ports[: layout.workers], ports[layout.workers :]))
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    return tf.distribute.ParameterServerStrategy(resolver)


def serve(rank: int, workers: int, ports: list[int], out_path: str) -> None:
    """A server for the PS layouts' trials, a worker for the first `workers` ranks and a PS after them:
    ready (a file), then serving until stdin ends (the probe done or gone)."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(_spec(ports[:workers], ports[workers:]))
    job, index = ("worker", rank) if rank < workers else ("ps", rank - workers)
    server = tf.distribute.Server(cluster, job_name=job, task_index=index, protocol="grpc", start=True)
    open(f"{out_path}.ready{rank}", "w").close()
    sys.stdin.read()
    del server


def trial_process(layout: Layout, rank: int, ports: list[int], bundle_path: str, out_path: str) -> int:
    """One process of a layout's trial: ready (a file), then for each of the probe's words ("K R" on stdin)
    the cell's fit timed under the layout's strategy; rank 0 writes each round's Trial (or {"error": ...})
    as `out_path.N`. The cell is built afresh each round and let go after it, so only the layout being
    tried holds the model and its data (the others wait with none). Exit status 1 after an error."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    if layout.ps == 0:  # MWMS reads its cluster at creation, before any other op
        os.environ["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": [f"localhost:{p}" for p in ports[: layout.workers]]},
                "task": {"type": "worker", "index": rank},
            }
        )
    else:
        os.environ.pop("TF_CONFIG", None)
    import tensorflow as tf

    from tfdist.runtime.probe import fit_dataset

    strategy = tf.distribute.MultiWorkerMirroredStrategy() if layout.ps == 0 else None
    open(f"{out_path}.ready{rank}", "w").close()
    for n in range(ROUNDS + EXTRA_ROUNDS):
        word = sys.stdin.readline().split()
        if len(word) != 2 or not all(w.isdigit() for w in word):
            return 0  # the probe is gone, or done with this layout
        try:
            if strategy is None:
                strategy = _ps_strategy(layout, ports)
            caught = _run_cell(strategy, bundle_path)
            dataset, _, _ = fit_dataset(caught)
            trial = _timed_fit(type(caught.model).fit, caught, dataset, int(word[0]), int(word[1]))
            result: dict[str, Any] = asdict(trial)
            del caught, dataset
            gc.collect()
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"trial error (rank {rank}, round {n}): {result['error']}", file=sys.stderr, flush=True)
        if rank == 0:
            tmp = f"{out_path}.{n}.tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, f"{out_path}.{n}")
        if "error" in result:
            return 1
    return 0


# ---------------------------------------------------------------------------------------------- the probe
class Trials:
    """The trial processes of every layout, started once the cell's fit ran its first step in the probe
    (runtime.probe), run one layout at a time (each has the machine to itself) after the probe's own
    timing."""

    def __init__(
        self, layouts: list[Layout], bundle_path: str, workdir: str, launcher: HelperLauncher | None = None
    ) -> None:
        from tfdist.runtime.probecosts import _free_ports
        from tfdist.runtime.probehelpers import HelperLauncher, helper_env

        self.layouts = layouts
        self.procs: dict[str, list[ForkedHelper | subprocess.Popen]] = {}
        self.out: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self._bundle, self._workdir = bundle_path, workdir
        self._launch = launcher or HelperLauncher()  # a launcher never started: every process fresh
        self._env = helper_env()
        workers = max((lay.workers for lay in layouts if lay.ps), default=0)
        ps = max((lay.ps for lay in layouts if lay.ps), default=0)
        self.worker_ports, self.ps_ports = _free_ports(workers), _free_ports(ps)
        if workers:
            self._start("serve", workers + ps, self.worker_ports + self.ps_ports, f"serve{workers}")
        for layout in layouts:
            if layout.ps:
                ports = self.worker_ports[: layout.workers] + self.ps_ports[: layout.ps]
            else:
                ports = _free_ports(layout.workers)
            self._start(layout.key, layout.processes, ports)

    def _start(self, key: str, processes: int, ports: list[int], mode: str = "") -> None:
        out = os.path.join(self._workdir, f"trial-{key}.json")
        self.out[key], self.procs[key] = out, []
        for rank in range(processes):
            argv = [mode or key, str(rank), ",".join(map(str, ports)), self._bundle, out]
            self.procs[key].append(
                self._launch.spawn("tfdist.runtime.probetrials", argv, self._env, f"{out}.err{rank}")
            )

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Every trial process up (TensorFlow imported), so none slows what the probe times next."""
        deadline = time.monotonic() + timeout
        pending = {k: list(range(len(p))) for k, p in self.procs.items()}
        while pending:
            for key in list(pending):
                out, procs = self.out[key], self.procs[key]
                if all(os.path.exists(f"{out}.ready{r}") for r in pending[key]):
                    del pending[key]
                elif any(p.poll() is not None for p in procs):
                    self.failed[key] = "its processes did not come up: " + self._tail(key)
                    del pending[key]
            if pending and time.monotonic() > deadline:
                for key in pending:
                    self.failed[key] = f"its processes were not up in {timeout:g} s"
                return
            time.sleep(0.05)

    def run(self, layout: Layout, steps: int, epochs: int, round_no: int = 0, last: bool = True) -> Trial:
        """One round of the layout's trial, or RuntimeError saying why there is none; its processes end
        after the `last` round (or a failed one)."""
        key = layout.key
        if key in self.failed:
            raise RuntimeError(self.failed[key])
        if layout.ps and "serve" in self.failed:
            raise RuntimeError("its servers " + self.failed["serve"].removeprefix("its "))
        if layout.ps and any(p.poll() is not None for p in self.procs.get("serve", [])):
            raise RuntimeError("its servers ended: " + self._tail("serve"))
        out = f"{self.out[key]}.{round_no}"
        try:
            for p in self.procs[key]:
                assert p.stdin is not None
                p.stdin.write(f"{steps} {epochs}\n")
                p.stdin.flush()
        except OSError:
            pass  # a process already gone: said below
        deadline = time.monotonic() + TRIAL_TIMEOUT_S
        while not os.path.exists(out) and time.monotonic() < deadline:
            # the writer (rank 0) ended, or another rank failed (exit 1) or ended before its last round;
            # another rank done with its last round (exit 0) may end before rank 0 has written
            codes = [p.poll() for p in self.procs[key]]
            if codes[0] is not None or any(c is not None and (c != 0 or not last) for c in codes[1:]):
                time.sleep(0.1)  # rank 0 may have written its error just before it ended
                break
            time.sleep(0.05)
        got: dict[str, Any] | None
        try:
            with open(out) as f:
                got = json.load(f)
        except (OSError, ValueError):
            got = None
        codes = [p.poll() for p in self.procs[key]]
        if got is None or "error" in got or last:
            self._end(key)
        if got is None:
            late = time.monotonic() >= deadline
            why = f"no result in {TRIAL_TIMEOUT_S:g} s" if late else f"round {round_no} wrote nothing"
            why += f" (its processes' exit codes {codes}): {self._tail(key)}"
            raise RuntimeError(why)
        if "error" in got:
            raise RuntimeError(got["error"])
        got["epochs_s"] = tuple(got.get("epochs_s") or ())
        return Trial(**got)

    def end(self, layout: Layout) -> None:
        """The layout's processes end: it is out of the running (its servers stay for the others)."""
        self._end(layout.key)

    def _tail(self, key: str) -> str:
        for rank in range(len(self.procs[key])):
            try:
                with open(f"{self.out[key]}.err{rank}") as f:
                    lines = [ln for ln in f.read().strip().splitlines() if "rror" in ln]
            except OSError:
                continue
            if lines:
                return " / ".join(lines[-2:])[:300]
        return "no word from them"

    def _end(self, key: str) -> None:
        for p in self.procs[key]:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:
                    pass

    def close(self) -> None:
        """Nothing outlives the probe."""
        for key in self.procs:
            self._end(key)


def main(argv: list[str]) -> int:
    rank, ports = int(argv[1]), [int(p) for p in argv[2].split(",")]
    if argv[0].startswith("serve"):
        serve(rank, int(argv[0].removeprefix("serve")), ports, argv[4])
    else:
        return trial_process(Layout.parse(argv[0]), rank, ports, argv[3], argv[4])
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # its result is written: no TensorFlow teardown to wait for
