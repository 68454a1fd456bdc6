"""Pure parts of a job: spec checks, memory sizes, TF_CONFIG, GPU split."""

from __future__ import annotations

import json

import pytest

from tfdist import tf_config
from tfdist.errors import JobSpecError
from tfdist.jobspec import JobSpec, parse_memory, split_gpus, validate


def spec(**kw):
    return JobSpec(**({"name": "job-1", "user": "ann"} | kw))


def test_tf_config_names_every_task_with_its_own_index():
    addrs = tf_config.local_addresses(2, 1, [1001, 1002, 1003, 1004])
    cl = tf_config.cluster(addrs)
    assert cl == {
        "chief": ["127.0.0.1:1001"],
        "worker": ["127.0.0.1:1002", "127.0.0.1:1003"],
        "ps": ["127.0.0.1:1004"],
    }
    cfg = json.loads(tf_config.tf_config(cl, "worker-1"))
    assert cfg["task"] == {"type": "worker", "index": 1}
    assert cfg["cluster"] == cl


def test_tf_config_refuses_clusters_that_cannot_train():
    with pytest.raises(ValueError, match="ps"):
        tf_config.cluster({"chief": ["a:1"], "worker": ["b:1"]})
    with pytest.raises(ValueError, match="not in the cluster"):
        tf_config.tf_config(
            tf_config.cluster({"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]}), "worker-3"
        )


@pytest.mark.parametrize(
    ("kw", "gpus", "message"),
    [
        ({"workers": 0}, 0, "--workers must be at least 1"),
        ({"workers": -3}, 0, "--workers must be at least 1"),
        ({"ps": 0}, 0, "--ps must be at least 1"),
        ({"gpus_per_worker": -1}, 0, "cannot be negative"),
        ({"gpus_per_worker": 1}, 0, "needs 2 GPUs, but this server has 0"),
        ({"gpus_per_worker": 2, "workers": 2}, 3, "needs 4 GPUs, but this server has 3"),
        ({"name": "Bad_Name"}, 0, "is not valid"),
        ({"name": "x" * 60}, 0, "is not valid"),
        ({"backend": "slurm"}, 0, "is unknown"),
        ({"cpu": 0.0}, 0, "--cpu must be"),
        ({"timeout_s": -1.0}, 0, "--timeout must be a positive number of seconds"),
        ({"timeout_s": float("nan")}, 0, "--timeout must be a positive number of seconds"),  # never fires
        ({"timeout_s": float("inf")}, 0, "--timeout must be a positive number of seconds"),
        ({"cpu": float("nan")}, 0, "--cpu must be"),
        ({"base_port": 80}, 0, "out of range"),
        ({"workers": 300}, 0, "more than the limit"),
    ],
)
def test_bad_specs_are_refused_with_a_message(kw, gpus, message):
    with pytest.raises(JobSpecError, match=message):
        validate(spec(**kw), gpus)


def test_gpu_request_that_fits_passes():
    s = validate(spec(gpus_per_worker=1, workers=2), 2)
    assert split_gpus(["0", "3"], s.workers, s.gpus_per_worker) == [["0"], ["3"]]


@pytest.mark.parametrize(
    ("text", "value"),
    [("512Mi", 512 * 2**20), ("2G", 2 * 10**9), ("1.5Gi", int(1.5 * 2**30)), ("134217728", 134217728)],
)
def test_memory_quantities(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text", ["4 G", "4GB", "-1Gi", "lots", "1e3", "", " 2Gi", "1Mi"])
def test_bad_memory_quantities(text):
    with pytest.raises(JobSpecError, match="--memory"):
        parse_memory(text)


def test_spec_round_trips_through_json():
    s = spec(workers=3, memory_bytes=2**30, extra={"a": 1})
    assert JobSpec.from_json(s.to_json()) == s


def test_task_ids_are_parsed_once_into_role_and_index() -> None:
    from tfdist.tf_config import TaskId, split_task

    t = TaskId.parse("worker-12")
    assert (t.role, t.index, str(t), t.is_coordinator) == ("worker", 12, "worker-12", False)
    assert TaskId.parse("chief-0").is_coordinator and split_task("ps-1") == ("ps", 1)
    for bad in ("worker", "worker-", "gpu-0", "ps-x", "", "-1"):
        with pytest.raises(ValueError):
            TaskId.parse(bad)
