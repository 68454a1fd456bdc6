"""`%%tfdist run` and the `%tfdist` line magics.

The cell never runs in the kernel: it is checked here (syntax, names, what can be shipped), sent with the
variables it reads to a coordinator process next to a PS/worker cluster, watched live, and its results
(trained weights into the notebook's own model objects, and every name the cell bound) come back.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import secrets
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import Image, display

from .. import memfit, payload
from ..aio import Portal
from ..backends import get_backend
from ..backends.base import Backend, Launch
from ..errors import JobFailed, NoSuchJob, TfdistError
from ..events import LogEvent, StateEvent
from ..gpus import visible_gpus
from ..job import detach
from ..job.vocab import JobState
from ..jobrecords import JobSummary
from ..jobspec import JobSpec, default_ps, parse_memory, validate
from ..jobview import JobView, Reason, state_word
from ..settings import Settings, from_environ
from . import args as margs
from .busy import stay_busy
from .monitor import make_monitor, static_png
from .stall import StallWatch

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

LIST_HEADER = f"{'name':24} {'backend':10} {'state':10} {'tasks':7} {'epoch':7} message"
REFRESH_S = 1.0
STALL_DETACHED_S = 600.0
# The shell's own names: never shipped (a user's `_data` is, though)
SHELL_NAMES = frozenset({"get_ipython", "exit", "quit", "In", "Out", "_ih", "_oh", "_dh"})


def _require_tensorflow() -> None:
    try:
        import tensorflow  # noqa: F401
        import tf_keras  # noqa: F401
    except ImportError as exc:
        import sys

        raise TfdistError(
            f"%%tfdist needs TensorFlow and tf_keras in this kernel's environment ({sys.executable}), "
            f"but importing them failed: {exc}.\nInstall them with: "
            f"{sys.executable} -m pip install 'jupyter-tfdist[kernel]'"
        ) from None


def _gpu_ids() -> list[str]:
    return [g.cuda_id for g in visible_gpus()]  # indices; MIG instances by UUID


def list_row(r: JobSummary) -> str:
    """One job's line in `%tfdist list` (under LIST_HEADER)."""
    note = detach.row_note(r.model_dump())
    return (
        f"{r.name:24} {r.backend:10} {state_word(r.state, r.queue is not None):10} "
        f"{r.tasks_started}/{r.tasks_total:<5} {r.epoch}/{r.epochs or '?':<5} {r.message}{note}"
    )


class CellInterrupted(KeyboardInterrupt):
    """An interrupt tfdist has already handled (the job stopped): shown as one line, the cell still ends
    as interrupted (KeyboardInterrupt), without a traceback through tfdist's own waiting code."""


@magics_class
class TfdistMagics(Magics):
    def __init__(self, shell: Any):
        super().__init__(shell)
        self.settings: Settings = from_environ()
        self._backends: dict[str, Backend] = {}
        self.portal = Portal.get()
        self._pumps: set[Any] = set()
        self._events: queue.Queue = queue.Queue()

    # ------------------------------------------------------------------ plumbing
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
    def prepare(self, argv: list[str], cell: str) -> tuple[JobSpec, bytes, list[str]]:
        """Everything that can go wrong with the input, checked before anything starts."""
        opts = margs.run_parser(self.settings).parse_args(argv)
        _require_tensorflow()
        if not cell.strip():
            raise UsageError(
                "the %%tfdist run cell is empty: put the training code in it, e.g. "
                "history = model.fit(train_ds, epochs=5)"
            )
        source = self.shell.transform_cell(cell)
        if "get_ipython()" in source:
            raise UsageError(
                "IPython magics and shell escapes (%, !) cannot run on the job's coordinator: "
                "move them to another cell"
            )
        try:
            names = payload.cell_names(source)
        except SyntaxError as exc:
            line = (exc.lineno or 0) + 1  # + the %%tfdist line
            raise TfdistError(
                f"SyntaxError in the cell, line {line}: {exc.msg}\n    {(exc.text or '').rstrip()}\n"
                "nothing was started"
            ) from None
        undefined = payload.undefined_names(names, self.shell.user_ns)
        if undefined:
            raise TfdistError(
                f"name {undefined[0]!r} is used in the cell but not defined in the notebook"
                + (f" (nor {', '.join(map(repr, undefined[1:]))})" if len(undefined) > 1 else "")
                + ": run the cell that defines it first; nothing was started"
            )
        gpus = _gpu_ids() if opts.backend == "local" else []
        name = opts.name or f"tfdist-{secrets.token_hex(3)}"
        spec = JobSpec(
            name=name,
            user=self.settings.user,
            workers=opts.workers,
            ps=default_ps(opts.strategy, opts.ps),
            strategy=opts.strategy,
            checkpoint_every=opts.checkpoint_every,
            gpus_per_worker=opts.gpus_per_worker,
            cpu=opts.cpu,
            memory_bytes=parse_memory(opts.memory) if opts.memory is not None else None,
            backend=opts.backend,
            timeout_s=opts.timeout,
            base_port=opts.base_port,
            namespace=self.settings.namespace,
            image=self.settings.worker_image,
            detach=bool(opts.detach),
        )
        validate(spec, len(gpus) if opts.backend == "local" else None)
        if spec.backend == "local":
            self._check_memory(spec)
        reads = [n for n in names.reads if n in self.shell.user_ns and n not in SHELL_NAMES]
        blob = payload.pack(source, reads, self.shell.user_ns, line_offset=1)
        return spec, blob, gpus

    def _check_memory(self, spec: JobSpec) -> None:
        """Local tasks share this server's memory limit with the kernel: refuse a job that cannot fit."""
        budget = memfit.server_budget(os.getppid())
        if budget is None:
            return
        if spec.memory_bytes and spec.memory_bytes > budget.limit:
            raise TfdistError(
                f"--memory {spec.memory_bytes / memfit.GiB:.1f} GiB per task is more than this server's "
                f"whole memory limit ({budget.limit / memfit.GiB:.1f} GiB), which the kernel and every task "
                "share: give each task less, or start your server with more memory; nothing was started"
            )
        # this kernel's idle warm pool is free memory: the job takes its processes over, or it is dropped
        local = self.backend("local")
        pooled = local.idle_bytes()
        budget = dataclasses.replace(budget, used=max(0, budget.used - pooled))
        workers = spec.workers - 1 if spec.strategy == "allreduce" else spec.workers  # chief-0 is one
        why = memfit.refusal(workers, spec.ps, budget, memfit.load_footprint(self.settings.state_dir))
        if why:
            if pooled:
                local.release_idle()
            raise TfdistError(why)

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
        try:
            launch = Launch(gpus=gpus, cwd=os.getcwd(), env={memfit.SERVER_PID_ENV: str(os.getppid())})
            self.portal.call(backend.submit(spec, blob, launch))
        except TfdistError:
            raise  # refused: nothing of this job exists (and a same-named job of before must be left alone)
        except BaseException as exc:  # interrupted mid-submit: the backend undid its part; make sure of it
            self.portal.call(backend.stop(spec.name, Reason.INTERRUPTED.value), timeout=60)
            if isinstance(exc, KeyboardInterrupt):
                raise CellInterrupted(
                    f"tfdist job {spec.name} interrupted while starting; nothing is left"
                ) from None
            raise
        if spec.detach:
            print(detach.started(spec.name, backend.retention()))
            return
        view = JobView(name=spec.name, user=spec.user, backend=spec.backend, total_tasks=spec.task_count)
        monitor = make_monitor(view)
        # the live monitor's output is replaced by the run's picture at the end: one chart, not two
        handle = display(monitor.widget, display_id=True) if hasattr(monitor, "widget") else None
        try:
            self._follow(backend, view, monitor, StallWatch(stall_s))
        except BaseException as exc:  # an interrupt, or any failure here: the job must not outlive the cell
            interrupted = isinstance(exc, KeyboardInterrupt)
            reason = Reason.INTERRUPTED if interrupted else Reason.INTERNAL
            self.portal.call(backend.stop(spec.name, reason if interrupted else Reason.STOPPED), timeout=30)
            self._drain(view, self._events, timeout=5)  # the job's own last word, with its reason
            if not view.finished:
                message = reason.sentence() if interrupted else f"{reason.sentence()}: {exc}"
                view.apply(StateEvent(state=JobState.STOPPED, reason=reason, message=message[:65536]))
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
        raise JobFailed(
            f"job {view.name} {view.state}: {view.message}",
            remote_traceback=err.get("traceback", ""),
            job=view.name,
        )

    # ------------------------------------------------------------------ line magics
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

    def close(self) -> None:
        for b in self._backends.values():
            try:
                self.portal.call(b.close(), timeout=60)
            except Exception:
                pass
