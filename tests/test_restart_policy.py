"""One restart policy (tfdist.job.restart): what the local supervisor does with a task that ended, and the
limits the Kubernetes manifests hand to the Job controller, read from the same place."""

from __future__ import annotations

import dataclasses

import pytest

from tfdist.job.restart import PS_RESTARTS, WORKER_RESTARTS, Action, RestartPolicy
from tfdist.jobspec import JobSpec
from tfdist.kube import allreduce as ar
from tfdist.kube import manifests as mf
from tfdist.kube import names as kn
from tfdist.runtime import psrestart


def test_a_ps_worker_comes_back_until_its_limit() -> None:
    p = RestartPolicy()
    assert [p.after_exit("worker", 1, n) for n in range(WORKER_RESTARTS + 1)] == [Action.RESTART] * 3 + [
        Action.FAIL
    ]
    assert not p.ends_job("worker")  # the others carry on without it


def test_a_ps_comes_back_only_with_checkpoints() -> None:
    assert RestartPolicy().after_exit("ps", -9, 0) is Action.FAIL
    assert RestartPolicy().limit("ps") == 0 and RestartPolicy().ends_job("ps")
    p = RestartPolicy(checkpoint_every=5)
    assert p.ps_comes_back and p.limit("ps") == PS_RESTARTS
    assert p.after_exit("ps", -9, PS_RESTARTS - 1) is Action.RESUME
    assert p.after_exit("ps", -9, PS_RESTARTS) is Action.FAIL


def test_an_allreduce_worker_never_comes_back() -> None:
    p = RestartPolicy(strategy="allreduce", checkpoint_every=5)  # checkpoints do not bring a replica back
    assert p.after_exit("worker", 0, 0) is Action.DONE
    assert p.after_exit("worker", 1, 0) is Action.FAIL and p.ends_job("worker")
    assert p.limit("worker") == 0 and not p.ps_comes_back


def test_the_policy_is_frozen_and_read_from_the_spec() -> None:
    spec = JobSpec(name="j", user="u", workers=2, ps=1, checkpoint_every=10)
    p = RestartPolicy.for_spec(spec)
    assert (p.strategy, p.checkpoint_every) == ("ps", 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.worker_restarts = 9  # type: ignore[misc]


def test_manifests_and_supervisor_read_the_same_limits() -> None:
    spec = JobSpec(name="j", user="u", workers=2, ps=1, checkpoint_every=10)
    policy = RestartPolicy.for_spec(spec)
    workers = mf.task_job(spec, "worker", None)["spec"]
    ps = mf.task_job(spec, "ps", None)["spec"]
    assert workers["backoffLimitPerIndex"] == policy.limit("worker") == WORKER_RESTARTS
    assert ps["backoffLimitPerIndex"] == policy.limit("ps") == psrestart.MAX_PS_RESTARTS
    ann = ps["template"]["metadata"]["annotations"]
    assert ann[kn.A_PS_RESTARTS] == str(policy.limit("ps"))
    no_ckpt = mf.task_job(JobSpec(name="j", user="u", workers=2, ps=1), "ps", None)["spec"]
    assert no_ckpt["backoffLimit"] == 0 and "backoffLimitPerIndex" not in no_ckpt


def test_allreduce_workers_read_the_same_policy() -> None:
    spec = JobSpec(name="j", user="u", workers=3, strategy="allreduce")
    job = ar.worker_job(spec, None)
    assert job is not None
    assert job["spec"]["backoffLimit"] == RestartPolicy.for_spec(spec).limit("worker") == 0


def test_the_admission_policys_retry_caps_admit_the_restart_policys_limits():
    """hub_config/admission-policy.yaml bounds a user's Job retries (each failed pod stays until its Job is
    deleted): the caps it writes must admit what the Kubernetes backend asks for."""
    import re
    from pathlib import Path

    from tfdist.job.restart import PS_RESTARTS, WORKER_RESTARTS

    text = (Path(__file__).resolve().parent.parent / "hub_config" / "admission-policy.yaml").read_text()
    [per_index] = {int(n) for n in re.findall(r"backoffLimitPerIndex <= (\d+)", text)}
    assert max(WORKER_RESTARTS, PS_RESTARTS) <= per_index
