"""What is known about one job, rebuilt from its event stream.

The supervisor keeps one to answer late subscribers with a snapshot; the cell's monitor, `%tfdist status`
and the lab panel fold the same events into their own copy. A pure reducer: no I/O, easy to test.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

TERMINAL = ("succeeded", "failed", "stopped")
METRICS_KEEP = 600  # ten minutes at 1 Hz
LOG_KEEP = 400


@dataclass
class JobView:
    name: str = ""
    user: str = ""
    backend: str = "local"
    state: str = "pending"  # pending -> starting -> running -> succeeded | failed | stopped
    message: str = ""
    created: float = field(default_factory=time.time)
    ended: float | None = None
    total_tasks: int = 0
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {state, restarts, gpus}
    phase: str = ""
    epoch: int = 0
    epochs: int | None = None
    epoch_logs: list[dict[str, Any]] = field(default_factory=list)  # one dict per finished epoch (+ "t")
    metrics: collections.deque = field(default_factory=lambda: collections.deque(maxlen=METRICS_KEEP))
    logs: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LOG_KEEP))
    error: dict[str, Any] | None = None
    spec: dict[str, Any] = field(default_factory=dict)

    @property
    def started_tasks(self) -> int:
        return sum(
            1
            for t in self.tasks.values()
            if t.get("state") in ("running", "restarting", "exited-ok", "exited")
        )

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def apply(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if kind == "snapshot":
            self.__dict__.update(JobView.from_dict(ev["view"]).__dict__)
        elif kind == "state":
            self.state = ev["state"]
            self.message = ev.get("message", self.message)
            if self.finished and self.ended is None:
                self.ended = ev.get("t", time.time())
            if "error" in ev:
                self.error = ev["error"]
        elif kind == "task":
            rec = self.tasks.setdefault(ev["task"], {"state": "pending", "restarts": 0, "gpus": []})
            for k in ("state", "restarts", "gpus", "exit_code", "pid"):
                if k in ev:
                    rec[k] = ev[k]
        elif kind == "progress":
            self.phase = ev.get("phase", self.phase)
            if ev.get("epochs") is not None:
                self.epochs = ev["epochs"]
            if "epoch" in ev:
                self.epoch = ev["epoch"]
            if ev.get("logs") is not None:
                self.epoch_logs.append({**ev["logs"], "epoch": ev.get("epoch"), "t": ev.get("t")})
        elif kind == "metrics":
            self.metrics.append({"t": ev["t"], "tasks": ev["tasks"]})
        elif kind == "log":
            for task, line in ev.get("lines", []):
                self.logs.append((task, line))

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["metrics"] = list(self.metrics)
        d["logs"] = [list(x) for x in self.logs]
        return d

    def summary(self) -> dict[str, Any]:
        """The small form for lists (the lab panel, `%tfdist list`)."""
        last = self.metrics[-1]["tasks"] if self.metrics else {}
        gpu_util = [
            g["util (%)"] for t in last.values() for g in t.get("gpus", []) if g.get("util (%)") is not None
        ]
        return {
            "name": self.name,
            "user": self.user,
            "backend": self.backend,
            "state": self.state,
            "message": self.message,
            "created": self.created,
            "ended": self.ended,
            "tasks_started": self.started_tasks,
            "tasks_total": self.total_tasks,
            "epoch": self.epoch,
            "epochs": self.epochs,
            "gpu_util": gpu_util,
            "cpu_total": sum((t.get("cpu (%)") or 0.0) for t in last.values()),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobView:
        v = cls()
        for k, val in d.items():
            if k == "metrics":
                v.metrics.extend(val)
            elif k == "logs":
                v.logs.extend(tuple(x) for x in val)
            elif k in v.__dict__:
                setattr(v, k, val)
        return v
