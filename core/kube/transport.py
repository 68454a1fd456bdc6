"""The kernel's side of the channel to a job's coordinator agent: find the root Job's own pod, then hand it
the payload once (signed both ways: tfdist.kube.signing, tfdist.kube.agent_client)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..errors import BackendUnavailable
from . import names as kn
from .agent_client import AgentClient
from .cluster import KubeApi, controller_uid
from .podwatch import pod_stream

AGENT_GRACE_S = 30.0  # past --timeout, how long the kernel keeps trying to reach a running agent


def _address(pod: dict[str, Any], root_uid: str) -> str | None:
    """The pod's IP if it is the root Job's own pod (by controller UID, never by labels alone)."""
    if controller_uid(pod) == root_uid:
        return (pod.get("status") or {}).get("podIP") or None
    return None


async def chief_ip(kube: KubeApi, ns: str, selector: str, root_uid: str) -> str:
    """The address of the root Job's pod, followed by watch until it has one."""
    from kubernetes_asyncio import watch

    core = await kube.core()
    rv = None
    while True:
        try:
            if rv is None:
                body = await kube.list_pods(ns, selector)
                rv = body["metadata"]["resourceVersion"]
                for pod in body["items"]:
                    if ip := _address(pod, root_uid):
                        return ip
            w = watch.Watch()
            async for item in pod_stream(w, core, ns, selector, rv):
                pod = item["raw_object"]
                rv = pod["metadata"].get("resourceVersion", rv)
                if ip := _address(pod, root_uid):
                    return ip
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if getattr(exc, "status", None) == 410:
                rv = None
            await asyncio.sleep(1)


def client_for(ip: str, token: str) -> AgentClient:
    return AgentClient(f"http://{ip}:{kn.AGENT_PORT}", token)


async def deliver(client: AgentClient, payload: bytes, created: float, timeout_s: float) -> None:
    """Upload the payload once the agent answers (the client retries transient failures; a retried upload of
    the same bytes is accepted); past --timeout and a grace, say why the agent was never reached."""
    while not await client.reachable():
        if time.time() > created + timeout_s + AGENT_GRACE_S:
            raise BackendUnavailable(
                f"the notebook cannot reach the coordinator's agent at {client.base_url} within --timeout "
                f"{timeout_s:g}s + {AGENT_GRACE_S:g}s (NetworkPolicy or CNI?)"
            )
        await asyncio.sleep(0.5)  # a probe of an agent on the pod network: cheap, and the fit waits on it
    await client.upload(payload)
