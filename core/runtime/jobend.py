"""How a local job's run ends when the supervisor ends it: every task process still running stopped (SIGTERM,
a grace, SIGKILL), its output drained, and the outcome of a run that raised instead of finishing.

Why apart from the supervisor: stopping processes and naming an exception are the same for every way a job
ends (its cell's end, a stop, a guard, the lifeline); the supervisor decides when, this module how.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

from tfdist.job.vocab import JobState, Reason
from tfdist.runtime.spawn import StartupError, Task

KILL_GRACE_S = 3.0

Outcome = tuple[str, str, "dict | None"]  # state, message, error


def raised(exc: Exception) -> Outcome:
    """The outcome of a run that raised: a task that could not start says why in its first line; anything
    else is a bug of ours, said as one (the job's tasks are still cleaned up)."""
    if isinstance(exc, StartupError):
        return (
            JobState.FAILED,
            str(exc).splitlines()[0],
            {"type": type(exc).__name__, "message": str(exc), "traceback": ""},
        )
    return (
        JobState.FAILED,
        f"supervisor error: {exc}",
        {
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": "",
            "reason": Reason.INTERNAL.value,
        },
    )


async def end_tasks(tasks: Iterable[Task]) -> list[Task]:
    """Stop every task whose process still runs (SIGTERM, then SIGKILL after KILL_GRACE_S), wait for the
    readers of their output and close their logs. Returns the tasks that were still running."""
    tasks = list(tasks)
    alive = [t for t in tasks if t.alive]
    procs = [t.proc for t in alive]
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    if procs:
        await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=KILL_GRACE_S)
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        await asyncio.gather(*(p.wait() for p in procs), return_exceptions=True)
    for t in tasks:
        if t.reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t.reader, 1)
        if t.log is not None:
            t.log.close()
    return alive
