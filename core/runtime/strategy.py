"""Which tf.distribute strategy a job's cell runs under, and which task speaks for the job.

Parameter-server training (`ps`) has one coordinator (chief-0) that drives remote workers and PS; only it
runs the cell. All-reduce (`allreduce`, MultiWorkerMirroredStrategy) has no coordinator: every worker runs
the same program and takes part in each step's collective, so every worker runs the cell, and chief-0 (the
first worker) is the only one that reports progress and writes the results back.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tfdist.settings import TaskSettings

PS = "ps"
ALLREDUCE = "allreduce"
# How long a PS coordinator waits for its servers' ports before it connects anyway (TF then retries on
# its own); the job's start-up --timeout is the supervisor's to enforce.
SERVERS_WAIT_S = 120.0
# The PS coordinator's own CPU: ParameterServerStrategy connects this process to the cluster as job "chief".
COORDINATOR_CPU = "/job:chief/replica:0/task:0/device:CPU:0"


def current() -> str:
    return TaskSettings().strategy


def task_type() -> str:
    try:
        return json.loads(os.environ.get("TF_CONFIG", "{}"))["task"]["type"]
    except (KeyError, TypeError, ValueError):
        return "chief"


def speaks_for_job() -> bool:
    """True where progress events and results come from: the PS coordinator, or all-reduce's chief."""
    return task_type() == "chief"


def make(name: str | None = None) -> Any:
    """The strategy, created before any other TensorFlow op (MWMS enables collectives at creation)."""
    import tensorflow as tf

    name = name or current()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if name == ALLREDUCE:
        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    if name == PS:
        from .ports import wait_all

        spec = resolver.cluster_spec().as_dict()
        wait_all([a for job in ("ps", "worker") for a in spec.get(job, [])], SERVERS_WAIT_S)
        return tf.distribute.ParameterServerStrategy(resolver)
    raise ValueError(f"unknown strategy {name!r}")
