"""A fork server: TensorFlow imported once, each task of a local job forked from it.

Usage (runtime.forked and runtime.probehelpers only): python -u -m tfdist.runtime.forkserver [idle]
(fd 0: a SOCK_SEQPACKET socket)

Why: importing TensorFlow costs 5-8 CPU-seconds per process. A job of four tasks on two cores spent most of
its start importing it four times over; forked, it is imported once, the tasks start in milliseconds and
share the imported pages. Forking after the import is safe where forking after TensorFlow *started* is not:
the import makes no TensorFlow thread pool, server or device context (tests/test_warm_pool.py checks an
idle server), and each task makes its own after it became the task, from its own environment.

Each job's supervisor starts one (runtime.forked) the moment it starts; a kernel's warm pool
(runtime.warmpool) starts one before its next job exists, named IDLE_NAME while it waits ("idle").

Protocol: it sends b"R" once TensorFlow is imported. Each message then is a task, {"module", "argv", "env",
"cwd", "fds", "stdin"}, with the task's stdout (stdout and stderr both go there), its stdin where "stdin"
is true, and then the file descriptors a fresh process would have inherited (`fds` their numbers there).
It answers {"pid": N} or {"error": why}. Both clients (runtime.forked's async one, runtime.probehelpers'
blocking one) build the message with `request` and read the answer with `answer`.
The task becomes what `python -u -m MODULE ARGV...` started with that environment would be: os.environ
replaced (TensorFlow reads TF_CONFIG, its thread pool sizes and CUDA_VISIBLE_DEVICES when a server or eager
context starts, not at import; tasks whose import-time variables differ start fresh, see
warmpool.fresh_start_reason), the working directory and sys.path[0] of `-m`, stdin from /dev/null, the
module run as __main__. Its network namespace, oom_score_adj, cgroup and CPU affinity are the fork
server's, which are the supervisor's. It is not the fork server's child: a double fork hands it to the
supervisor, a child subreaper, which waits for it and signals it like any process it started, and it dies
with the supervisor (PR_SET_PDEATHSIG). The server ends when the socket closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import runpy
import socket
import sys
import time
from collections.abc import Sequence

from tfdist.runtime.deathsig import die_with

MAX_MESSAGE = 4 * 2**20  # a task's environment as JSON; the sender refuses larger
MAX_FDS = 8
# The name (/proc/PID/comm) of a warm pool's processes while they wait, and only then: what tells an
# idle pool from a job (tools, the tests' "no job process left"); a forked task has its own name back.
IDLE_NAME = "tfdist-pool"
PR_SET_NAME = 15


def set_name(name: str) -> None:
    """Name the calling thread (the main thread: the process's name); threads started later inherit it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def own_name() -> str:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return "python"


def _import_tensorflow() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras is tf_keras in every task (taskenv.tf_env)
    from .importing import import_coordinator

    import_coordinator()  # the servers' import, and the coordinator's too: once here, not after each fork


READY = b"R"  # sent once, when TensorFlow is imported


def request(
    module: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    out: int,
    fds: Sequence[int] = (),
    stdin: int | None = None,
) -> tuple[bytes, list[int]]:
    """One task as the server reads it: the message and the descriptors sent with it (its output, its stdin
    where it has one, then `fds`, which the task finds at those numbers)."""
    has_stdin = stdin is not None
    data = json.dumps(
        {"module": module, "argv": argv, "env": env, "cwd": cwd, "fds": list(fds), "stdin": has_stdin}
    ).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"the task's message is {len(data)} bytes, over the fork server's {MAX_MESSAGE}")
    return data, [out, *([] if stdin is None else [stdin]), *fds]


def answer(data: bytes) -> int | str:
    """The server's reply to `request`: the forked task's PID, or why it was not forked."""
    try:
        reply = json.loads(data) if data else {"error": "the fork server is gone"}
        return int(reply["pid"]) if "pid" in reply else str(reply.get("error", "no answer"))
    except (ValueError, TypeError, AttributeError) as exc:
        return f"the fork server's answer is unreadable: {exc}"


def _receive(sock: socket.socket) -> tuple[dict, list[int]] | None:
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    except OSError:
        return None
    if not data:  # closed: no more tasks, or the supervisor died
        return None
    return json.loads(data), fds


def _install_fds(expected: list[int], received: list[int], env: dict[str, str]) -> None:
    """Give each passed descriptor the number a fresh child would have had (`pass_fds` keeps numbers);
    where that number is taken here, keep the received one and say so where the task reads it."""
    for want, got in zip(expected, received, strict=True):
        try:
            os.fstat(want)
            taken = True
        except OSError:
            taken = False
        if taken:
            os.set_inheritable(got, True)
            for k, v in env.items():
                if v == str(want) and k.endswith("_FD"):
                    env[k] = str(got)
            continue
        os.dup2(got, want)  # inheritable by default
        os.close(got)


def become(spec: dict, fds: list[int]) -> None:
    """Run the task `spec` names in this process, as `python -u -m MODULE ARGV...` started with its
    environment, working directory and `fds` would; fd 0 (the socket it came on) becomes /dev/null, or,
    where `spec["stdin"]` is true, the first of `fds` (the plan's probe talks to its helpers there)."""
    env = {str(k): str(v) for k, v in spec["env"].items()}
    stdin = fds.pop(0) if spec.get("stdin") else os.open(os.devnull, os.O_RDONLY)
    _install_fds([int(n) for n in spec.get("fds", [])], fds, env)
    os.dup2(stdin, 0)  # closes the pool's socket; a fresh task's stdin is /dev/null too
    os.close(stdin)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(spec["cwd"])
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.argv = [spec["module"], *spec.get("argv", [])]
    runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)


REPARENT_WAIT_S = 5.0  # the middle process exits at once; this only bounds a wedged machine


def _fork_task(supervisor: int) -> int:
    """Fork the task: its PID here, 0 in the task itself (by then the supervisor's child)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # exits at once: its child is reparented to the nearest subreaper, the supervisor
        try:
            os.close(r)
            me = os.getpid()
            task = os.fork()
            if task == 0:
                os.close(w)
                _adopted(me, supervisor)
                return 0
            os.write(w, str(task).encode())
        except BaseException:
            os._exit(1)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(middle, 0)
    if not data:
        raise OSError("the task could not be forked")
    return int(data)


def _adopted(middle: int, supervisor: int) -> None:
    """In the task: wait to be the supervisor's child, then die with it, as a task it started would."""
    deadline = time.monotonic() + REPARENT_WAIT_S
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.0005)
    die_with(supervisor)  # gone already (or no subreaper): no owner, no task


def _reseed() -> None:
    """Forked tasks would share the server's random state; Python's `random` reseeds itself at fork."""
    np = sys.modules.get("numpy")
    if np is not None:
        with contextlib.suppress(Exception):
            np.random.seed()


def _serve(sock: socket.socket, supervisor: int) -> tuple[dict, list[int]] | None:
    """Fork tasks until the socket closes: None here, the task's message in each task."""
    while True:
        got = _receive(sock)
        if got is None:
            return None
        spec, fds = got
        try:
            pid = _fork_task(supervisor)
        except OSError as exc:
            reply = {"error": str(exc)}
        else:
            if pid == 0:
                return spec, fds
            reply = {"pid": pid}
        for fd in fds:  # the task holds its own copies
            with contextlib.suppress(OSError):
                os.close(fd)
        try:
            sock.send(json.dumps(reply).encode())
        except OSError:
            return None


def main() -> int:
    sock = socket.socket(fileno=0)
    supervisor = os.getppid()
    try:
        _import_tensorflow()
    except BaseException as exc:  # the supervisor starts its tasks fresh: they say what is wrong
        print(f"tfdist fork server: cannot import TensorFlow: {exc}", file=sys.stderr, flush=True)
        return 1
    # The import's objects move out of the collector's reach: a task's collections then neither walk them
    # nor write to their pages, which stay shared with the server instead of being copied into each task.
    gc.collect()
    gc.freeze()
    name = own_name()
    if sys.argv[1:] == ["idle"]:
        set_name(IDLE_NAME)  # after the import: the threads it started keep the name a fresh task's have
    # A task may have been sent while TensorFlow was still importing: it is queued here all the same (a
    # failed "ready" is no reason to end; an empty read says whether a task will come).
    with contextlib.suppress(OSError):
        sock.send(READY)
    got = _serve(sock, supervisor)
    if got is None:
        return 0
    spec, fds = got
    set_name(name)
    _reseed()
    out, rest = fds[0], fds[1:]
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sock.detach()  # fd 0 stays open until `become` puts /dev/null there; never closed twice
    become(spec, rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
