"""A local job's fork server: TensorFlow imported once, each of the job's tasks forked from it.

Usage (the supervisor only): python -u -m tfdist.runtime.forkserver   with fd 0 a SOCK_SEQPACKET socket.

Why: importing TensorFlow costs 5-8 CPU-seconds per process. A job of four tasks on two cores spent most of
its start importing it four times over; forked, it is imported once, the tasks start in milliseconds and
share the imported pages. Forking after the import is safe where forking after TensorFlow *started* is not:
the import makes no TensorFlow thread pool, server or device context (checked in tests/test_forkserver.py),
and each task makes its own after it became the task, from its own environment, as a fresh process would.

Protocol: it sends b"R" once TensorFlow is imported. Then each message is a task, {"module", "argv",
"env", "cwd", "fds"} as for a zygote (runtime.zygote.become), with the task's stdout first among the
passed descriptors (stdout and stderr both go there). It answers {"pid": N} or {"error": why}. The task is
not its child: a double fork hands it to the supervisor, a child subreaper, which waits for it and
signals it like any process it started (runtime.forked). The server ends when the socket closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import time

from tfdist.runtime import zygote

PR_SET_PDEATHSIG = 1
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
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != supervisor:  # the supervisor is gone (or is no subreaper): no owner, no task
        os._exit(1)


def _reseed() -> None:
    """Forked tasks would share the server's random state; Python's `random` reseeds itself at fork."""
    np = sys.modules.get("numpy")
    if np is not None:
        with contextlib.suppress(Exception):
            np.random.seed()


def _serve(sock: socket.socket, supervisor: int) -> tuple[dict, list[int]] | None:
    """Fork tasks until the socket closes: None here, the task's message in each task."""
    while True:
        got = zygote._receive(sock)
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
        zygote._import_tensorflow()
    except BaseException as exc:  # the supervisor starts its tasks fresh: they say what is wrong
        print(f"tfdist fork server: cannot import TensorFlow: {exc}", file=sys.stderr, flush=True)
        return 1
    with contextlib.suppress(OSError):
        sock.send(b"R")
    got = _serve(sock, supervisor)
    if got is None:
        return 0
    spec, fds = got
    _reseed()
    out, rest = fds[0], fds[1:]
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sock.detach()  # fd 0 stays open until `become` puts /dev/null there; never closed twice
    zygote.become(spec, rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
