"""All-reduce jobs on Kubernetes as pure manifests (kwok runs no containers): golden dicts."""

from __future__ import annotations

import json

from tfdist.jobspec import JobSpec
from tfdist.kube import allreduce
from tfdist.kube import manifests as mf
from tfdist.kube import names as kn
from tfdist.kube import podtemplate as pt

SPEC = JobSpec(
    name="ar",
    user="ann",
    workers=3,
    ps=0,
    strategy="allreduce",
    gpus_per_worker=1,
    namespace="ns",
    image="img:1",
)
NODE = {"gpu": "a100"}
TOL = [{"key": "gpu", "operator": "Exists"}]
CLUSTER = {
    "chief": ["ar-chief-0.ar.ns.svc:2222"],
    "worker": ["ar-worker-0.ar.ns.svc:2222", "ar-worker-1.ar.ns.svc:2222"],
}
ENV = [
    {"name": "TFDIST_STRATEGY", "value": "allreduce"},
    {"name": "GRPC_FAIL_FAST", "value": "use_caller"},
    {"name": "TF_USE_LEGACY_KERAS", "value": "1"},
    {"name": "PYTHONUNBUFFERED", "value": "1"},
    {"name": "TFDIST_CLUSTER", "value": json.dumps(CLUSTER, sort_keys=True)},
    {"name": "TFDIST_AGENT_URL", "value": "http://ar-chief-0.ar.ns.svc:8470"},
    {"name": "TFDIST_TOKEN", "valueFrom": {"secretKeyRef": {"key": "token", "name": "ar-token"}}},
]
SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
LABELS = {
    "app.kubernetes.io/managed-by": "jupyter-tfdist",
    "app.kubernetes.io/name": "tfdist-job",
    "tfdist.io/job": "ar",
    "tfdist.io/role": "worker",
    "tfdist.io/user": kn.user_label("ann"),
}


def test_worker_job_golden():
    job = allreduce.worker_job(SPEC, {"kind": "Job", "uid": "r"}, node_selector=NODE, tolerations=TOL)
    assert job["metadata"]["name"] == "ar-worker"
    assert job["spec"] == {
        "backoffLimit": 0,  # MWMS cannot take one replica back: a failed worker ends the job
        "completionMode": "Indexed",
        "completions": 2,  # replicas 1 and 2; chief-0 is replica 0
        "parallelism": 2,
        "podReplacementPolicy": "TerminatingOrFailed",  # as every Job of ours: no two pods of one index
        "ttlSecondsAfterFinished": mf.FINISHED_TTL_S,
        "template": {
            "metadata": {"labels": LABELS},
            "spec": {
                "automountServiceAccountToken": False,
                "containers": [
                    {
                        "command": ["python", "-m", "tfdist.runtime.podmain", "allreduce-worker"],
                        "env": ENV,
                        "image": "img:1",
                        "name": "tensorflow",
                        "ports": [{"containerPort": 2222, "name": "tf"}],
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        "securityContext": SECURITY,
                    }
                ],
                "enableServiceLinks": False,
                "nodeSelector": NODE,
                "tolerations": TOL,
                "restartPolicy": "Never",
                "subdomain": "ar",
                "terminationGracePeriodSeconds": pt.TERMINATION_GRACE_S,
            },
        },
    }


def test_root_is_replica_zero_with_gpus_and_the_agent():
    root = allreduce.root_job(SPEC, kn.owner_reference("nb", "u1"), node_selector=NODE, tolerations=TOL)
    assert root["metadata"]["labels"][kn.L_ROOT] == "true"
    assert json.loads(root["metadata"]["annotations"][kn.A_SPEC])["strategy"] == "allreduce"
    pod = root["spec"]["template"]["spec"]
    assert pod["hostname"] == "ar-chief-0" and pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == NODE and pod["tolerations"] == TOL
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "tfdist.runtime.podmain", "allreduce-chief"]
    assert c["env"] == [*ENV, {"name": "TFDIST_AGENT_PORT", "value": str(kn.AGENT_PORT)}]  # the agent's
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert {"containerPort": 8470, "name": "agent"} in c["ports"]


def test_objects_have_no_ps_and_one_worker_has_no_worker_job():
    kinds = [(o["kind"], o["metadata"]["name"]) for o in allreduce.job_objects(SPEC, token="t")]
    assert kinds == [("Job", "ar-worker"), ("Secret", "ar-token"), ("Service", "ar"), ("NetworkPolicy", "ar")]
    one = JobSpec(name="ar", user="ann", workers=1, ps=0, strategy="allreduce", namespace="ns", image="i")
    assert [o["kind"] for o in allreduce.job_objects(one, token="t")] == [
        "Secret",
        "Service",
        "NetworkPolicy",
    ]
    assert json.loads(
        next(
            e["value"]
            for e in allreduce.root_job(one, None)["spec"]["template"]["spec"]["containers"][0]["env"]
            if e["name"] == "TFDIST_CLUSTER"
        )
    ) == {"chief": ["ar-chief-0.ar.ns.svc:2222"]}


def test_policy_lets_the_replicas_reach_each_other_and_the_agent_and_nobody_else():
    """Every replica's pod matches the job's policy selector: they reach each other's TF port and chief-0's
    agent (the workers fetch the cell there); the owner's notebook reaches only the agent."""
    nb = kn.notebook_pod_labels("ann")
    (pol,) = [
        o for o in allreduce.job_objects(SPEC, token="t", notebook_labels=nb) if o["kind"] == "NetworkPolicy"
    ]
    same_job = {"podSelector": {"matchLabels": kn.selector(SPEC)}}
    assert pol["spec"]["podSelector"] == same_job["podSelector"] and pol["spec"]["policyTypes"] == ["Ingress"]
    by_port = {r["ports"][0]["port"]: r["from"] for r in pol["spec"]["ingress"]}
    assert by_port == {
        kn.TF_PORT: [same_job],
        kn.AGENT_PORT: [same_job, {"podSelector": {"matchLabels": nb}}],
    }
    worker = allreduce.worker_job(SPEC, None)
    for template in (allreduce.root_job(SPEC, None)["spec"]["template"], worker["spec"]["template"]):
        labels = template["metadata"]["labels"]
        assert kn.selector(SPEC).items() <= labels.items(), labels
        assert not nb.items() <= labels.items()  # a replica is no notebook
