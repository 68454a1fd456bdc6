"""How a job's tasks reach each other and who else may reach them: the headless Service, a returning PS's
own Service, the NetworkPolicy and the agent's token Secret, as plain dicts. Pure: no API calls.

Why apart from the Jobs: these objects are the same for both strategies (tfdist.kube.allreduce uses them
as they are) and say nothing about what runs in the pods.
"""

from __future__ import annotations

from typing import Any

from .. import tf_config
from ..jobspec import JobSpec
from . import names  # AGENT_PORT read at each call: the tests move it
from .names import L_INDEX, L_ROLE, TF_PORT, object_meta, pod_name, selector


def service(spec: JobSpec, owner: dict | None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(spec, spec.name, owner),
        "spec": {
            "clusterIP": "None",
            "selector": selector(spec),
            "publishNotReadyAddresses": True,  # TF must resolve peers before they report ready
            "ports": [{"name": "tf", "port": TF_PORT}, {"name": "agent", "port": names.AGENT_PORT}],
        },
    }


def ps_service(spec: JobSpec, task: str, owner: dict | None) -> dict[str, Any]:
    """The stable address of one PS of a --checkpoint-every job (see `names.task_host`)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(spec, pod_name(spec, task), owner),
        "spec": {
            # Indexed Job pods share one template: the Job controller's index label tells them apart
            "selector": selector(spec) | {L_ROLE: "ps", L_INDEX: str(tf_config.split_task(task)[1])},
            "publishNotReadyAddresses": True,  # routed as soon as the TF server's container runs
            "ports": [{"name": "tf", "port": TF_PORT}],
        },
    }


def secret(spec: JobSpec, owner: dict | None, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(spec, f"{spec.name}-token", owner),
        "type": "Opaque",
        "stringData": {"token": token},
    }


def network_policy(
    spec: JobSpec, owner: dict | None, notebook_labels: dict[str, str] | None
) -> dict[str, Any]:
    same_job = {"podSelector": {"matchLabels": selector(spec)}}
    agent_from = [same_job]
    if notebook_labels:
        agent_from.append({"podSelector": {"matchLabels": notebook_labels}})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(spec, spec.name, owner),
        "spec": {
            "podSelector": {"matchLabels": selector(spec)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [same_job], "ports": [{"protocol": "TCP", "port": TF_PORT}]},
                {"from": agent_from, "ports": [{"protocol": "TCP", "port": names.AGENT_PORT}]},
            ],
        },
    }
