"""`%tfdist list`, `status`, `logs` and `stop`: the line magics that read or end jobs already started.

Why a module of its own: they run no cell and bring nothing back; they only look the job up among this
user's backends and print. `TfdistMagics` mixes them in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from ..aio import Portal
from ..backends.base import Backend
from ..errors import NoSuchJob, TfdistError
from ..job import detach
from ..jobrecords import JobSummary
from ..jobview import state_word
from ..settings import Settings
from . import args as margs

LIST_HEADER = f"{'name':24} {'backend':10} {'state':10} {'tasks':7} {'epoch':7} message"


def list_row(r: JobSummary) -> str:
    """One job's line in `%tfdist list` (under LIST_HEADER)."""
    note = detach.row_note(r.model_dump())
    return (
        f"{r.name:24} {r.backend:10} {state_word(r.state, r.queue is not None, r.reason):10} "
        f"{r.tasks_started}/{r.tasks_total:<5} {r.epoch}/{r.epochs or '?':<5} {r.message}{note}"
    )


class JobCommands:
    """The job line magics of `TfdistMagics`; needs its `settings`, `portal` and `backend`."""

    settings: Settings
    portal: Portal

    if TYPE_CHECKING:

        def backend(self, name: str) -> Backend: ...

    def _all_backends(self) -> list[Backend]:
        names = {"local", self.settings.backend}
        out = []
        for n in sorted(names):
            try:
                out.append(self.backend(n))
            except TfdistError:
                continue
        return out

    def _own(self, rows: list[JobSummary]) -> list[JobSummary]:
        """Only this user's jobs: a namespace or state directory may be shared."""
        return [r for r in rows if r.user in (self.settings.user, "")]

    def _find(self, name: str) -> Backend:
        for b in self._all_backends():
            try:
                view = self.portal.call(b.status(name), timeout=30)
            except NoSuchJob:
                continue
            if view.user in (self.settings.user, ""):
                return b
        raise UsageError(f"no tfdist job named {name!r}; see %tfdist list")

    def list(self, argv: list[str]) -> None:
        if argv:
            raise UsageError("%tfdist list takes no arguments")
        rows = []
        for b in self._all_backends():
            rows += self._own(self.portal.call(b.list_jobs(), timeout=60))
        if not rows:
            print("no tfdist jobs")
            return
        print(LIST_HEADER)
        for r in rows:
            print(list_row(r))

    def status(self, argv: list[str]) -> None:
        opts = margs.name_parser("status").parse_args(argv)
        b = self._find(opts.name)
        view = self.portal.call(b.status(opts.name), timeout=30)
        s = view.summary()
        print(f"{s['name']} ({s['backend']}): {view.state_word} - {s['message']}")
        print(
            f"tasks started {s['tasks_started']}/{s['tasks_total']}, epoch {s['epoch']}/{s['epochs'] or '?'}"
        )
        for t, rec in sorted(view.tasks.items()):
            print(
                f"  {t:10} {rec.get('state', ''):10} restarts={rec.get('restarts', 0)} "
                f"gpus={rec.get('gpus') or '-'}"
            )
        if view.epoch_logs:
            print("last epoch:", {k: v for k, v in view.epoch_logs[-1].items() if k != "t"})

    def logs(self, argv: list[str]) -> None:
        opts = margs.name_parser("logs").parse_args(argv)
        b = self._find(opts.name)
        logs = self.portal.call(b.logs(opts.name, opts.task), timeout=60)
        if opts.task and not logs:
            raise UsageError(f"job {opts.name} has no task {opts.task!r}")
        for task, text in logs.items():
            print(f"===== {task} =====")
            print(text.rstrip())

    def stop(self, argv: list[str]) -> None:
        opts = margs.name_parser("stop", allow_all=True).parse_args(argv)
        if bool(opts.name) == bool(opts.all):
            raise UsageError("%tfdist stop takes a job NAME or --all")
        if opts.all:
            stopped = []
            for b in self._all_backends():
                for r in self._own(self.portal.call(b.list_jobs(), timeout=60)):
                    if not r.state.terminal and self.portal.call(b.stop(r.name), timeout=60):
                        stopped.append(r.name)
            print(f"stopped {', '.join(stopped)}" if stopped else "no running jobs")
            return
        b = self._find(opts.name)
        if self.portal.call(b.stop(opts.name), timeout=60):
            print(f"stopped {opts.name}")
        else:
            print(f"{opts.name} was not running")
