"""Errors a user can act on. Each carries the message the notebook shows; none need a traceback."""

from __future__ import annotations


class TfdistError(Exception):
    """Base for errors that are the user's to fix: shown as a message, not a traceback."""


class JobSpecError(TfdistError):
    """The job asked for something impossible or malformed; nothing was started."""


class ShippingError(TfdistError):
    """A variable the cell uses cannot be sent to the coordinator."""

    def __init__(self, name: str, reason: str, hint: str = ""):
        self.name, self.reason, self.hint = name, reason, hint
        msg = f"cannot send {name!r} to the job: {reason}"
        super().__init__(msg + (f"\n  hint: {hint}" if hint else ""))


class JobFailed(TfdistError):
    """The job ran and failed; `remote_traceback` is the coordinator's, with the cell's line numbers."""

    def __init__(self, message: str, remote_traceback: str = "", job: str = ""):
        self.remote_traceback, self.job = remote_traceback, job
        super().__init__(message)


class NoSuchJob(TfdistError):
    """No job of that name (for this user) on that backend: its own type, so that a stray KeyError from a
    bug is never mistaken for a missing job (and turned into a 404)."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"no tfdist job named {name!r}; see %tfdist list")


class BackendUnavailable(TfdistError):
    """The chosen backend cannot run here (no network namespace, no cluster access...)."""
