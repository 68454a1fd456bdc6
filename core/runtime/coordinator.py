"""The coordinator: runs the notebook cell against the PS/worker cluster, then sends results back.

Usage: python -m tfdist.runtime.coordinator JOBDIR   (TF_CONFIG names this task "chief")

Reads JOBDIR/payload.bin, writes JOBDIR/result.bin or JOBDIR/error.json, and reports progress as JSON
lines on the file descriptor in TFDIST_EVENTS_FD (the supervisor's pipe; stdout is the log).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from tfdist.settings import TaskSettings

if TYPE_CHECKING:
    from tfdist.job.events import LogEvent, ProgressEvent

CELL_FILENAME = "<tfdist cell>"
# Steps done are read this often during a fit (one tiny read of a variable on the PS): the heartbeat that
# shows progress within an epoch and lets the cell tell a slow job from a stuck one.
HEARTBEAT_S = TaskSettings().heartbeat_s


class _Events:
    def __init__(self) -> None:
        fd = TaskSettings().events_fd
        self._f = os.fdopen(fd, "wb", buffering=0) if fd is not None else None
        self._lock = threading.Lock()  # the heartbeat thread sends too: one whole line at a time

    def say(self, line: str) -> None:
        """tfdist's own words from the coordinator: printed into its log (a local job's supervisor relays
        that to the cell and drops any other record from this pipe) and sent as a log record (a pod's agent
        relays the pipe; the pod's stdout reaches only `%tfdist logs`)."""
        from tfdist.job.events import LogEvent

        print(line, flush=True)
        self.send(LogEvent(lines=(("chief-0", line),)))

    def send(self, event: ProgressEvent | LogEvent) -> None:
        from tfdist.job.events import encode

        with self._lock:
            if self._f is not None:
                try:
                    self._f.write(encode(event))
                except (BrokenPipeError, ValueError):
                    self._f = None


def _progress(**fields: Any) -> ProgressEvent:
    """A progress record (imported late: the coordinator's first lines run before anything heavy).
    Never raises: Keras may hand numpy counts, and a user's odd metric name must not cost the fit."""
    from tfdist.job.events import ProgressEvent

    for k in ("epoch", "epochs", "step", "steps"):
        if fields.get(k) is not None:
            try:
                fields[k] = int(fields[k])
            except (TypeError, ValueError):
                fields[k] = None
    try:
        return ProgressEvent(**fields)
    except ValueError:
        pass
    try:
        return ProgressEvent(**(fields | {"logs": None}))
    except ValueError:
        return ProgressEvent(phase=str(fields.get("phase") or "")[:200] or None)


def trained_steps(model: Any, fit_step: int) -> int:
    """The model's steps over every run of the job: its optimizer's iteration count, which a checkpoint
    restores (a resumed fit's own counter starts at 0 again), so checkpoints and what the log says of
    them count on from where the job was. `fit_step` (this fit's counter) where there is none."""
    iterations = getattr(getattr(model, "optimizer", None), "iterations", None)
    try:
        return int(iterations.numpy())
    except Exception:  # no optimizer yet, or not readable here: this fit's own count
        return fit_step


class _Heartbeat(threading.Thread):
    """Steps done in the running fit (Keras's own train counter), sent when they change."""

    def __init__(self, model: Any, events: _Events, recovery: Any = None):
        super().__init__(name="tfdist-heartbeat", daemon=True)
        self.model, self.events, self.recovery = model, events, recovery
        self.done = threading.Event()
        self.last: int | None = None
        self.checkpoint_error: str | None = None

    def read(self) -> None:
        counter = getattr(self.model, "_train_counter", None)
        if counter is None:
            raise AttributeError("no train counter")
        step = int(counter.numpy())
        if self.recovery is not None:  # --checkpoint-every: a checkpoint each N steps
            self._checkpoint(trained_steps(self.model, step))
        if step != self.last:
            self.last = step
            self.events.send(_progress(phase="fit", step=step, t=time.time()))

    def _checkpoint(self, step: int) -> None:
        """A checkpoint that cannot be written is said once, and the fit goes on: the heartbeat (the
        cell's progress) must not end with it, and the next one is tried N steps later."""
        rec = self.recovery
        try:
            if rec.on_step(step) and rec.saved == 1:
                self.events.say(
                    f"tfdist: checkpoint written at step {step} (every {rec.every} steps; a lost parameter "
                    "server resumes from the newest)"
                )
        except Exception as exc:
            rec.last_saved_step = step
            said = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            if said != self.checkpoint_error:
                self.checkpoint_error = said
                self.events.say(
                    f"tfdist: the checkpoint at step {step} could not be written ({said}); the fit goes on "
                    f"and tries again {rec.every} steps later"
                )

    def run(self) -> None:
        while not self.done.wait(HEARTBEAT_S):
            try:
                self.read()
            except Exception:  # unreadable here (or the PS is gone): epochs still report
                return


def _progress_callback(events: _Events, recovery: Any = None) -> Any:
    import tensorflow as tf

    class TfdistProgress(tf.keras.callbacks.Callback):
        """Epoch-level progress: PS training has no batch-level callbacks."""

        def on_train_begin(self, logs=None):
            self._t0 = time.time()
            if recovery is not None:
                recovery.mark_start(trained_steps(self.model, int(self.model._train_counter.numpy())))
            events.send(
                _progress(
                    phase="fit",
                    epoch=recovery.epoch if recovery is not None else 0,
                    step=0,
                    epochs=self.params.get("epochs"),
                )
            )
            self._beat = _Heartbeat(self.model, events, recovery)
            self._beat.start()

        def on_train_end(self, logs=None):
            beat = getattr(self, "_beat", None)
            if beat is not None:
                beat.done.set()
                beat.join(timeout=HEARTBEAT_S + 5)

        def on_epoch_end(self, epoch, logs=None):
            from tfdist.runtime.events import clean_number

            if recovery is not None:
                recovery.on_epoch_end(epoch, {k: clean_number(v) for k, v in (logs or {}).items()})
            events.send(
                _progress(
                    phase="fit",
                    epoch=epoch + 1,
                    epochs=self.params.get("epochs"),
                    steps=self.params.get("steps"),
                    logs={k: clean_number(v) for k, v in (logs or {}).items()},
                    t=time.time(),
                )
            )

    return TfdistProgress


def _install_progress(events: _Events, recovery: Any = None) -> None:
    """Every fit in the cell reports its epochs, whatever callbacks the user passed; with
    --checkpoint-every, the first fit checkpoints and resumes after a PS loss (runtime.psrecovery)."""
    import tensorflow as tf

    original = tf.keras.Model.fit

    def fit(self, *args, **kwargs):
        rec = None
        if recovery is not None and not recovery.used:
            recovery.used, rec = True, recovery
        callbacks = list(kwargs.pop("callbacks", None) or [])
        callbacks.append(_progress_callback(events, rec)())
        kwargs["callbacks"] = callbacks
        if rec is None:
            return original(self, *args, **kwargs)
        resumed = rec.attach(self)
        start = rec.epoch if resumed is not None else 0
        if resumed is not None:
            kwargs["initial_epoch"] = start
            print(f"tfdist: resumed from the checkpoint at step {resumed['step']} (epoch {start + 1})")
        return rec.merge_history(original(self, *args, **kwargs), start)

    tf.keras.Model.fit = fit


def _keep_functions_registered() -> None:
    """The cell's traced functions stay registered in the cluster's eager contexts until this process exits.
    TensorFlow removes a garbage-collected function from every context of the cluster, and the first removal
    waits for the cluster's pending work. At the end of a PS fit, removing its per-worker dataset's functions
    held the fit 1.0-1.9 s in half the runs. Cell start to cell end was 8.32 s with the removal and 6.44 s
    without it (0.77x; medians of 8 interleaved pairs, benchmarks/results/fit_end.json). The coordinator ends
    with its job, which frees them all at once."""
    from tensorflow.python.eager import context

    original = getattr(context.Context, "remove_function", None)
    if original is None or hasattr(context.Context, "_tfdist_tf_remove_function"):
        return
    context.Context._tfdist_tf_remove_function = original  # what benchmarks/bench_fit_end.py compares with
    context.Context.remove_function = lambda self, name: None


def cell_traceback(exc: BaseException) -> str:
    """The remote traceback from the cell's first frame on: the user's code, with the cell's line numbers."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != CELL_FILENAME:
        tb = tb.tb_next
    frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_tb(exc.__traceback__)
    lines = ["Traceback (on the coordinator):\n"]
    source = os.environ.get("_TFDIST_CELL_SOURCE", "").splitlines()
    for fr in frames:
        line = fr.line
        if fr.filename == CELL_FILENAME and 0 < fr.lineno <= len(source):
            line = source[fr.lineno - 1].strip()
        where = "cell" if fr.filename == CELL_FILENAME else fr.filename
        lines.append(f"  {where}, line {fr.lineno}, in {fr.name}\n" + (f"    {line}\n" if line else ""))
    lines.extend(traceback.format_exception_only(type(exc), exc))
    return "".join(lines)


def run(jobdir: str) -> int:
    events = _Events()
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    from tfdist import payload
    from tfdist.taskenv import ensure_threads

    ensure_threads()  # before TensorFlow reads them

    with open(os.path.join(jobdir, "payload.bin"), "rb") as f:
        bundle = payload.unpack(f.read())
    padded = "\n" * bundle.line_offset + bundle.source
    os.environ["_TFDIST_CELL_SOURCE"] = padded
    try:
        code = compile(padded, CELL_FILENAME, "exec")
        events.send(_progress(phase="connecting"))
        import cloudpickle

        from tfdist.runtime import strategy as strategies

        strategy = strategies.make()
        _keep_functions_registered()
        custom = cloudpickle.loads(bundle.custom_objects) if bundle.custom_objects else {}
        namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        namespace.update(custom)
        events.send(_progress(phase="loading"))
        models: dict[str, Any] = {}
        with strategy.scope():
            for name, (kind, data) in bundle.entries.items():
                namespace[name] = payload.decode(kind, data, custom, models)
                if kind == "keras_model":
                    models[name] = namespace[name]
        namespace["tfdist_strategy"] = strategy
        from tfdist.runtime import psrecovery

        saved = psrecovery.settings()
        recovery = psrecovery.Recovery(*saved, io_device=strategies.COORDINATOR_CPU) if saved else None
        _install_progress(events, recovery)
        events.send(_progress(phase="running"))
        with strategy.scope():
            exec(code, namespace)
        if not strategies.speaks_for_job():  # an all-reduce worker: chief-0 returns the results
            return 0
        binds = payload.cell_names(padded).binds
        events.send(_progress(phase="returning"))
        blob = payload.pack_results(namespace, binds, models)
        tmp = os.path.join(jobdir, "result.bin.tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, os.path.join(jobdir, "result.bin"))
        return 0
    except BaseException as exc:  # the cell's own errors included: report, then exit non-zero
        err = {"type": type(exc).__name__, "message": str(exc), "traceback": cell_traceback(exc)}
        task = TaskSettings().task or "chief-0"
        name = "error.json" if task == "chief-0" else f"error-{task}.json"  # all-reduce workers: their own
        with open(os.path.join(jobdir, name), "w") as f:
            json.dump(err, f)
        sys.stderr.write(err["traceback"])
        return 1


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
