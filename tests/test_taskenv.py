"""Every task's TensorFlow environment: thread pools that cannot deadlock, the same on both backends."""

from __future__ import annotations

import json

import pytest

from tfdist import taskenv
from tfdist.jobspec import JobSpec
from tfdist.kube import podtemplate


@pytest.mark.parametrize(
    ("cpu", "cores", "intra", "inter"),
    [
        (None, 1, 1, 2),  # the 1-core server of the default profile: two inter-op threads, not one
        (None, 2, 2, 2),
        (None, 8, 8, 8),
        (1.0, 8, 1, 2),  # --cpu 1 means one core's worth of intra-op threads
        (0.5, 8, 1, 2),
        (2.5, 8, 3, 3),
        (4.0, 2, 2, 2),  # more than the server has: no oversubscription
    ],
)
def test_thread_pools(cpu: float | None, cores: int, intra: int, inter: int) -> None:
    env = taskenv.thread_env(cpu, cores)
    assert env == {
        "TF_NUM_INTRAOP_THREADS": str(intra),
        "TF_NUM_INTEROP_THREADS": str(inter),
        "OMP_NUM_THREADS": str(intra),
    }


def test_a_task_started_with_one_inter_op_thread_gets_the_minimum() -> None:
    env = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1"}
    taskenv.ensure_threads(env)
    assert env["TF_NUM_INTEROP_THREADS"] == "2"
    unset: dict[str, str] = {}
    taskenv.ensure_threads(unset)
    assert int(unset["TF_NUM_INTEROP_THREADS"]) >= 2 and int(unset["TF_NUM_INTRAOP_THREADS"]) >= 1


def test_pods_get_the_same_environment_as_local_tasks() -> None:
    spec = JobSpec(name="j1", user="ana", workers=2, ps=1, cpu=1.0, backend="kubernetes", image="img")
    pod = podtemplate.pod_template(spec, "worker")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["TF_NUM_INTEROP_THREADS"] == "2" and env["TF_NUM_INTRAOP_THREADS"] == "1"
    assert env["GRPC_FAIL_FAST"] == "use_caller" and env["TF_USE_LEGACY_KERAS"] == "1"
    from tfdist.runtime.podmain import task_environment

    task_environment("worker", env := {**env, "JOB_COMPLETION_INDEX": "1"})  # what the pod does at start
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
    # without --cpu the pod sizes its pools where it runs (taskenv.ensure_threads at the task's start)
    bare = podtemplate.pod_template(JobSpec(name="j1", user="ana", backend="kubernetes", image="img"), "ps")
    names = {e["name"] for e in bare["spec"]["containers"][0]["env"]}
    assert not names & set(taskenv.THREAD_VARS)
