"""Argument parsing for `%%tfdist` and `%tfdist`: argparse that reports with UsageError (no traceback,
no SystemExit from inside the kernel)."""

from __future__ import annotations

import argparse
import shlex

from IPython.core.error import UsageError

from ..settings import Settings

# Without progress for this long, the cell says the job looks stuck (it does not end it: a long evaluation
# or a custom loop that reports nothing may be fine, the per-task CPU tells).
STALL_TIMEOUT_S = 600.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        # the prog as the user types it: "%%tfdist run" (a cell magic), "%tfdist status" (line magics)
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage().strip()}")

    def exit(self, status: int = 0, message: str | None = None):  # type: ignore[override]
        # -h/--help prints and exits: in a kernel that must not be a SystemExit
        raise UsageError(message or self.format_help())


def run_parser(settings: Settings) -> argparse.ArgumentParser:
    p = _Parser(prog="%%tfdist run", description="Run this cell as a distributed parameter-server job.")
    p.add_argument("--workers", type=int, default=2, help="worker tasks (default 2)")
    p.add_argument(
        "--ps", type=int, default=None, help="parameter-server tasks (default 1; none with allreduce)"
    )
    p.add_argument(
        "--strategy",
        default="ps",
        help="ps (ParameterServerStrategy, default) or allreduce (MultiWorkerMirroredStrategy, workers only)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=_positive_count("--checkpoint-every"),
        default=None,
        help="PS jobs: checkpoint every N steps; a lost PS is restarted, the fit resumes from the last one",
    )
    p.add_argument(
        "--gpus-per-worker",
        type=int,
        default=1 if (settings.gpus or 0) > 0 else 0,
        help="GPUs for each worker (default 1 when this server has GPUs, else 0)",
    )
    p.add_argument(
        "--cpu", type=float, default=None, help="CPU cores per task (threads locally, limits on k8s)"
    )
    p.add_argument("--memory", default=None, help="memory per task, e.g. 2Gi (killed above it)")
    p.add_argument(
        "--backend", default=settings.backend, help=f"local or kubernetes (default {settings.backend})"
    )
    p.add_argument("--name", default=None, help="job name (default: generated)")
    p.add_argument(
        "--timeout",
        type=_seconds("--timeout"),
        default=600.0,
        help="seconds allowed for start-up: every task up (pods scheduled and running on Kubernetes); "
        "training itself has no time limit (default 600)",
    )
    p.add_argument(
        "--stall-timeout",
        type=_seconds("--stall-timeout"),
        default=STALL_TIMEOUT_S,
        help="seconds without training progress (steps, epochs) after which the cell says the job looks "
        f"stuck, with each task's CPU; the job goes on (default {STALL_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--base-port", type=int, default=None, help="local: fixed ports from here instead of free ones"
    )
    p.add_argument(
        "--detach",
        action="store_true",
        help="start the job and return: it does not need this kernel (%%tfdist attach NAME brings its "
        "results into a later kernel)",
    )
    return p


def _seconds(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes seconds, e.g. 600; got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be a positive number of seconds; got {text!r}")
        return value

    return parse


def _positive_count(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a positive count of steps, e.g. 100; got {text!r}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive count of steps; got {text!r}")
        return value

    return parse


def name_parser(sub: str, allow_all: bool = False) -> argparse.ArgumentParser:
    p = _Parser(prog=f"%tfdist {sub}")
    if allow_all:
        p.add_argument("name", nargs="?")
        p.add_argument("--all", action="store_true", help="all running jobs")
    else:
        p.add_argument("name")
    if sub == "logs":
        p.add_argument("--task", default=None, help="only this task (e.g. worker-0)")
    return p


def split(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"%tfdist: cannot parse the arguments: {exc}") from None
