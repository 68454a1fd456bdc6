"""tfdist.kube.queueing, the pure part: the profiles' `kueue:` section as Kueue objects, a job's pod group,
the refusal of a job no queue can ever hold, a job's place in line. No cluster (test_kueue_plane.py runs
the same objects in Kueue)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tfdist.jobspec import JobSpec
from tfdist.kube import manifests as mf
from tfdist.kube import queueing as q
from tfdist.kube import queueline as ql
from tfdist.spawner.profiles import ProfilesFileError, load_profiles, parse_profiles

REPO = Path(__file__).resolve().parents[1]

BASE = {
    "gpu_models": {
        "h100": {
            "display_name": "H100",
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        },
        "a100": {
            "display_name": "A100",
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        },
        "mig": {
            "display_name": "slice",
            "resource": "nvidia.com/mig-1g.10gb",
            "node_selector": {"nvidia.com/mig.config": "all-1g.10gb"},
        },
    },
    "kueue": {
        "cohort": "pool",
        "queues": {
            "team-a": {"cpu": 16, "memory_gib": 64, "gpus": {"h100": 8, "mig": 7}},
            "team-b": {"gpus": {"a100": 4}, "borrowing_limit_gpus": 2},
        },
    },
    "profiles": [
        {
            "slug": "a",
            "display_name": "A",
            "groups": ["team-a"],
            "cpu": {"min": 1, "max": 8, "default": 1},
            "memory_gib": {"min": 1, "max": 8, "default": 1},
            "gpus": {"max": 8},
            "gpu_models": ["h100", "mig"],
            "kueue_queue": "team-a",
            "images": ["img"],
        },
        {
            "slug": "b",
            "display_name": "B",
            "groups": ["team-b"],
            "cpu": {"min": 1, "max": 8, "default": 1},
            "memory_gib": {"min": 1, "max": 8, "default": 1},
            "gpus": {"max": 4},
            "gpu_models": ["a100"],
            "kueue_queue": "team-b",
            "images": ["img"],
        },
    ],
}


def cfg(**changes):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data.update(changes)
    return parse_profiles(data)


def by_name(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def test_flavors_queues_cohort_from_the_profiles():
    objs = q.cluster_objects(cfg())
    flavors = by_name(objs, "ResourceFlavor")
    assert set(flavors) == {"default", "h100", "a100", "mig"}
    assert flavors["h100"]["spec"]["nodeLabels"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert flavors["default"]["spec"] == {}
    assert list(by_name(objs, "Cohort")) == ["pool"]
    # flavors and the cohort come before the queues that name them
    kinds = [o["kind"] for o in objs]
    assert kinds.index("ClusterQueue") > max(kinds.index("ResourceFlavor"), kinds.index("Cohort"))

    cqs = by_name(objs, "ClusterQueue")
    a = cqs["team-a"]["spec"]
    assert a["cohortName"] == "pool"
    groups = {tuple(g["coveredResources"]): g["flavors"] for g in a["resourceGroups"]}
    cpu = {
        r["name"]: r["nominalQuota"] for r in groups[("cpu", "memory", "ephemeral-storage")][0]["resources"]
    }
    assert cpu["cpu"] == "16000m" and cpu["memory"] == str(64 * 2**30)
    # every flavor of the cohort, own quota or 0, so that borrowing can happen; MIG is a group of its own
    gpu = {f["name"]: f["resources"][0]["nominalQuota"] for f in groups[("nvidia.com/gpu",)]}
    assert gpu == {"h100": "8", "a100": "0"}
    assert {f["name"]: f["resources"][0]["nominalQuota"] for f in groups[("nvidia.com/mig-1g.10gb",)]} == {
        "mig": "7"
    }
    b = cqs["team-b"]["spec"]
    bgpu = next(g for g in b["resourceGroups"] if g["coveredResources"] == ["nvidia.com/gpu"])["flavors"]
    assert {
        f["name"]: (f["resources"][0]["nominalQuota"], f["resources"][0]["borrowingLimit"]) for f in bgpu
    } == {
        "h100": ("0", "2"),
        "a100": ("4", "2"),
    }
    # unset cpu/memory: covered (Kueue needs every requested resource covered) but not capped
    bcpu = {r["name"]: r for r in b["resourceGroups"][0]["flavors"][0]["resources"]}
    assert bcpu["cpu"]["nominalQuota"] == q.NO_CAP["cpu"] and bcpu["cpu"]["lendingLimit"] == "0"
    assert all(o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "jupyter-tfdist" for o in objs)


def test_fair_sharing_is_the_queues_admission_scope_said_either_way():
    """On: Kueue orders the queue's pending jobs by their users' recent usage; off: said too, so that
    turning it off changes the live ClusterQueue (converge compares only what is said)."""
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data["kueue"]["queues"]["team-a"]["fair_sharing"] = True
    cqs = by_name(q.cluster_queues(parse_profiles(data)), "ClusterQueue")
    assert cqs["team-a"]["spec"]["admissionScope"] == {"admissionMode": "UsageBasedAdmissionFairSharing"}
    assert cqs["team-b"]["spec"]["admissionScope"] == {"admissionMode": "NoAdmissionFairSharing"}
    off = cqs["team-b"]["spec"]["admissionScope"]
    assert not q.covers({"admissionScope": off}, cqs["team-a"]["spec"])  # turning it off is a change


def test_local_queues_per_user_from_their_profiles():
    c = cfg()
    lqs = q.local_queues(c, "user-x", ["team-a", "team-b"])
    assert [
        (lq["metadata"]["namespace"], lq["metadata"]["name"], lq["spec"]["clusterQueue"]) for lq in lqs
    ] == [
        ("user-x", "team-a", "team-a"),
        ("user-x", "team-b", "team-b"),
    ]
    assert [lq["metadata"]["name"] for lq in q.local_queues(c, "u", ["team-b"])] == ["team-b"]
    assert q.local_queues(c, "u", ["nobody"]) == []


def test_no_kueue_section_means_no_objects_and_queue_is_a_label():
    data = yaml.safe_load(yaml.safe_dump(BASE))
    del data["kueue"]
    c = parse_profiles(data)
    assert q.cluster_objects(c) == [] and q.local_queues(c, "u", ["team-a"]) == []


@pytest.mark.parametrize(
    "change, key, words",
    [
        ({"queues": {"team-a": {"gpus": {"v100": 1}}, "team-b": {}}}, "(top level)", "GPU model 'v100'"),
        ({"queues": {"team-b": {}}}, "(top level)", "kueue_queue 'team-a'"),
        ({"queues": {"Team A": {}}}, "kueue.queues", "lowercase"),
        ({"queues": {"team-a": {"cpu": -1}, "team-b": {}}}, "kueue.queues.team-a.cpu", "greater than 0"),
        ({"queues": {"team-a": {"gpus": {"h100": -2}}, "team-b": {}}}, "kueue.queues.team-a", "whole number"),
        (
            {"queues": {"team-a": {"gpu": {"h100": 1}}, "team-b": {}}},
            "kueue.queues.team-a.gpu",
            "unknown key",
        ),
        ({"queues": {}}, "kueue.queues", "at least 1"),
        (
            {"queues": {"team-a": {"fair_sharing": "yes"}, "team-b": {}}},
            "kueue.queues.team-a.fair_sharing",
            "boolean",
        ),
    ],
)
def test_bad_queue_sections_are_refused_with_the_key(change, key, words):
    with pytest.raises(ProfilesFileError) as e:
        cfg(kueue=change)
    text = str(e.value)
    assert key in text and words in text, text


def test_the_example_profiles_have_a_queue_for_their_kueue_queue():
    c = load_profiles(REPO / "hub_config" / "profiles.yaml")
    assert c.kueue is not None and "ml-team" in c.kueue.queues
    assert [lq["metadata"]["name"] for lq in q.local_queues(c, "u", ["ml-team"])] == ["ml-team"]
    names = set(by_name(q.cluster_objects(c), "ResourceFlavor"))
    assert names == {"default", "h100", "a100", "a100-mig-1g"}


def spec(**kw) -> JobSpec:
    base = {"name": "j1", "user": "alice", "namespace": "u-alice", "workers": 2, "ps": 1, "image": "img"}
    return JobSpec(**(base | kw))


def test_pod_group_labels_on_every_pod_of_a_job():
    s = spec(gpus_per_worker=4)
    meta = q.with_pod_group({"labels": {"a": "b"}, "annotations": {"x": "y"}}, s, "team-a")
    assert meta["labels"] == {"a": "b", q.L_QUEUE: "team-a", q.L_POD_GROUP: "j1"}
    # chief + 2 workers + 1 PS; the group ends when none of its pods runs
    assert meta["annotations"] == {"x": "y", q.A_POD_GROUP_TOTAL: "4", q.A_RETRIABLE: "false"}
    assert q.with_pod_group({"labels": {"a": "b"}}, s, None) == {"labels": {"a": "b"}}
    assert q.pod_count(spec(strategy="allreduce", workers=3, ps=0)) == 3


def test_refusal_names_the_numbers_and_a_fitting_job_passes():
    objs = q.cluster_objects(cfg())
    cqs = [o for o in objs if o["kind"] == "ClusterQueue"]
    caps = ql.capacities(cqs, "team-b")
    gpu_a100 = next(c for c in caps if c.flavor == "a100")
    assert (gpu_a100.nominal, gpu_a100.borrowable) == (4, 0)  # nobody else has a100 quota to lend
    gpu_h100 = next(c for c in caps if c.flavor == "h100")
    assert (gpu_h100.nominal, gpu_h100.borrowable) == (0, 2)  # team-a's 8, but its limit is 2

    s = spec(gpus_per_worker=4, workers=2, ps=1, cpu=1.5)
    demand = ql.job_demand([mf.root_job(s, None), *mf.job_objects(s, token="t")])
    assert demand == {"nvidia.com/gpu": 8.0, "cpu": 6.0}  # 2 workers x 4 GPUs; 4 pods x 1.5 cores
    why = ql.refusal(demand, caps, gpu_flavor="a100")
    assert why is not None and "8 nvidia.com/gpu of a100" in why and "never hold more than 4" in why
    assert "its quota 4" in why
    assert ql.refusal({"nvidia.com/gpu": 4.0}, caps, gpu_flavor="a100") is None
    # team-a lends h100: 2 of its 8 may go to team-b, no more
    assert ql.refusal({"nvidia.com/gpu": 2.0}, caps, gpu_flavor="h100") is None
    assert "never hold more than 2" in ql.refusal({"nvidia.com/gpu": 3.0}, caps, gpu_flavor="h100")
    # cpu and memory against the default flavor
    caps_a = ql.capacities(cqs, "team-a")
    why = ql.refusal({"cpu": 40.0}, caps_a)
    assert why is not None and "40 CPUs" in why and "16 CPUs" in why


def test_the_local_queue_carries_its_queues_limits_and_the_job_flavor_comes_from_its_selector():
    """A user may not read ClusterQueues: the LocalQueue's annotation holds the same capacities and the
    flavors' node labels, and the refusal from it reads as the one from the ClusterQueues."""
    c = cfg()
    objs = q.cluster_objects(c)
    cqs = [o for o in objs if o["kind"] == "ClusterQueue"]
    flavors = [o for o in objs if o["kind"] == "ResourceFlavor"]
    (lq,) = q.local_queues(c, "u", ["team-b"])
    caps, got_flavors = q.limits_from_annotation(lq)
    assert caps == ql.capacities(cqs, "team-b")
    a100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert ql.flavor_for(got_flavors, a100) == ql.flavor_for(flavors, a100) == "a100"
    assert ql.flavor_for(flavors, {**a100, "zone": "x"}) == "a100"  # more selector keys still match
    assert ql.flavor_for(flavors, {"nvidia.com/gpu.product": "other"}) is None
    assert ql.flavor_for(flavors, None) is None
    demand = {"nvidia.com/gpu": 8.0}
    assert ql.refusal(demand, caps, gpu_flavor="a100") == ql.refusal(
        demand, ql.capacities(cqs, "team-b"), gpu_flavor="a100"
    )
    # a LocalQueue without the annotation, or with one this version cannot read: no pre-check
    assert q.limits_from_annotation({"metadata": {"name": "x"}, "spec": {}}) is None
    bad = {"metadata": {"name": "x", "annotations": {q.A_LIMITS: "{not json"}}, "spec": {}}
    assert q.limits_from_annotation(bad) is None


def wl(name, ns, queue, created, *, admitted=False, priority=0, finished=False):
    conds = []
    if admitted:
        conds.append({"type": "QuotaReserved", "status": "True"})
    if finished:
        conds.append({"type": "Finished", "status": "True"})
    return {
        "metadata": {"name": name, "namespace": ns, "creationTimestamp": created},
        "spec": {"queueName": queue, "priority": priority},
        "status": {"conditions": conds},
    }


def test_position_from_workloads_in_kueue_order():
    wls = [
        wl("run", "u1", "team", "2026-01-01T00:00:00Z", admitted=True),
        wl("old", "u1", "team", "2026-01-01T00:00:01Z"),
        wl("done", "u1", "team", "2026-01-01T00:00:00Z", finished=True),
        wl("mine", "u2", "team", "2026-01-01T00:00:03Z"),
        wl("urgent", "u3", "team", "2026-01-01T00:00:05Z", priority=10),
        wl("later", "u3", "team", "2026-01-01T00:00:09Z"),
        wl("other", "u3", "elsewhere", "2026-01-01T00:00:00Z"),
    ]
    p = ql.position_from_workloads(wls, "mine", "u2")
    assert (p.position, p.ahead, p.queue, p.source, p.admitted) == (3, 2, "team", "workloads", False)
    assert ql.position_from_workloads(wls, "run", "u1").admitted
    assert ql.position_from_workloads(wls, "mine", "u9") is None


def test_position_from_visibility_answer():
    summary = {
        "items": [
            {
                "metadata": {"name": "a", "namespace": "u1"},
                "positionInClusterQueue": 0,
                "localQueueName": "t",
            },
            {
                "metadata": {"name": "b", "namespace": "u2"},
                "positionInClusterQueue": 1,
                "localQueueName": "t",
            },
        ]
    }
    p = ql.position_from_visibility(summary, "b", "u2")
    assert (p.position, p.ahead, p.queue, p.source) == (2, 1, "t", "visibility")
    assert ql.position_from_visibility(summary, "c", "u2") is None


def test_workload_refusal_reads_kueues_verdict():
    w = {
        "status": {
            "conditions": [
                {
                    "type": "QuotaReserved",
                    "status": "False",
                    "message": "couldn't assign flavors to pod set x: insufficient quota for nvidia.com/gpu "
                    "in flavor a100, previously considered podsets requests (0) + current podset request (8) "
                    "> maximum capacity (4)",
                }
            ]
        }
    }
    assert "maximum capacity (4)" in ql.workload_refusal(w)
    assert ql.workload_refusal({"status": {"conditions": []}}) is None


def test_covers_ignores_defaults_and_compares_quantities_by_value():
    want = {"resourceGroups": [{"flavors": [{"name": "a", "nominalQuota": "32000m"}]}], "cohortName": "p"}
    live = {
        "resourceGroups": [{"flavors": [{"name": "a", "nominalQuota": "32"}]}],
        "cohortName": "p",
        "stopPolicy": "None",
    }
    assert q.covers(want, live)
    assert not q.covers(want, {**live, "cohortName": "other"})
    assert not q.covers(
        want, {**live, "resourceGroups": [{"flavors": [{"name": "a", "nominalQuota": "16"}]}]}
    )
    assert not q.covers({"l": [1, 2]}, {"l": [1]})


class _RecordingApi:
    """kubernetes_asyncio's ApiClient.call_api as queueing_apply uses it: records each request, answers
    from `answers` by path (404 where it has none, as the API server does)."""

    def __init__(self, answers: dict[str, dict]) -> None:
        self.answers, self.calls = answers, []

    async def call_api(self, path, method, query_params=(), **_):
        from kubernetes_asyncio.client.exceptions import ApiException

        self.calls.append((method, path, list(query_params)))
        if path not in self.answers:
            raise ApiException(status=404, reason="Not Found")
        return self.answers[path]


def _pod_workload(uid: str) -> dict:
    return {
        "metadata": {"name": "pod-nb-1", "namespace": "u1", "ownerReferences": [{"uid": uid}]},
        "spec": {"queueName": "team"},
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "message": "no GPUs"}]},
    }


@pytest.mark.parametrize("visibility", [True, False], ids=["visibility", "own-workloads"])
async def test_the_hubs_queue_poll_reads_the_users_namespace_only(visibility):
    """The hub polls every 2 s while a GPU server waits: it finds the pod's Workload by Kueue's job-uid
    label in the user's namespace and its place from the LocalQueue, never a list of every namespace's
    Workloads (whose number other users control)."""
    from tfdist.kube import queueing_apply as qa

    wls = "/apis/kueue.x-k8s.io/v1beta2/namespaces/u1/workloads"
    answers = {wls: {"items": [_pod_workload("p-uid")]}}
    if visibility:
        answers[f"{qa.VISIBILITY}/namespaces/u1/localqueues/team/pendingworkloads"] = {
            "items": [{"metadata": {"name": "pod-nb-1", "namespace": "u1"}, "positionInClusterQueue": 3}]
        }
    api = _RecordingApi(answers)
    wait = await qa.pod_wait(api, "u1", "p-uid")
    assert wait is not None and wait.reason == "no GPUs"
    assert (wait.position.position, wait.position.source) == (
        (4, "visibility") if visibility else (1, "workloads")
    )
    assert api.calls[0] == ("GET", wls, [("labelSelector", "kueue.x-k8s.io/job-uid=p-uid")])
    assert all("/namespaces/u1/" in path for _, path, _ in api.calls), api.calls
    # another pod's Workload under the same label (a label is not proof) is not this pod's
    assert await qa.pod_wait(_RecordingApi({wls: {"items": [_pod_workload("other")]}}), "u1", "p-uid") is None
