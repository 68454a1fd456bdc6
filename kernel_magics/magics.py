"""`%%tfdist run` and the `%tfdist` line magics.

The cell never runs in the kernel: it is checked here (syntax, names, what can be shipped), sent with the
variables it reads to a coordinator process next to a PS/worker cluster, watched live, and its results
(trained weights into the notebook's own model objects, and every name the cell bound) come back.

This module is the dispatch and the two ways of following a job (`run`, `attach`); what a cell must
pass is `cellcheck`, following a job into the monitor and its results is `follow`, and `list`, `status`,
`logs` and `stop` are `jobcmds`.
"""

from __future__ import annotations

import os
import queue
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from .. import memfit
from ..aio import Portal
from ..backends import get_backend, import_ahead
from ..backends.base import Backend, Launch
from ..errors import NoSuchJob, TfdistError
from ..events import StateEvent
from ..job import detach
from ..job.vocab import JobState
from ..jobview import JobView, Reason
from ..settings import KernelSettings, Settings, from_environ
from . import args as margs
from .busy import stay_busy
from .cellcheck import SHELL_NAMES, CellCheck
from .follow import JobFollower
from .jobcmds import LIST_HEADER, JobCommands, list_row
from .monitor import TextMonitor, WidgetMonitor, make_monitor
from .stall import StallWatch


async def _stop_if_claimed(backend: Backend, name: str) -> None:
    """After an interrupted submit: stop the job of `name` only if that submit got past its name check
    (before it, a job of that name is another's: a detached one, another kernel's). Run on the portal's loop,
    after the submit's cancellation there: a cancelled submit claims nothing more."""
    if backend.claims(name):
        await backend.stop(name, Reason.INTERRUPTED.value)


USAGE = """\
%%tfdist run [--workers N] [--ps N] [--gpus-per-worker N] [--cpu C] [--memory M] [--backend B]
             [--name NAME] [--timeout S] [--stall-timeout S] [--base-port P]
             [--strategy ps|allreduce] [--checkpoint-every N] [--detach]
                                  run the cell as a distributed job (a cell magic: %%)
    --timeout S        start-up only: every task up within S s, else the job fails (default 600)
    --stall-timeout S  no training progress for S s: the cell says the job looks stuck (default 600)
%tfdist plan MODEL DATASET | %%tfdist plan   predict 1 worker vs N workers with k PS vs all-reduce
%tfdist list                      jobs of this user
%tfdist status NAME               state, tasks and progress of a job
%tfdist logs NAME [--task T]      full logs of every task
%tfdist stop NAME | --all         end a job (and every process it holds)
%tfdist attach NAME               follow a --detach job from this kernel and bring its results here"""

STALL_DETACHED_S = 600.0
__all__ = ["LIST_HEADER", "SHELL_NAMES", "CellInterrupted", "TfdistMagics", "list_row"]


class CellInterrupted(KeyboardInterrupt):
    """An interrupt tfdist has already handled (the job stopped): shown as one line, the cell still ends
    as interrupted (KeyboardInterrupt), without a traceback through tfdist's own waiting code."""


@magics_class
class TfdistMagics(CellCheck, JobFollower, JobCommands, Magics):
    def __init__(self, shell: Any):
        super().__init__(shell)
        self.settings: Settings = from_environ()
        self._backends: dict[str, Backend] = {}
        self.portal = Portal.get()
        self._pumps: set[Any] = set()
        self._events: queue.Queue = queue.Queue()

    # ------------------------------------------------------------------ plumbing
    def warm_up_first(self) -> bool:
        """At the extension's load: this kernel's warm pool, where its jobs run locally and the admin
        left TFDIST_POOL_ON_LOAD on; where they run on Kubernetes, the client's imports. Never fails the
        load: either is only ever a head start."""
        if self.settings.backend == "kubernetes":
            return import_ahead("kubernetes") is not None
        if self.settings.backend != "local" or not KernelSettings().pool_on_load:
            return False
        try:
            local = self.backend("local")
            return local.warm_up_first({memfit.SERVER_PID_ENV: str(memfit.server_pid())})  # type: ignore[attr-defined]
        except Exception:
            return False

    def backend(self, name: str) -> Backend:
        if name not in self._backends:
            self._backends[name] = get_backend(name, self.settings)
        return self._backends[name]

    @line_cell_magic
    def tfdist(self, line: str, cell: str | None = None) -> Any:
        words = margs.split(line)
        if not words:
            raise UsageError(USAGE)
        sub, rest = words[0], words[1:]
        if sub == "run":
            if cell is None:
                raise UsageError(
                    "run is a cell magic: put %%tfdist run on the first line of the cell\n" + USAGE
                )
            return self.run(rest, cell)
        if sub == "plan":  # measured in a subprocess, predicted by tfdist.advisor; starts no job
            from .plan import plan

            return plan(self, rest, cell)
        handlers = {
            "list": self.list,
            "status": self.status,
            "logs": self.logs,
            "stop": self.stop,
            "attach": self.attach,
        }
        if sub not in handlers:
            raise UsageError(f"unknown %tfdist command {sub!r}\n{USAGE}")
        if cell is not None:
            raise UsageError(f"%%tfdist {sub} does not take a cell; did you mean %%tfdist run?")
        return handlers[sub](rest)

    # ------------------------------------------------------------------ run
    def run(self, argv: list[str], cell: str) -> None:
        with stay_busy(self.shell):
            self._run(argv, cell)

    def _run(self, argv: list[str], cell: str) -> None:
        try:
            spec, blob, gpus = self.prepare(argv, cell)
        except KeyboardInterrupt:
            raise CellInterrupted("interrupted before the job started; nothing was started") from None
        stall_s = margs.run_parser(self.settings).parse_args(argv).stall_timeout
        backend = self.backend(spec.backend)
        backend.unclaim(spec.name)  # an interrupt before the submit's first step finds no earlier claim
        try:
            launch = Launch(gpus=gpus, cwd=os.getcwd(), env={memfit.SERVER_PID_ENV: str(memfit.server_pid())})
            self.portal.call(backend.submit(spec, blob, launch))
        except TfdistError:
            raise  # refused: nothing of this job exists (and a same-named job of before must be left alone)
        except BaseException as exc:  # interrupted mid-submit: the backend undid its part; make sure of it
            self.portal.call(_stop_if_claimed(backend, spec.name), timeout=60)
            if isinstance(exc, KeyboardInterrupt):
                raise CellInterrupted(
                    f"tfdist job {spec.name} interrupted while starting; nothing is left"
                ) from None
            raise
        if spec.detach:
            print(detach.started(spec.name, backend.retention()))
            return
        view = JobView(name=spec.name, user=spec.user, backend=spec.backend, total_tasks=spec.task_count)
        monitor: WidgetMonitor | TextMonitor | None = None
        handle = None
        try:  # from here on the job exists: an interrupt while the chart loads must stop it too
            monitor = make_monitor(view)
            # the live monitor's output is replaced by the run's picture at the end: one chart, not two
            handle = display(monitor.widget, display_id=True) if hasattr(monitor, "widget") else None
            self._follow(backend, view, monitor, StallWatch(stall_s))
        except BaseException as exc:  # an interrupt, or any failure here: the job must not outlive the cell
            interrupted = isinstance(exc, KeyboardInterrupt)
            reason = Reason.INTERRUPTED if interrupted else Reason.INTERNAL
            self.portal.call(backend.stop(spec.name, reason if interrupted else Reason.STOPPED), timeout=30)
            self._drain(view, self._events, timeout=5)  # the job's own last word, with its reason
            if not view.finished:
                message = reason.sentence() if interrupted else f"{reason.sentence()}: {exc}"
                view.apply(StateEvent(state=JobState.STOPPED, reason=reason, message=message[:65536]))
            if monitor is None:
                monitor = TextMonitor(view)
            self._refresh(monitor, view)
            self._leave_picture(handle, monitor, view)
            if interrupted:
                raise CellInterrupted(
                    f"tfdist job {spec.name} interrupted; all its processes were ended"
                ) from None
            print(f"tfdist: job {spec.name} stopped; all its processes were ended")
            raise
        self._finish(backend, view, monitor, handle)

    def attach(self, argv: list[str]) -> None:
        """Follow a detached job from this kernel: the live monitor, then its results in this namespace.
        Interrupting detaches again (the job goes on)."""
        name = margs.name_parser("attach").parse_args(argv).name
        with stay_busy(self.shell):
            backend = self._attach(name)
            current = self.portal.call(backend.status(name), timeout=30)
            if current.user not in (self.settings.user, ""):  # a shared state dir: not this user's job
                raise NoSuchJob(name)
            view = JobView(
                name=name, user=current.user, backend=backend.name, total_tasks=current.total_tasks
            )
            view.apply({"type": "snapshot", "view": current.to_dict()})  # parsed: dropped if malformed
            monitor = make_monitor(view)
            handle = display(monitor.widget, display_id=True) if hasattr(monitor, "widget") else None
            try:
                if not view.finished:
                    self._follow(backend, view, monitor, StallWatch(STALL_DETACHED_S))
            except KeyboardInterrupt:
                raise CellInterrupted(
                    f"stopped following job {name}; it goes on (%tfdist attach {name})"
                ) from None
            self._finish(backend, view, monitor, handle)

    def _attach(self, name: str) -> Backend:
        """The backend holding detached job `name` (the server's default first, then local); its own
        sentence when none does (never started, another user's, results gone or already taken)."""
        missing: NoSuchJob | None = None
        for b in sorted(self._all_backends(), key=lambda b: b.name != self.settings.backend):
            try:
                self.portal.call(b.attach(name), timeout=60)
                return b
            except NoSuchJob as exc:
                missing = missing or exc
        raise missing or NoSuchJob(name)

    def close(self) -> None:
        for b in self._backends.values():
            try:
                self.portal.call(b.close(), timeout=60)
            except Exception:
                pass
