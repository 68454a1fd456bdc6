"""A parameter server that comes back (`--checkpoint-every N`, PS jobs, coordinator side).

TensorFlow cannot recover a ParameterServerStrategy fit from a lost PS without restarting the coordinator
("It is not supported to recover from parameter server failure without restarting the coordinator task"),
and Keras's BackupAndRestore saves only at epoch ends under PSS (batch-level callbacks are refused). So:

* while a fit runs, the coordinator's heartbeat (which already reads Keras's step counter every 2 s)
  writes a checkpoint of the model and its optimizer whenever N more steps are done, with the epoch in
  progress and the epoch logs so far (`JOBDIR/ckpt/`). The coordinator's own CPU does the file I/O
  (`experimental_io_device`): TensorFlow otherwise writes each variable's shard on the PS that holds it,
  and in a PS pod the coordinator pod's directory does not exist. That save failed on the PS, and the
  failed op cancelled the fit's steps running there;
* when a PS dies, the supervisor restarts it and the coordinator; the new coordinator runs the cell
  again, and its fit restores the last checkpoint and resumes at the epoch that was in progress
  (`initial_epoch`); at most N steps of weight updates, plus the part of that epoch already done, are
  computed again;
* the History the cell gets back is one history: the epochs finished before the loss, then the rest.

One fit per cell is resumed (the first; later fits run as written).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from tfdist.settings import ENV_CHECKPOINT_DIR, ENV_CHECKPOINT_EVERY, TaskSettings

ENV_EVERY, ENV_DIR = ENV_CHECKPOINT_EVERY, ENV_CHECKPOINT_DIR  # written by psrestart and the manifests
CKPT_DIR = "ckpt"  # under the job's directory


def checkpoint_env(every: int, jobdir: str) -> dict[str, str]:
    """The coordinator's checkpoint settings (`settings`): every N steps, into JOBDIR/ckpt."""
    return {ENV_EVERY: str(every), ENV_DIR: os.path.join(jobdir, CKPT_DIR)}


def pod_checkpoint_every(ts: TaskSettings) -> int | None:
    """A coordinator pod's --checkpoint-every, when its job has a PS to come back from (else None)."""
    every, cluster = ts.checkpoint_every, ts.cluster
    return every if every is not None and cluster and cluster.get("ps") else None


def settings() -> tuple[int, str] | None:
    ts = TaskSettings()
    every, where = ts.checkpoint_every, ts.checkpoint_dir
    if every is None or not where:
        return None
    return every, where


class Recovery:
    """Checkpoints of one fit, and the resume of that fit after a restart. `io_device`: where the files
    are read and written (the coordinator's CPU; None: where each variable lives)."""

    def __init__(self, every: int, where: str, io_device: str | None = None):
        self.every, self.where, self.io_device = every, where, io_device
        self.saved = 0  # checkpoints written by this run
        self.options: Any = None  # tf.train.CheckpointOptions, made with the manager
        self.meta_path = os.path.join(where, "progress.json")
        self.epoch = 0  # the epoch in progress (0-based)
        self.epoch_logs: list[dict[str, float]] = []
        self.last_saved_step: int | None = None
        self.manager: Any = None
        self.lock = threading.Lock()
        self.used = False

    def load_meta(self) -> dict[str, Any] | None:
        try:
            with open(self.meta_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def attach(self, model: Any) -> dict[str, Any] | None:
        """Before the fit: a checkpoint manager for this model; restore and return the saved progress."""
        import tensorflow as tf

        os.makedirs(self.where, exist_ok=True)
        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        self.manager = tf.train.CheckpointManager(ckpt, self.where, max_to_keep=2)
        self.options = tf.train.CheckpointOptions(experimental_io_device=self.io_device)
        meta = self.load_meta()
        if meta and self.manager.latest_checkpoint:
            ckpt.restore(self.manager.latest_checkpoint, options=self.options)
            self.epoch = int(meta["epoch"])
            self.epoch_logs = list(meta["epoch_logs"])[: self.epoch]
            self.last_saved_step = int(meta["step"])
            return meta
        return None

    def mark_start(self, step: int) -> None:
        """The fit's step counter as it starts: checkpoints come every N steps from here."""
        self.last_saved_step = step

    def on_step(self, step: int) -> bool:
        """From the heartbeat: a checkpoint each time `every` more steps are done (True: one was written).
        Raises what TensorFlow raised when the checkpoint could not be written."""
        if self.manager is None or self.last_saved_step is None or step - self.last_saved_step < self.every:
            return False
        with self.lock:
            self.manager.save(checkpoint_number=step, options=self.options)
            self.last_saved_step = step
            self.saved += 1
            tmp = self.meta_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"step": step, "epoch": self.epoch, "epoch_logs": self.epoch_logs}, f)
            os.replace(tmp, self.meta_path)
        return True

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        with self.lock:
            self.epoch_logs = [*self.epoch_logs[:epoch], logs]
            self.epoch = epoch + 1

    def merge_history(self, history: Any, resumed_at: int) -> Any:
        """Prefix the History of a resumed fit with the epochs finished before the restart."""
        if history is None or resumed_at <= 0:
            return history
        before = self.epoch_logs[:resumed_at]
        merged: dict[str, list] = {}
        for key in set(history.history) | {k for logs in before for k in logs}:
            merged[key] = [logs.get(key) for logs in before] + list(history.history.get(key, []))
        history.history = merged
        history.epoch = list(range(resumed_at)) + list(history.epoch)
        return history
