"""Detached jobs' one lifecycle (tfdist.job.detach), for both backends: the retention rule and its
sentence, results-once, and what `%tfdist list` and the panel say. Pure rules here; the backends' own
runs are in tests/test_local_detach.py and tests/test_k8s_lifecycle.py."""

from __future__ import annotations

import json

import pytest

from tfdist.backends.kubernetes import KubernetesBackend
from tfdist.backends.local import LocalBackend, NoSuchDetachedJob
from tfdist.job import detach as dt
from tfdist.jobspec import JobSpec
from tfdist.settings import KernelSettings, from_environ

DAY = 24 * 3600.0


@pytest.mark.parametrize("raw", ["1 day", "0", "-5", "nan", "inf"])
def test_a_mistyped_retention_is_the_default_and_said_the_same_by_both_backends(
    raw: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("TFDIST_RESULT_RETENTION_S", raw)
    local = LocalBackend(str(tmp_path)).retention()
    kube = KubernetesBackend(from_environ({"TFDIST_NAMESPACE": "ns", "USER": "ann"})).retention()
    assert local == kube and local.seconds == DAY
    assert local.problem == (
        f"TFDIST_RESULT_RETENTION_S={raw!r} is not a number of seconds above 0, so a detached job's results "
        "wait the default 24 h (ask your admin to correct it)"
    )
    line = dt.started("away", local)
    assert line.endswith(f"\ntfdist: {local.problem}") and "(kept 24 h after it ends, once)" in line


def test_a_good_retention_is_used_and_says_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TFDIST_RESULT_RETENTION_S", "90")
    assert dt.retention() == dt.Retention(90.0)
    assert dt.retention(KernelSettings({})) == dt.Retention(DAY)  # unset: the default, no sentence
    assert "\n" not in dt.started("away", dt.retention())


def test_the_record_of_a_job_keeps_the_rule_it_started_under() -> None:
    rec = {"retention_s": 60}
    assert dt.kept_for(rec) == 60 and dt.kept_for({"retention_s": "x"}) == DAY and dt.kept_for(None) == DAY
    assert not dt.expired(rec, None, 10**9)  # still running: never
    assert not dt.expired(rec, 1000.0, 1059.0) and dt.expired(rec, 1000.0, 1061.0)
    assert not dt.expired(None, 0.0, 10**9)  # not detached: not this rule's


def test_what_list_and_the_panel_say() -> None:
    assert dt.summary(None, 5.0).fields() == {"detached": False}
    assert dt.summary({}, None).fields() == {"detached": True, "results": "pending"}
    assert dt.summary({"retention_s": 60}, 1000.0).fields() == {
        "detached": True,
        "results": "waiting",
        "kept_until": 1060.0,
    }
    assert dt.summary({"taken": 3.0}, 1000.0).fields() == {"detached": True, "results": "taken"}
    assert dt.summary({}, 1000.0, has_results=False).results == "none"
    assert (
        dt.row_note({"detached": True, "results": "waiting"})
        == " [detached: results wait for %tfdist attach]"
    )
    assert dt.row_note({"detached": False}) == "" and dt.row_note({}) == ""


def test_the_local_backends_sentences_are_the_rules() -> None:
    assert str(NoSuchDetachedJob("away", 3600)) == dt.nothing_waiting("away", 3600)
    assert "ended more than 1 h ago" in dt.nothing_waiting("away", 3600)


def test_detach_is_a_typed_field_of_the_spec_and_reads_older_specs() -> None:
    spec = JobSpec(name="a", user="u", detach=True)
    assert spec.detach and spec.extra == {}  # one place says it: no copy in `extra`
    assert json.loads(spec.to_json())["extra"] == {} and json.loads(spec.to_json())["detach"] is True
    old = JobSpec.from_json('{"name": "a", "user": "u", "extra": {"detach": true, "x": 1}}')  # written before
    assert old.detach is True and old.extra == {"x": 1}
    assert JobSpec.from_json('{"name": "a", "user": "u", "extra": {"detach": false}}').detach is False
    newer = JobSpec.from_json('{"name": "a", "user": "u", "priority": "high"}')  # a newer kernel's key
    assert newer.name == "a" and not newer.detach
    assert JobSpec.from_json(spec.to_json()) == spec
    assert JobSpec(name="a", user="u", strategy="allreduce").strategy == "allreduce"
