"""A pooled task process: TensorFlow imported ahead of time, waiting to become one task of a job.

Usage (the warm pool only): python -u -m tfdist.runtime.zygote   with fd 0 a SOCK_SEQPACKET socket.

Why: importing TensorFlow takes most of a local job's start (seconds per process, all processes at once
on a few cores). A zygote pays it before the job exists. It sends b"R" once TensorFlow is imported, then
waits for one message: {"module", "argv", "env", "cwd", "fds"} with the file descriptors a fresh process
would have inherited. It then becomes that task as `python -u -m MODULE ARGV...` started with that
environment would be: os.environ replaced (TensorFlow reads TF_CONFIG, its thread pool sizes and
CUDA_VISIBLE_DEVICES when a server or eager context starts, not at import; the pool refuses tasks whose
import-time variables differ, see warmpool.IMPORT_TIME), the working directory and sys.path[0] of `-m`,
stdin from /dev/null, and the module run as __main__. Its network namespace, oom_score_adj, death
signal, cgroup and CPU affinity are the supervisor's, set when it was started, as for a fresh task.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import socket
import sys

MAX_MESSAGE = 4 * 2**20  # a task's environment as JSON; the sender refuses larger
MAX_FDS = 8
# The name (/proc/PID/comm) of a pool's processes while they wait, and only then: what tells an idle pool
# from a job (tools, the tests' "no job process left"); a process that became a task has its own back.
IDLE_NAME = "tfdist-pool"
PR_SET_NAME = 15


def set_name(name: str) -> None:
    """Name the calling thread (the main thread: the process's name); threads started later inherit it."""
    import ctypes

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
    import tensorflow  # noqa: F401  (also imports tf_keras under TF_USE_LEGACY_KERAS)


def _receive(sock: socket.socket) -> tuple[dict, list[int]] | None:
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    except OSError:
        return None
    if not data:  # the pool was dropped, or its supervisor died
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
    environment, working directory and `fds` would; fd 0 (the socket it came on) becomes /dev/null."""
    env = {str(k): str(v) for k, v in spec["env"].items()}
    _install_fds([int(n) for n in spec.get("fds", [])], fds, env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # closes the pool's socket; a fresh task's stdin is /dev/null too
    os.close(devnull)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(spec["cwd"])
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.argv = [spec["module"], *spec.get("argv", [])]
    runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)


def main() -> int:
    sock = socket.socket(fileno=0)
    try:
        _import_tensorflow()
    except BaseException as exc:  # the pool falls back to fresh processes for this one
        print(f"tfdist zygote: cannot import TensorFlow: {exc}", file=sys.stderr, flush=True)
        return 1
    name = own_name()
    set_name(IDLE_NAME)  # after the import: the threads it started keep the name a fresh task's have
    # The pool may have handed this process a task while it was still importing, and closed its end: the
    # task's message is queued here all the same (EPIPE on send, the message still received), so a failed
    # "ready" is no reason to end; an empty read below says whether a task came.
    with contextlib.suppress(OSError):
        sock.send(b"R")
    got = _receive(sock)
    if got is None:
        return 0
    set_name(name)
    sock.detach()  # fd 0 stays open until `become` puts /dev/null there; never closed twice
    become(*got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
