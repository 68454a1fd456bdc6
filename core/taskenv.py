"""The environment of one TensorFlow task (PS, worker or coordinator), the same on both backends.

Why one place: the variables that make parameter-server training work (legacy Keras, fail-fast gRPC, thread
pools sized to the task's cores) were written separately for local processes and for pods, and the thread
pools were missing where they mattered most. TensorFlow sizes its inter-op pool from the CPUs in the
process's affinity mask; with one CPU the pool has one thread and PS training deadlocks (measured: a
1-core `taskset` run of the bare PS baseline hangs at 0 % CPU, and finishes with two inter-op threads).
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping

# PS training blocks an inter-op thread on remote calls: with one, nothing else can run (the deadlock).
MIN_INTER_OP_THREADS = 2

THREAD_VARS = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS")


def thread_env(cpu: float | None, cores: int) -> dict[str, str]:
    """Thread pools for a task with `cpu` cores asked (`--cpu`) and `cores` CPUs it may run on.

    Intra-op threads match the cores the task has (what `--cpu` means); inter-op threads never drop below
    MIN_INTER_OP_THREADS, whatever the affinity or the request.
    """
    have = max(1, cores)
    intra = have if cpu is None else max(1, min(have, math.ceil(cpu - 1e-9)))
    inter = max(MIN_INTER_OP_THREADS, intra)
    return {
        "TF_NUM_INTRAOP_THREADS": str(intra),
        "TF_NUM_INTEROP_THREADS": str(inter),
        "OMP_NUM_THREADS": str(intra),
    }


def tf_env(
    *, tf_config: str, task: str, cpu: float | None, cores: int | None, strategy: str = "ps"
) -> dict[str, str]:
    """Everything a task needs from its environment; `cores` None: decided where it runs (a pod)."""
    env = {
        "TF_CONFIG": tf_config,
        "TFDIST_TASK": task,
        "TFDIST_STRATEGY": strategy,  # which tf.distribute strategy the cell runs under
        "GRPC_FAIL_FAST": "use_caller",  # a lost worker fails its closure instead of hanging the fit
        "TF_USE_LEGACY_KERAS": "1",  # Keras 3 has no parameter-server training
        "PYTHONUNBUFFERED": "1",
    }
    if cpu is not None or cores is not None:
        env |= thread_env(cpu, cores if cores is not None else math.ceil(cpu or 1))
    return env


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def ensure_threads(environ: MutableMapping[str, str] | None = None) -> None:
    """At a task's start, before TensorFlow is imported: fill in thread pools nobody set (a pod without
    `--cpu` learns its cores only where it runs), and lift an inter-op pool below the minimum."""
    env = os.environ if environ is None else environ
    if not all(env.get(k) for k in THREAD_VARS):
        for k, v in thread_env(None, usable_cores()).items():
            if not env.get(k):
                env[k] = v
    try:
        inter = int(env["TF_NUM_INTEROP_THREADS"])
    except ValueError:
        inter = 0
    if inter < MIN_INTER_OP_THREADS:
        env["TF_NUM_INTEROP_THREADS"] = str(MIN_INTER_OP_THREADS)
