"""One sampler per Jupyter server: this machine's GPUs (or CPU) once a second into a ring buffer.

Every tab's poll reads the buffer, so three open tabs cost what one does: the sampling work does not
grow with viewers (the style guide's warning about computing metrics inside `get()`). The callback
starts with the first request and stops when nobody has asked for a while, so an idle server costs nothing.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import psutil
from tornado.ioloop import PeriodicCallback

from ..gpus import GpuInfo, visible_gpus
from ..sampler import GpuReader

HISTORY = 120  # two minutes at 1 Hz: what a sparkline shows
IDLE_STOP_S = 30.0  # stop sampling when no tab has asked for this long


def _label(g: GpuInfo) -> str:
    """A device's name as shown: the model, and a MIG instance's profile (two slices of one GPU share its
    index)."""
    return f"{g.name} MIG {g.mig_profile}" if g.mig_profile else g.name


class ServerSampler:
    """The ring buffer of `{"t", "cpu (%)", "mem (%)", "gpus": [GpuReader.read()...]}` samples, one entry
    per device this server was given: a whole GPU, or a MIG instance (its own memory; utilization None with
    ``util_missing: "mig"``, never its parent GPU's)."""

    def __init__(
        self, interval_s: float = 1.0, history: int = HISTORY, gpus: GpuReader | None = None
    ) -> None:
        self.interval_s = interval_s
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=history)
        self._gpus = gpus
        self._devices: list[GpuInfo] | None = None
        self._pc: PeriodicCallback | None = None
        self._last_read = 0.0

    # The reader opens NVML: done once, on first use, not at server start.
    def _reader(self) -> GpuReader:
        if self._gpus is None:
            self._gpus = GpuReader()
        if self._devices is None:
            try:
                infos = visible_gpus()
            except Exception:  # no driver, odd CUDA_VISIBLE_DEVICES: this server simply has no GPU
                infos = []
            self._devices = infos if self._gpus.available else []
        return self._gpus

    @property
    def running(self) -> bool:
        return self._pc is not None and self._pc.is_running()

    def touch(self) -> None:
        """A tab asked: make sure the callback runs (and take a first sample now, not in a second)."""
        self._last_read = time.monotonic()
        if not self.running:
            psutil.cpu_percent(None)  # prime: the first call always answers 0.0
            self.sample()
            self._pc = PeriodicCallback(self._tick, self.interval_s * 1000)
            self._pc.start()

    def _tick(self) -> None:
        if time.monotonic() - self._last_read > IDLE_STOP_S:
            self.stop()
            return
        self.sample()

    def sample(self) -> dict[str, Any]:
        reader = self._reader()
        rec = {
            "t": time.time(),
            "cpu (%)": psutil.cpu_percent(None),
            "mem (%)": psutil.virtual_memory().percent,
            "gpus": [{**reader.read(g), "name": _label(g)} for g in self._devices or []],
        }
        self.samples.append(rec)
        return rec

    def snapshot(self) -> dict[str, Any]:
        """What GET gpus answers: the device list and the history, oldest first."""
        self.touch()
        self._reader()
        return {
            "gpu_count": len(self._devices or []),
            "gpus": [{"index": g.index, "name": _label(g)} for g in self._devices or []],
            "cpu_count": psutil.cpu_count() or 1,
            "interval_s": self.interval_s,
            "samples": list(self.samples),
        }

    def stop(self) -> None:
        if self._pc is not None:
            self._pc.stop()
            self._pc = None
