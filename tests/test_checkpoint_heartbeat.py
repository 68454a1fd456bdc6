"""`--checkpoint-every`: the coordinator's heartbeat writes the checkpoints, says the first one written, and
says a checkpoint that cannot be written once, then goes on (its progress records and later checkpoints).

Before, the first failed save ended the heartbeat thread without a word: the cell's progress within an
epoch stopped, no checkpoint was written for the rest of the fit, and a lost PS resumed "from the start"
(in pods every save failed: TensorFlow wrote each shard on the PS, where the coordinator pod's directory
does not exist; tests/test_k8s_realnode_psrestart.py runs that for real).
"""

from __future__ import annotations

import json

from tfdist.job.events import LogEvent, ProgressEvent
from tfdist.runtime.coordinator import _Heartbeat
from tfdist.runtime.psrecovery import Recovery


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def numpy(self) -> int:
        return self.value


class Model:
    def __init__(self) -> None:
        self._train_counter = Counter()


class Events:
    def __init__(self) -> None:
        self.sent: list[ProgressEvent | LogEvent] = []
        self.said: list[str] = []

    def send(self, event: ProgressEvent | LogEvent) -> None:
        self.sent.append(event)

    def say(self, line: str) -> None:
        self.said.append(line)


class Manager:
    """CheckpointManager's save as the heartbeat calls it; fails while `error` is set, as TensorFlow does
    (an OpError's message spans lines)."""

    def __init__(self) -> None:
        self.error: Exception | None = None
        self.saved: list[tuple[int, object]] = []

    def save(self, checkpoint_number: int, options: object = None) -> str:
        if self.error is not None:
            raise self.error
        self.saved.append((checkpoint_number, options))
        return f"ckpt-{checkpoint_number}"


def test_a_failed_checkpoint_is_said_once_and_the_heartbeat_and_later_checkpoints_go_on(tmp_path):
    rec = Recovery(10, str(tmp_path), io_device="/job:chief/replica:0/task:0/device:CPU:0")
    rec.manager, rec.options = Manager(), object()
    rec.mark_start(0)
    model, events = Model(), Events()
    beat = _Heartbeat(model, events, rec)

    rec.manager.error = OSError("NOT_FOUND: /tmp/job/ckpt/ckpt-12_temp; No such file or directory\n\tmore")
    model._train_counter.value = 12
    beat.read()
    model._train_counter.value = 30  # the same error again: not said again
    beat.read()
    assert events.said == [
        "tfdist: the checkpoint at step 12 could not be written (OSError: NOT_FOUND: /tmp/job/ckpt/"
        "ckpt-12_temp; No such file or directory); the fit goes on and tries again 10 steps later"
    ]
    assert [e.step for e in events.sent if isinstance(e, ProgressEvent)] == [12, 30]  # progress goes on
    assert rec.saved == 0 and not (tmp_path / "progress.json").exists()

    rec.manager.error = None
    model._train_counter.value = 35  # tried again 10 steps after the last try (30)
    beat.read()
    model._train_counter.value = 40
    beat.read()
    model._train_counter.value = 52
    beat.read()
    assert [n for n, _ in rec.manager.saved] == [40, 52]
    assert all(opts is rec.options for _, opts in rec.manager.saved)  # the coordinator does the I/O
    assert events.said[1:] == [
        "tfdist: checkpoint written at step 40 (every 10 steps; a lost parameter server resumes from the "
        "newest)"
    ]
    assert json.loads((tmp_path / "progress.json").read_text())["step"] == 52

    rec.manager.error = RuntimeError("")  # another error: said, with its type when it has no message
    model._train_counter.value = 62
    beat.read()
    assert events.said[-1].startswith(
        "tfdist: the checkpoint at step 62 could not be written (RuntimeError: )"
    )


def test_the_checkpoint_files_are_written_by_the_coordinators_own_cpu(tmp_path):
    """Recovery.attach makes TensorFlow's options with the io device it was given (the coordinator's CPU in
    a PS job), used for the save and for the restore."""
    import tensorflow as tf

    from tfdist.runtime import strategy

    model = tf.keras.Sequential([tf.keras.layers.Dense(2)])
    model.build((None, 3))
    model.compile(optimizer="sgd", loss="mse")
    rec = Recovery(5, str(tmp_path / "ckpt"), io_device="/job:localhost/replica:0/task:0/device:CPU:0")
    assert rec.attach(model) is None
    assert rec.options.experimental_io_device == "/job:localhost/replica:0/task:0/device:CPU:0"
    rec.mark_start(0)
    assert rec.on_step(5) and rec.saved == 1
    again = Recovery(5, str(tmp_path / "ckpt"), io_device="/job:localhost/replica:0/task:0/device:CPU:0")
    assert again.attach(model)["step"] == 5  # restored through the same device
    assert strategy.COORDINATOR_CPU == "/job:chief/replica:0/task:0/device:CPU:0"


def test_a_resumed_fit_numbers_its_checkpoints_on_from_the_restored_optimizer(tmp_path):
    """A resumed fit's own step counter starts at 0 again; its optimizer's iteration count comes back with
    the checkpoint, so the checkpoints (and what the log says of them) count on from where the job was."""
    from types import SimpleNamespace

    from tfdist.runtime.coordinator import trained_steps

    rec = Recovery(10, str(tmp_path))
    rec.manager, rec.options = Manager(), None
    model, events = Model(), Events()
    model.optimizer = SimpleNamespace(iterations=Counter())
    model.optimizer.iterations.value = 220  # restored from the checkpoint at step 220
    rec.mark_start(trained_steps(model, 0))
    beat = _Heartbeat(model, events, rec)
    model._train_counter.value, model.optimizer.iterations.value = 8, 228
    beat.read()
    model._train_counter.value, model.optimizer.iterations.value = 15, 235
    beat.read()
    assert [n for n, _ in rec.manager.saved] == [235]
    assert events.said == [
        "tfdist: checkpoint written at step 235 (every 10 steps; a lost parameter server resumes from the "
        "newest)"
    ]
    assert [e.step for e in events.sent if isinstance(e, ProgressEvent)] == [8, 15]  # the cell: this fit's
    assert trained_steps(Model(), 7) == 7  # no optimizer (or none readable): this fit's own count
