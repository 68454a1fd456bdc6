"""Measure a cell's fit for `%tfdist plan`: a short-lived process, never the kernel (the kernel's own
TensorFlow stays untouched, and nothing connects to a cluster).

Usage: python -m tfdist.runtime.probe BUNDLE OUT_JSON [SPLIT [TRIALS]]

The bundle is the one `%%tfdist run` would ship: the cell's source and the notebook names it reads. The
cell runs here as it would on the job's coordinator, up to its first `fit`, which is caught, not run: its
model and arguments (evaluated where the run would evaluate them) are what is measured. A few steps are
trained (the first ones trace the graph and are not counted), at the cell's batch and, with SPLIT, at
the cell's batch split over SPLIT replicas (all-reduce's per-replica batch). Then the fixed costs of a
distributed step are measured on this machine (`tfdist.runtime.probecosts`). With TRIALS (layout keys,
comma-separated: `1x1,2x1,2x2,ar2`), each of those layouts also runs the cell's fit for a few steps
(`tfdist.runtime.probetrials`): what a local CPU plan predicts from. Writes a `ProbeResult` as JSON; on
failure {"error": ...}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tfdist.runtime.probecosts import FIXED_COSTS_TIMEOUT_S, Collective, measure_ps_costs, within
from tfdist.runtime.probehelpers import HelperLauncher, helper_env
from tfdist.runtime.probetrials import (
    CONTEND,
    EXTRA_AFTER_S,
    EXTRA_ROUNDS,
    MIN_EPOCHS,
    ROUNDS,
    Layout,
    Trials,
    pace_of,
    trial_shape,
)
from tfdist.settings import KernelSettings, TaskSettings

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
    grad_bytes: int  # what a step's gradients move (sparse ones: the rows they touch)
    params: int
    step_bytes: list[int] = field(default_factory=list)  # per variable, what a step pulls (and pushes)
    split_step_s: list[tuple[int, float]] = field(default_factory=list)  # (per-replica batch, median step)
    steps_per_epoch: int | None = None  # the fit's own (evaluated), else the dataset's cardinality
    epochs: int | None = None
    costs: dict[str, float] = field(default_factory=dict)  # measured here: advisor.COSTS names
    costs_error: str = ""  # why the fixed costs could not be measured (the plan then assumes them)
    trials: dict[str, dict[str, float]] = field(default_factory=dict)  # layout key -> probetrials.Trial
    trial_errors: dict[str, str] = field(default_factory=dict)  # layout key -> why it has no trial
    trial_round_epochs: int = 0  # timed epochs of one trial round
    trial_extra: list[str] = field(default_factory=list)  # layouts in contention: two more rounds


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


def warm_steps(model: Any, dataset: Any, after_first: Callable[[], None] = lambda: None) -> tuple[Any, Any]:
    """The model's own train step and its input, run WARMUP_STEPS times untimed (the first traces it):
    a model or data that fit cannot take fails here, before `after_first` is called."""
    it = iter(dataset.repeat())  # a tf.data iterator, as fit passes it (input time included, as in fit)
    fn = model.make_train_function(force=True)
    for i in range(WARMUP_STEPS):
        fn(it)
        if i == 0:
            after_first()
    return fn, it


def time_steps(model: Any, dataset: Any, warmed: tuple[Any, Any] | None = None) -> tuple[float, int, float]:
    """Median step time of the model's own train step on batches of `dataset`, steps timed, cores used."""
    fn, it = warmed or warm_steps(model, dataset)
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


def step_bytes(model: Any, dataset: Any) -> list[int]:
    """Per variable (creation order), the bytes one step moves each way between a worker and its PS: a
    gradient that comes as IndexedSlices (an embedding's) moves the rows its batch touches, and the
    lookup pulls only those (both run on the PS); any other variable moves whole. From one gradient of a
    real batch, as the train step computes it."""
    import tensorflow as tf

    x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(next(iter(dataset.take(1))))
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x, y, y_pred, sample_weight)
    trainable = model.trainable_variables
    grads = tape.gradient(loss, trainable)
    sparse: dict[Any, int] = {}
    for v, g in zip(trainable, grads, strict=True):
        if isinstance(g, tf.IndexedSlices):
            rows = int(g.values.shape.num_elements() * g.values.dtype.size)
            sparse[v.ref()] = rows + int(g.indices.shape.num_elements() * g.indices.dtype.size)
    return [sparse.get(v.ref(), int(v.shape.num_elements() * v.dtype.size)) for v in model.variables]


def measure(
    model: Any,
    dataset: Any,
    split: int = 1,
    after_first_step: Callable[[], None] = lambda: None,
    before_timing: Callable[[], None] = lambda: None,
) -> ProbeResult:
    """The fit's steps, timed once `before_timing` returned; `after_first_step`: the fit's first step ran
    (a fit that cannot run has failed before it)."""
    batch = _batch_size(next(iter(dataset.take(1))))
    warmed = warm_steps(model, dataset, after_first_step)
    before_timing()
    step_s, timed, cores = time_steps(model, dataset, warmed)
    split_step: list[tuple[int, float]] = []
    if split > 1 and batch // split >= 1:  # all-reduce runs the cell's batch split over the replicas
        per_replica = batch // split
        split_step.append((per_replica, time_steps(model, dataset.unbatch().batch(per_replica))[0]))
    variables = list(model.variables)
    try:
        moved = step_bytes(model, dataset)
    except Exception:  # a model whose loss this cannot call as its train step does: every variable whole
        moved = [int(v.shape.num_elements() * v.dtype.size) for v in variables]
    trainable = {v.ref() for v in model.trainable_variables}
    return ProbeResult(
        step_s=step_s,
        steps_timed=timed,
        cores_used=cores,
        batch=batch,
        var_bytes=[int(v.shape.num_elements() * v.dtype.size) for v in variables],
        var_names=[v.name for v in variables],
        grad_bytes=sum(b for v, b in zip(variables, moved, strict=True) if v.ref() in trainable),
        params=int(sum(v.shape.num_elements() for v in model.trainable_variables)),
        step_bytes=moved,
        split_step_s=split_step,
    )


def main(argv: list[str]) -> int:
    bundle_path, out_path = argv[0], argv[1]
    split = int(argv[2]) if len(argv) > 2 else 1
    layouts = [Layout.parse(k) for k in argv[3].split(",")] if len(argv) > 3 and argv[3] else []
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if TaskSettings().netns:  # the plan started it in a network namespace of its own (kernel_magics.plan)
        from tfdist.runtime.netns import bring_up_loopback

        bring_up_loopback()
    from tfdist.taskenv import ensure_threads

    ensure_threads()  # before the helpers' fork server imports TensorFlow: their pools are the probe's
    launcher = HelperLauncher()
    launcher.start(helper_env())  # its import shares the cores with the probe's own, not after it
    helpers = _Helpers(layouts, bundle_path, os.path.dirname(os.path.abspath(out_path)), launcher)
    try:
        return _probe(bundle_path, out_path, split, helpers)
    finally:
        helpers.close()
        launcher.close()


class _Helpers:
    """The probe's helper processes: the layouts' trials, or else the collective whose fixed costs
    all-reduce is predicted from. Started once the cell's fit has run one step here, so a cell that
    cannot be planned is refused in the seconds the probe's own import takes, not after every helper's
    TensorFlow import on the same cores (on 2 cores: ~40 s more per refused cell); their imports still
    overlap the rest of the probe's warm-up."""

    def __init__(
        self, layouts: list[Layout], bundle_path: str, workdir: str, launcher: HelperLauncher
    ) -> None:
        self.layouts, self.bundle_path, self.workdir = layouts, bundle_path, workdir
        self.launcher = launcher
        self.trials: Trials | None = None
        self.collective: Collective | None = None

    def start(self) -> None:
        if self.layouts and self.trials is None:
            self.trials = Trials(self.layouts, self.bundle_path, self.workdir, self.launcher)
        if self.collective is None and not any(lay.ps == 0 for lay in self.layouts):
            self.collective = Collective(self.launcher)

    def wait_ready(self) -> None:  # their imports would slow the model's timed steps
        if self.trials is not None:
            self.trials.wait_ready()
        if self.collective is not None:
            try:
                self.collective.wait_ready()
            except RuntimeError:
                pass  # said where its costs are measured

    def close(self) -> None:
        if self.trials is not None:
            self.trials.close()
        if self.collective is not None:
            self.collective.close()


def _probe(bundle_path: str, out_path: str, split: int, helpers: _Helpers) -> int:
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
            namespace[name] = payload.decode(kind, data, custom, namespace)
        namespace["tfdist_strategy"] = tf.distribute.get_strategy()  # as the job's cell sees one
        caught = catch_fit(bundle.source, bundle.line_offset, namespace)
        dataset, steps, epochs = fit_dataset(caught)
        result = measure(
            caught.model, dataset, split, after_first_step=helpers.start, before_timing=helpers.wait_ready
        )
        result.steps_per_epoch, result.epochs = steps, epochs
    except Exception as exc:
        with open(out_path, "w") as f:
            json.dump({"error": f"{type(exc).__name__}: {str(exc)[:500]}"}, f)
        return 1
    if helpers.trials is not None:
        run_trials(helpers.trials, result)
    errors = []
    costs: list[tuple[str, Callable[[int], dict[str, float]]]] = [("PS", measure_ps_costs)]
    if helpers.collective is not None:
        costs.append(("all-reduce", helpers.collective.measure))
    for what, fn in costs:
        try:  # the plan still stands without them, on assumed costs, and says so
            result.costs |= within(fn, result.grad_bytes)
        except TimeoutError:
            errors.append(f"{what}: no answer in {FIXED_COSTS_TIMEOUT_S:g} s")
        except Exception as exc:
            errors.append(f"{what}: {type(exc).__name__}: {str(exc)[:300]}")
    result.costs_error = "; ".join(errors)
    with open(out_path, "w") as f:
        json.dump(asdict(result), f)
    return 0  # a stuck in-process server cannot keep the probe waiting: it ends with os._exit


def run_trials(trials: Trials, result: ProbeResult) -> None:
    """Each layout's trial in `ROUNDS` rounds, the layouts in mirrored order (each layout's trials at
    several moments and places in line), one layout at a time, its epochs sized by the model's step and the
    fit's epoch; then `EXTRA_ROUNDS` more for the layouts still in contention. The pace is the median of
    every timed epoch. A PS layout with more PS than the model has variables is not one the plan offers,
    so it is not tried."""
    steps, epochs = trial_shape(result.step_s, result.steps_per_epoch)
    per_round = max(MIN_EPOCHS, -(-epochs // ROUNDS))
    layouts = [lay for lay in trials.layouts if lay.ps <= len(result.var_bytes)]
    timed: dict[str, list[float]] = {lay.key: [] for lay in layouts}
    over: set[str] = set()  # layouts whose processes ended (a round failed)

    def one_round(n: int, order: list[Layout], last: bool) -> None:
        for layout in order if n % 2 == 0 else order[::-1]:
            if layout.key in over:
                continue
            try:
                trial = trials.run(layout, steps, per_round, n, last=last)
            except RuntimeError as exc:
                over.add(layout.key)
                if not timed[layout.key]:  # a later round's failure keeps the epochs measured before it
                    result.trial_errors[layout.key] = str(exc)
                continue
            timed[layout.key] += trial.epochs_s

    result.trial_round_epochs = per_round
    started = time.monotonic()
    for n in range(ROUNDS):
        one_round(n, layouts, last=False)
    close = contenders(layouts, timed, steps, over)
    if time.monotonic() - started > EXTRA_AFTER_S:  # a slow model: the plan's own timeout comes first
        close = []
    for layout in trials.layouts:
        if layout not in close:
            trials.end(layout)
    if len(close) > 1:
        result.trial_extra = [lay.key for lay in close]
    for n in range(ROUNDS, ROUNDS + EXTRA_ROUNDS if len(close) > 1 else ROUNDS):
        one_round(n, close, last=n == ROUNDS + EXTRA_ROUNDS - 1)
    for layout in close:
        trials.end(layout)  # one alone in contention had no more rounds
    for key, epochs_s in timed.items():
        if epochs_s:
            result.trials[key] = asdict(pace_of(epochs_s, steps))


def contenders(
    layouts: list[Layout], timed: dict[str, list[float]], steps: int, over: set[str]
) -> list[Layout]:
    """The layouts still running whose pace so far is within CONTEND of the best one's."""
    paces = {
        lay.key: pace_of(timed[lay.key], steps).pace_s
        for lay in layouts
        if timed[lay.key] and lay.key not in over
    }
    if not paces:
        return []
    best = min(paces.values())
    return [lay for lay in layouts if lay.key in paces and paces[lay.key] <= best * (1 + CONTEND)]


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the output is written and the helpers ended: no TensorFlow teardown to wait for
