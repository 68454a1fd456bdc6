"""A parameter server that comes back on Kubernetes (`--checkpoint-every N`), the coordinator pod's side.

The PS Job replaces a lost PS pod at the same hostname (`backoffLimitPerIndex`, tfdist.kube.manifests), but
the coordinator pod cannot see the PS's process as the local supervisor does (tfdist.runtime.psrestart). So
it watches each PS's address: a PS that answered and then stops answering (its pod deleted, OOM-killed, its
node gone) is lost. The coordinator subprocess is then ended (TensorFlow cannot reconnect it to a new PS),
the pod waits until every PS answers again, and starts the coordinator again with the checkpoint settings:
its fit resumes from the last checkpoint (tfdist.runtime.psrecovery). At most psrestart.MAX_PS_RESTARTS;
then the job fails saying so. The notebook sees the same events as from a local job's supervisor.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from ..job.events import ErrorInfo, LogEvent, TaskEvent, to_wire
from ..job.vocab import FailureKind
from ..settings import TaskSettings
from . import psrecovery, psrestart
from .ports import answers

PROBE_EVERY_S = 1.0
LOST_AFTER = 2  # consecutive failed probes of a PS that answered before
RETURN_WAIT_S = 600.0  # how long a lost PS may take to come back (scheduled, image, TensorFlow imported)
# A coordinator resumed after a PS came back may still find a server's channel to the old PS address (a
# new pod has a new IP; gRPC re-resolves DNS at most every 30 s by default): TensorFlow's connection errors
# then end it, and it is started once more (within the same restart budget) after this pause. (The
# repeated CancelledErrors the real node showed until stop 35 were not that: each checkpoint was saved
# on the PS, which could not write into the coordinator pod's directory, and the failed save cancelled
# the fit's steps there. The coordinator now writes them itself: tfdist.runtime.psrecovery.)
CONNECTION_ERRORS = ("CancelledError", "UnavailableError", "AbortedError")
CUT_OFF_PAUSE_S = 10.0

Emit = Callable[[dict[str, Any]], None]
Probe = Callable[[str, int], bool]


def ps_addresses(cluster: dict[str, list[str]]) -> dict[str, tuple[str, int]]:
    """`ps-<i>` -> (host, port) from the cluster spec (TFDIST_CLUSTER)."""
    out = {}
    for i, addr in enumerate(cluster.get("ps") or []):
        host, _, port = addr.rpartition(":")
        out[f"ps-{i}"] = (host, int(port))
    return out


class PsWatch:
    """Follows the PS addresses while a coordinator runs, and decides whether its end was a PS loss that
    the job comes back from."""

    def __init__(
        self,
        every: int,
        jobdir: str,
        addrs: dict[str, tuple[str, int]],
        emit: Emit,
        probe: Probe = answers,
        return_wait_s: float = RETURN_WAIT_S,
    ):
        self.every, self.jobdir, self.addrs, self.emit = every, jobdir, addrs, emit
        self.probe, self.return_wait_s = probe, return_wait_s
        self.restarts = 0
        self.lost: dict[str, str] = {}  # task -> how it was lost, not yet restarted from
        self.up: set[str] = set()  # PS that answered since the last (re)start
        self.lost_at: float | None = None
        self._proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ps-watch", daemon=True)

    @classmethod
    def from_env(cls, jobdir: str, emit: Emit, environ: dict[str, str] | None = None) -> PsWatch | None:
        """The chief's watch when the job asked for --checkpoint-every (TFDIST_CHECKPOINT_EVERY)."""
        ts = TaskSettings(environ)
        every = psrecovery.pod_checkpoint_every(ts)
        if every is None or not ts.cluster:
            return None
        return cls(every, jobdir, ps_addresses(ts.cluster), emit)

    def coordinator_env(self) -> dict[str, str]:
        return psrecovery.checkpoint_env(self.every, self.jobdir)

    def follow(self, proc: subprocess.Popen) -> None:
        """The coordinator now running: a PS lost from here on ends it (the caller restarts it)."""
        with self._lock:
            self._proc = proc
            lost_meanwhile = bool(self.lost)
        if lost_meanwhile:  # a PS went while no coordinator ran: this one cannot work either
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        if not self._thread.is_alive():
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        misses: dict[str, int] = {}
        while not self._stop.wait(PROBE_EVERY_S):
            for task, (host, port) in self.addrs.items():
                if self.probe(host, port):
                    misses[task] = 0
                    self.up.add(task)
                    continue
                misses[task] = misses.get(task, 0) + 1
                if task in self.up and misses[task] >= LOST_AFTER:
                    self._lost(task, "stopped answering at its address (pod lost)")

    def _lost(self, task: str, how: str) -> None:
        with self._lock:
            self.up.discard(task)
            self.lost.setdefault(task, how)
            self.lost_at = self.lost_at or time.time()
            proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # it cannot go on without that PS's variables

    def resume(self, code: int) -> bool:
        """The coordinator ended with `code`: restart it (True), or is this the job's end (False)?"""
        if code == 0:
            return False
        if not self.lost:  # the coordinator may see the PS go before the watch does
            for _ in range(3 * LOST_AFTER):
                for task, (host, port) in self.addrs.items():
                    if not self.probe(host, port):
                        self._lost(task, "stopped answering at its address (pod lost)")
                if self.lost:
                    break
                time.sleep(PROBE_EVERY_S)
        cut_off = None
        if not self.lost:
            kind = self._error_type()
            if not self.restarts or kind not in CONNECTION_ERRORS:
                return False  # the cell's own error, or a job that never lost a PS: as without checkpoints
            cut_off = f"the resumed coordinator lost its connection to the cluster ({kind})"
        lost, self.lost = dict(self.lost), {}
        if self.restarts >= psrestart.MAX_PS_RESTARTS:
            what = cut_off or f"parameter server {', '.join(sorted(lost))} was lost"
            self._fail(
                f"{what} again after {self.restarts} restarts "
                f"(--checkpoint-every allows {psrestart.MAX_PS_RESTARTS}); the job ends"
            )
            return False
        self.restarts += 1
        if cut_off:
            line = (
                f"tfdist: {cut_off}; restarting it, which resumes from the last checkpoint "
                f"({self.restarts}/{psrestart.MAX_PS_RESTARTS})"
            )
            print(line, flush=True)
            self.emit(to_wire(LogEvent(lines=(("chief-0", line),))))
            time.sleep(CUT_OFF_PAUSE_S)  # the servers' channels re-resolve the restarted PS's new address
        for task, how in sorted(lost.items()):
            line = psrestart.restart_line(task, how, self.every, self.restarts)
            print(line, flush=True)
            self.emit(to_wire(LogEvent(lines=((task, line),))))
            self.emit(to_wire(TaskEvent(task=task, state="restarting", restarts=self.restarts)))
        if not self._wait_back():
            self._fail(
                f"parameter server {', '.join(sorted(lost))} did not come back within "
                f"{self.return_wait_s:.0f}s; the job ends"
            )
            return False
        back = time.time() - (self.lost_at or time.time())
        self.lost_at = None
        for task in sorted(lost):
            self.emit(to_wire(TaskEvent(task=task, state="running", restarts=self.restarts)))
        psrestart.clear_leftovers(self.jobdir)
        meta = psrecovery.Recovery(self.every, self.coordinator_env()[psrecovery.ENV_DIR]).load_meta()
        where = (
            f"the checkpoint at step {meta['step']} (epoch {int(meta['epoch']) + 1})"
            if meta
            else "the start (no checkpoint was written yet)"
        )
        line = f"tfdist: the parameter servers answer after {back:.1f}s; the coordinator resumes from {where}"
        if cut_off:
            line = f"tfdist: the coordinator resumes from {where}"
        print(line, flush=True)
        self.emit(to_wire(LogEvent(lines=(("chief-0", line),))))
        self.emit(to_wire(TaskEvent(task="chief-0", state="restarting", restarts=self.restarts)))
        return True

    def _error_type(self) -> str:
        try:
            with open(os.path.join(self.jobdir, "error.json")) as f:
                return str(json.load(f).get("type") or "")
        except (OSError, ValueError, AttributeError):
            return ""

    def _wait_back(self) -> bool:
        deadline = time.time() + self.return_wait_s
        while time.time() < deadline:
            if all(self.probe(h, p) for h, p in self.addrs.values()):
                self.up = set(self.addrs)
                return True
            time.sleep(PROBE_EVERY_S)
        return False

    def _fail(self, why: str) -> None:
        """The job's error, in place of the coordinator's own (a lost connection says less)."""
        print("tfdist: " + why, flush=True)
        self.emit(to_wire(LogEvent(lines=(("chief-0", "tfdist: " + why),))))
        err = ErrorInfo(type=FailureKind.PS_LOST.value, message=why).model_dump()
        with open(os.path.join(self.jobdir, "error.json"), "w") as f:
            json.dump(err, f)
