"""Following a job from the cell: its events into the live monitor, the stall watch, the picture left in the
notebook, and the results brought back into the kernel's namespace.

Why a module of its own: `run` and `attach` both end here; what differs between them (starting the job, or
finding a detached one) stays in `magics`. `TfdistMagics` mixes it in.
"""

from __future__ import annotations

import os
import queue
import time
from typing import Any

from IPython.display import Image, display

from .. import datamounts, payload
from ..aio import Portal
from ..backends.base import Backend
from ..errors import JobFailed
from ..events import LogEvent
from ..job.vocab import JobState
from ..jobview import JobView
from ..settings import Settings
from .monitor import static_png
from .stall import StallWatch

REFRESH_S = 1.0


class JobFollower:
    """Follows one job at a time for `TfdistMagics`; needs its `shell`, `portal`, `_pumps` and `_events`."""

    shell: Any
    portal: Portal
    settings: Settings
    _pumps: set[Any]
    _events: queue.Queue

    def _leave_picture(self, handle: Any, monitor: Any, view: JobView) -> None:
        """The run as a PNG, in place of the live widgets (or after the text monitor's lines): a saved
        notebook shows it, and the output holds one set of charts, not two. Never costs the results."""
        try:
            png = static_png(view)
        except Exception as exc:
            print(f"tfdist: could not draw the summary picture: {exc}")
            return
        if handle is None:
            display(Image(data=png, format="png"))
            return
        try:
            text = f"tfdist job {view.name}: {view.state} ({view.message})"
            handle.update({"image/png": png, "text/plain": text}, raw=True)
            monitor.close()
        except Exception as exc:
            print(f"tfdist: could not replace the live monitor with its picture: {exc}")

    @staticmethod
    def _drain(view: JobView, events: queue.Queue, timeout: float) -> bool:
        """Apply queued events until the stream ends or `timeout`; True when it ended."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ev = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if ev is None:
                return True
            view.apply(ev)

    def _subscribe(self, backend: Backend, name: str) -> queue.Queue:
        """Events of the job into a queue the cell reads; None marks the end of the stream."""
        events: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for ev in backend.watch(name):
                    events.put(ev)
            except Exception as exc:  # the stream broke: say so, the caller re-subscribes
                events.put(LogEvent(lines=[("tfdist", f"event stream interrupted: {exc!r}"[:2000])]))
            finally:
                events.put(None)

        fut = self.portal.spawn(pump())
        self._pumps.add(fut)  # a strong reference until done: the loop keeps only weak ones
        fut.add_done_callback(self._pumps.discard)
        return events

    def _refresh(self, monitor: Any, view: JobView) -> None:
        """A drawing problem must never cost the job or its results: report it once, keep going."""
        try:
            monitor.refresh(view)
        except Exception as exc:
            if not getattr(monitor, "_tfdist_broken", False):
                monitor._tfdist_broken = True
                print(f"tfdist: the live monitor failed ({type(exc).__name__}: {exc}); the job goes on")

    def _follow(self, backend: Backend, view: JobView, monitor: Any, stall: StallWatch) -> None:
        events = self._subscribe(backend, view.name)
        self._events = events
        while True:
            ended = self._drain(view, events, REFRESH_S)
            said = stall.check(view)
            if said:
                print(said, flush=True)  # in the saved notebook too; the header shows it while stuck
                monitor.note = said.removeprefix("tfdist: ") if stall.stalled else ""
            self._refresh(monitor, view)
            if ended:
                if view.finished:
                    return
                current = self.portal.call(backend.status(view.name), timeout=30)
                if current.finished:
                    view.apply({"type": "snapshot", "view": current.to_dict()})
                    return
                events = self._subscribe(backend, view.name)  # still running: watch again
                self._events = events

    def _finish(self, backend: Backend, view: JobView, monitor: Any, handle: Any) -> None:
        if not view.finished:  # the stream broke off: ask once more
            view = self.portal.call(backend.status(view.name))
        self._refresh(monitor, view)
        self._leave_picture(handle, monitor, view)
        if view.state == JobState.SUCCEEDED:
            data = self.portal.call(backend.fetch_result(view.name))
            if data is None:
                raise JobFailed(f"job {view.name} finished but sent no results back", job=view.name)
            res = payload.apply_results(data, self.shell.user_ns)
            parts = [
                f"weights of {', '.join(res.weights)} updated" if res.weights else "",
                f"set {', '.join(res.values)}" if res.values else "",
            ]
            print(f"tfdist: job {view.name} succeeded; " + "; ".join(p for p in parts if p))
            for name, why in res.skipped.items():
                print(f"tfdist: {name!r} did not come back: {why}")
            return
        err = view.error or {}
        # a path only the notebook has (not on the pods' data volumes): say so, not TF's bare NotFoundError
        missing = datamounts.missing_data_path(
            err,
            exists=os.path.exists,
            mounts=self.settings.data_volumes,
            backend=backend.name,
            cwd=os.getcwd(),
        )
        if missing is not None:
            raise datamounts.DataPathMissing(missing, view.name, err.get("traceback", ""))
        raise JobFailed(
            f"job {view.name} {view.state}: {view.message}",
            remote_traceback=err.get("traceback", ""),
            job=view.name,
        )
