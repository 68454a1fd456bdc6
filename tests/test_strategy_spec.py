"""Pure checks of the strategy in the job spec and TF_CONFIG: all-reduce has workers only, chief-0 first."""

from __future__ import annotations

import json
import re

import pytest

from tfdist import taskenv, tf_config
from tfdist.errors import JobSpecError
from tfdist.jobspec import JobSpec, default_ps, validate
from tfdist.runtime.allreduce import replica_index


def test_allreduce_tasks_are_replicas_without_ps():
    assert tf_config.task_names(3, 0, "allreduce") == ["chief-0", "worker-0", "worker-1"]
    assert [replica_index(t) for t in tf_config.task_names(3, 0, "allreduce")] == [0, 1, 2]
    addrs = tf_config.local_addresses(3, 0, [5000, 5001, 5002], strategy="allreduce")
    cl = tf_config.cluster(addrs, "allreduce")
    assert cl == {"chief": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5001", "127.0.0.1:5002"]}
    assert json.loads(tf_config.tf_config(cl, "worker-1"))["task"] == {"type": "worker", "index": 1}
    # one worker: only the chief
    assert tf_config.cluster(tf_config.local_addresses(1, 0, [7], strategy="allreduce"), "allreduce") == {
        "chief": ["127.0.0.1:7"]
    }
    with pytest.raises(ValueError, match="no PS"):
        tf_config.cluster({"chief": ["a:1"], "ps": ["b:2"]}, "allreduce")


def test_task_count_and_ps_defaults():
    assert JobSpec(name="a", user="u", workers=3, ps=0, strategy="allreduce").task_count == 3
    assert JobSpec(name="a", user="u", workers=3, ps=2).task_count == 6
    assert default_ps("ps", None) == 1 and default_ps("allreduce", None) == 0 and default_ps("ps", 3) == 3
    with pytest.raises(JobSpecError, match="--ps 2 does not go with --strategy allreduce"):
        default_ps("allreduce", 2)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"strategy": "mirrored"}, "--strategy 'mirrored' is unknown"),
        ({"strategy": "allreduce", "ps": 1}, "--ps 1 does not go with --strategy allreduce"),
        (
            {"strategy": "allreduce", "ps": 0, "checkpoint_every": 5},
            "--checkpoint-every is for --strategy ps",
        ),
        ({"checkpoint_every": 0}, "--checkpoint-every must be a positive number of steps"),
        (
            {"strategy": "allreduce", "ps": 2, "backend": "kubernetes"},
            "--ps 2 does not go with --strategy allreduce",
        ),
        ({"strategy": "allreduce", "ps": 0, "workers": 0, "backend": "kubernetes"}, "--workers must be"),
        (
            {"checkpoint_every": 0, "backend": "kubernetes"},
            "--checkpoint-every must be a positive number of steps",
        ),
        (
            {"checkpoint_every": "10", "backend": "kubernetes"},
            "--checkpoint-every must be a positive number of steps",
        ),
        (
            {"strategy": "allreduce", "ps": 0, "checkpoint_every": 5, "backend": "kubernetes"},
            "--checkpoint-every is for --strategy ps",
        ),
        ({"checkpoint_every": -3}, "--checkpoint-every must be a positive number of steps"),
        ({"checkpoint_every": 2.5}, "--checkpoint-every must be a positive number of steps"),
        ({"checkpoint_every": True}, "--checkpoint-every must be a positive number of steps"),
        # replica 0 is the agent pod that keeps a detached job's results: its GPUs would stay held
        (
            {"strategy": "allreduce", "ps": 0, "gpus_per_worker": 1, "detach": True, "backend": "kubernetes"},
            "--detach does not go with --strategy allreduce and GPUs on Kubernetes",
        ),
    ],
)
def test_bad_strategy_specs(kw, message):
    with pytest.raises(JobSpecError, match=re.escape(message)):
        validate(JobSpec(name="job", user="u", **kw), 0)


def test_allreduce_is_accepted_on_both_backends():
    for backend in ("local", "kubernetes"):
        spec = JobSpec(name="job", user="u", backend=backend, strategy="allreduce", ps=0, workers=3)
        assert validate(spec, 0).task_count == 3


def test_detached_allreduce_without_gpus_or_locally_is_accepted():
    """Locally a server's GPUs are its own whatever its jobs do (no quota or queue counts them per job); on
    Kubernetes without GPUs replica 0's pod holds only its CPU while the results wait."""
    for backend, gpus in (("local", 1), ("kubernetes", 0)):
        spec = JobSpec(
            name="job",
            user="u",
            backend=backend,
            strategy="allreduce",
            ps=0,
            gpus_per_worker=gpus,
            detach=True,
        )
        assert validate(spec, 2).detach


def test_checkpoint_every_is_accepted_on_both_backends():
    """A PS that comes back: the local supervisor restarts it, on Kubernetes the PS Job and the coordinator
    pod do (tfdist.runtime.pspod)."""
    for backend in ("local", "kubernetes"):
        spec = JobSpec(name="job", user="u", backend=backend, checkpoint_every=25)
        assert validate(spec, 0).checkpoint_every == 25


def test_every_task_is_told_its_strategy():
    env = taskenv.tf_env(tf_config="{}", task="worker-0", cpu=None, cores=2, strategy="allreduce")
    assert env["TFDIST_STRATEGY"] == "allreduce"
    assert taskenv.tf_env(tf_config="{}", task="ps-0", cpu=None, cores=2)["TFDIST_STRATEGY"] == "ps"
