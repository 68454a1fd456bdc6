"""The backend interface: the one seam between `%%tfdist` (and the lab panel) and where jobs run.

Async-first (the Kubernetes client and the Jupyter server are asyncio); the kernel reaches it through
`tfdist.aio.Portal`, a loop on a background thread, so the kernel's own loop is never blocked on.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..errors import NoSuchJob
from ..job import detach
from ..job.detach import DetachSummary, Retention
from ..job.events import Event
from ..job.vocab import Reason
from ..jobrecords import JobSummary
from ..jobspec import JobSpec
from ..jobview import JobView
from ..settings import KernelSettings


@dataclass(frozen=True)
class Launch:
    """What the launching side adds to a spec: where to run from and which GPUs it may hand out."""

    gpus: list[str] = field(default_factory=list)  # CUDA ids (indices/UUIDs) this server owns
    cwd: str | None = None  # the notebook's directory: relative paths in the cell keep working
    env: dict[str, str] = field(default_factory=dict)


class Backend(abc.ABC):
    name: str = "abstract"

    # ---- whose job a name is, for a submit that was interrupted: stopping "the job of that name" before
    # the submit's own name check had passed would stop another job of that name (a detached one, another
    # kernel's); after it, a job of that name is this submit's
    def unclaim(self, name: str) -> None:
        """Before a submit of `name` (the caller's too, before it hands the submit to another thread: an
        interrupt that lands first must not find the claim of an earlier job of that name)."""
        self.__dict__.setdefault("_claimed", set()).discard(name)

    def _claim(self, name: str) -> None:
        self.__dict__.setdefault("_claimed", set()).add(name)

    def claims(self, name: str) -> bool:
        """This backend's last submit of `name` got past its name check: a job of that name is its own."""
        return name in self.__dict__.get("_claimed", ())

    @abc.abstractmethod
    async def submit(self, spec: JobSpec, payload: bytes, launch: Launch) -> None:
        """Start the job; return once it exists (not once it runs), a detached one once it no longer needs
        this kernel (its cell handed over, or it is stopped and this raises). Raise TfdistError on bad
        input, having created nothing."""

    @abc.abstractmethod
    def watch(self, name: str) -> AsyncIterator[Event]:
        """A snapshot event, then every event until the job ends, as checked records (`tfdist.job.events`):
        a backend decodes what its job sends; a malformed event is dropped and said once in the log."""

    @abc.abstractmethod
    async def stop(self, name: str, reason: str = Reason.STOPPED) -> bool:
        """End the job and everything it holds. False if there was no such running job.

        `reason` is a `Reason` value: INTERRUPTED from an interrupted cell, else STOPPED."""

    @abc.abstractmethod
    async def list_jobs(self) -> list[JobSummary]:
        """Summaries of this user's jobs, running and recent (a view's summary and its detach summary)."""

    @abc.abstractmethod
    async def status(self, name: str) -> JobView:
        """The job's current view; NoSuchJob if unknown."""

    @abc.abstractmethod
    async def logs(self, name: str, task: str | None = None, tail: int | None = None) -> dict[str, str]:
        """Logs per task: whole, or the last `tail` lines of each (what a 1 Hz panel poll may read)."""

    @abc.abstractmethod
    async def fetch_result(self, name: str) -> bytes | None:
        """The coordinator's results bundle, once; None if the job produced none."""

    async def attach(self, name: str) -> None:
        """Take up a detached job started by an earlier kernel (then watch, status, fetch_result follow
        it); NoSuchJob, or a subclass with a better sentence, when there is none to take up."""
        raise NoSuchJob(name)

    def detach_summary(self, name: str, ended: float | None = None) -> DetachSummary:
        """What the lab panel and `%tfdist list` add for a detached job (results waiting until when, taken,
        none; `tfdist.job.detach`); ``ended`` is the job's end from its status when the caller has it."""
        return DetachSummary(detached=False)

    def retention(self) -> Retention:
        """How long a detached job started now keeps its results (the admin's setting, one rule for every
        backend: `tfdist.job.detach.retention`), with the sentence when the setting could not be read."""
        return detach.retention(self.kernel_settings())

    def kernel_settings(self) -> KernelSettings:
        """The admin's knobs for this server's kernels, as this backend reads them."""
        return KernelSettings()

    def idle_bytes(self) -> int:
        """Memory this backend holds on this server for a next job (the local warm pool): free for the job
        about to start, which takes it over. 0 when it holds none."""
        return 0

    def release_idle(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Let go of what `idle_bytes` counts (a job that cannot fit otherwise is about to be refused)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what this backend object holds (connections); running jobs are not touched."""
