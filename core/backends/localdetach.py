"""Detached local jobs: their record in the job's directory, retention, `attach` and results taken once.

Why a module of its own: the local backend's other half is a process and its socket; this half is files
only (`detached.json`, `result.bin`, `state.json`'s end) and the rules of `tfdist.job.detach` applied to them.
`LocalBackend` mixes it in; it needs the backend's `jobdir`, `is_running`, `_names` and `retention`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import JobSpecError, NoSuchJob, TfdistError
from ..job import detach as dt
from ..job.detach import DetachSummary
from ..job.vocab import TERMINAL

DETACHED_FILE = "detached.json"  # present in a detached job's directory: retention, owner, taken


class NoSuchDetachedJob(NoSuchJob):
    """Nothing to attach to under that name: never started, another user's, or deleted after retention.
    One sentence for all three, so that it says nothing about other users' jobs."""

    def __init__(self, name: str, retention: float):
        super().__init__(name)
        self.args = (dt.nothing_waiting(name, retention),)


class DetachedJobs:
    """The detached half of `LocalBackend`: what is on disk for a job started with `--detach`."""

    if TYPE_CHECKING:

        def jobdir(self, name: str) -> str: ...
        def is_running(self, name: str) -> bool: ...
        def _names(self) -> list[str]: ...
        def retention(self) -> dt.Retention: ...

    @staticmethod
    def _write_detached(d: str, rec: dict[str, Any]) -> None:
        tmp = os.path.join(d, DETACHED_FILE + ".part")
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, os.path.join(d, DETACHED_FILE))

    def _detached(self, name: str) -> dict[str, Any] | None:
        """The detached record of a job, or None for a job that was not detached."""
        try:
            with open(os.path.join(self.jobdir(name), DETACHED_FILE)) as f:
                rec = json.load(f)
        except (OSError, ValueError, NoSuchJob):
            return None
        return rec if isinstance(rec, dict) else None

    def _ended_at(self, name: str) -> float | None:
        """When a job that no longer runs ended (its state file's word, else the file's age)."""
        if self.is_running(name):
            return None
        path = os.path.join(self.jobdir(name), "state.json")
        try:
            with open(path) as f:
                st = json.load(f)
            if st.get("ended"):
                return float(st["ended"])
            mtime = os.path.getmtime(path)
        except (OSError, ValueError, TypeError, AttributeError):
            try:
                mtime = os.path.getmtime(self.jobdir(name))
            except OSError:
                return None
            st = {}
        # no end recorded: a job still launching is not over; one whose supervisor vanished ended then
        launching = st.get("state") not in TERMINAL and time.time() - mtime < 60
        return None if launching else mtime

    def _results_waiting(self, name: str) -> bool:
        """A detached job whose results nobody has taken yet: not pruned with the ordinary finished jobs."""
        rec = self._detached(name)
        return rec is not None and not dt.taken(rec)

    def expire(self, now: float | None = None) -> list[str]:
        """Delete detached jobs whose retention has passed since they ended (results, logs and state);
        the names deleted. Every use of the backend calls it: no daemon is needed for the clean-up."""
        now = time.time() if now is None else now
        gone = []
        for n in self._names():
            rec = self._detached(n)
            if rec is None:
                continue
            if dt.expired(rec, self._ended_at(n), now):
                shutil.rmtree(self.jobdir(n), ignore_errors=True)
                gone.append(n)
        return gone

    def _no_detached(self, name: str) -> TfdistError:
        return NoSuchDetachedJob(name, self.retention().seconds)

    async def attach(self, name: str) -> None:
        """Check that `name` is a detached job of this user whose results can still be taken; `watch`,
        `status` and `fetch_result` then follow it like any job. Raises one sentence when it cannot."""
        self.expire()
        try:
            d = self.jobdir(name)
            st = os.stat(d)
        except (NoSuchJob, OSError):  # no such directory, or not ours to read (another user's 0700 dir)
            raise self._no_detached(name) from None
        if st.st_uid != os.getuid():
            raise self._no_detached(name)
        rec = self._detached(name)
        if rec is None:
            if not os.path.exists(os.path.join(d, "spec.json")):
                raise self._no_detached(name)
            raise JobSpecError(dt.not_detached(name))
        if dt.taken(rec):
            raise JobSpecError(dt.already_taken(name))

    def detach_summary(self, name: str, ended: float | None = None) -> DetachSummary:
        """What the lab panel and `%tfdist list` say of a detached job (`tfdist.job.detach.summary`); the
        job's end and whether its results are there are read from its directory."""
        rec = self._detached(name)
        if rec is None or dt.taken(rec):
            return dt.summary(rec, None)
        has = os.path.exists(os.path.join(self.jobdir(name), "result.bin"))
        return dt.summary(rec, self._ended_at(name), has_results=has)

    async def fetch_result(self, name: str) -> bytes | None:
        d = self.jobdir(name)
        path = os.path.join(d, "result.bin")
        claim = f"{path}.taking-{os.getpid()}-{threading.get_ident()}"
        try:  # atomic: of two kernels attached to one detached job, one gets the results
            os.rename(path, claim)
        except FileNotFoundError:
            if dt.taken(self._detached(name)):
                raise JobSpecError(dt.already_taken(name)) from None
            return None
        with open(claim, "rb") as f:
            data = f.read()
        for fn in (claim, os.path.join(d, "payload.bin")):  # may be hundreds of MB: not kept once delivered
            with contextlib.suppress(FileNotFoundError):
                os.unlink(fn)
        rec = self._detached(name)
        if rec is not None:
            self._write_detached(d, rec | {"taken": time.time()})
        return data
