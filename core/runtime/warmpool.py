"""A warm supervisor: a job's supervisor started before its job, holding a fork server with TensorFlow
imported.

Usage (tfdist.backends.pool only):
    [unshare --net ...] python -m tfdist.runtime.warmpool SERVER_PID STATEFILE

Why a whole supervisor and not a loose process: a local job's tasks live in the supervisor's network
namespace, as its children (death signal, oom_score_adj, cgroup). A fork server started by the supervisor
that will run the job is in the right place from the start, so nothing has to enter a namespace later.

It starts one fork server (tfdist.runtime.forkserver), writes STATEFILE (its PID and the server's, whether
TensorFlow is imported), and waits on stdin for one JSON line {"jobdir", "env"} from the kernel that
started it. Then it is that job's supervisor (tfdist.runtime.supervisor), with the kernel's environment of
that moment, and forks the job's tasks from that server (`ForkServer.spawn`). It exits instead, ending the
server, when stdin closes (the kernel is gone: the same lifeline as a job), or when the server's memory
use crosses DROP_SHARE of its limit: an idle pool is the first thing to go, well before a job is stopped
(memfit.GUARD_SHARE) or the kernel killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

from tfdist import memfit
from tfdist.procid import ProcessId
from tfdist.runtime import forkserver
from tfdist.runtime.forked import ForkServer, import_env, import_time_mismatch
from tfdist.settings import TaskSettings

DROP_SHARE = 0.80  # an idle pool ends itself above this share of the server's memory limit
MEMORY_CHECK_S = 1.0


class _State:
    """STATEFILE: what the kernel side and the tests read (PIDs with start times, so never a reused PID)."""

    def __init__(self, path: str):
        self.path = path

    def write(self, forks: ForkServer | None) -> None:
        if not self.path:
            return
        me = ProcessId.current()
        rec = {
            "pid": me.pid,
            "started": me.started,
            "boot": me.boot,
            "forkserver": forks.proc.pid if forks else None,
            "ready": bool(forks and forks.imported),
        }
        tmp = self.path + ".tmp"
        with contextlib.suppress(OSError):
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, self.path)

    def remove(self) -> None:
        """For good: a later `write` (the fork server's import ending after a job took the pool) is a no-op,
        or the kernel's next pool would find this one's record under the path they share."""
        path, self.path = self.path, ""
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)


def memory_short(server_pid: int | None) -> str | None:
    if server_pid is None:
        return None
    budget = memfit.server_budget(server_pid)
    if budget is None or budget.used < DROP_SHARE * budget.limit:
        return None
    return (
        f"the server's memory is {budget.used / budget.limit:.0%} used "
        f"({budget.used / memfit.GiB:.2f} of {budget.limit / memfit.GiB:.2f} GiB)"
    )


async def _wait_for_job(forks: ForkServer, server_pid: int | None) -> tuple[dict | None, str]:
    """The kernel's one line, or None and why the pool ends instead."""
    loop = asyncio.get_running_loop()
    line: asyncio.Future = loop.create_future()
    buf = bytearray()

    def readable() -> None:
        data = os.read(0, 65536)
        if line.done():
            return
        if not data:
            line.set_result(None)
            return
        buf.extend(data)
        if b"\n" in buf:
            line.set_result(json.loads(bytes(buf).split(b"\n", 1)[0]))

    loop.add_reader(0, readable)
    try:
        while not line.done():
            await asyncio.wait([line], timeout=MEMORY_CHECK_S)
            if line.done():
                break
            if why := memory_short(server_pid):
                return None, why
            if forks.proc.returncode is not None:
                return None, "its fork server ended"
        req = line.result()
        return req, "" if req is not None else "its kernel is gone"
    finally:
        loop.remove_reader(0)


def _log_to(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


async def _main(server_pid: int | None, statefile: str) -> int:
    from tfdist.runtime import supervisor
    from tfdist.runtime.spawn import die_with_task_parent

    name = forkserver.own_name()
    forkserver.set_name(forkserver.IDLE_NAME)  # an idle pool, not a job: see forkserver.IDLE_NAME
    state = _State(statefile)
    forks = await ForkServer.start(import_env(dict(os.environ)), die_with_task_parent, idle=True)
    if forks is None:
        print("tfdist warm pool: ended (no fork server: this kernel refuses child subreapers)", flush=True)
        return 0
    state.write(forks)
    forks.ready.add_done_callback(lambda _: state.write(forks))
    req, why = await _wait_for_job(forks, server_pid)
    state.remove()
    if req is None:
        print(f"tfdist warm pool: ended ({why})", flush=True)
        forks.close()
        await asyncio.sleep(0)
        return 0
    forkserver.set_name(name)
    jobdir = req["jobdir"]
    os.environ.clear()
    os.environ.update(req["env"])  # the kernel's environment now, as a supervisor started now would have
    _log_to(os.path.join(jobdir, "supervisor.log"))
    if differ := import_time_mismatch(forks.env, import_env(dict(os.environ))):
        # the notebook changed what TensorFlow's import reads since the pool started: each task would
        # start fresh; one fork server started now under the job's environment serves them all instead
        why = ", ".join(differ)
        print(f"tfdist warm pool: its import differs from the job's ({why}): a new fork server", flush=True)
        forks.close()
        return await supervisor.serve(jobdir, None)
    return await supervisor.serve(jobdir, forks)


def main() -> int:
    server_pid = int(sys.argv[1]) if sys.argv[1].isdigit() else None
    statefile = sys.argv[2]
    if TaskSettings().netns:
        from tfdist.runtime.netns import bring_up_loopback

        bring_up_loopback()
    return asyncio.run(_main(server_pid, statefile))


if __name__ == "__main__":
    sys.exit(main())
