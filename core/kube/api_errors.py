"""The API server's refusals as one sentence a user can act on: quota, the admin's admission policy, Pod
Security, RBAC, a name taken, a malformed object."""

from __future__ import annotations

import json

from ..errors import BackendUnavailable, JobSpecError, TfdistError
from ..quantity import parse_quantity


def quantity(text: str) -> float:
    """A Kubernetes quantity ("500m", "4Gi", "8") as a number."""
    return parse_quantity(text)


def quota_sentence(message: str) -> str:
    """The API server's "exceeded quota: q, requested: r=8, used: r=4, limited: r=8" as one sentence."""
    parts = {}
    for p in message.split("exceeded quota:", 1)[-1].split(", ")[1:]:
        key, _, value = p.partition(":")
        parts[key.strip()] = value.strip()

    def first(key: str) -> tuple[str, str]:
        res, _, amount = parts.get(key, "").split(",")[0].partition("=")
        return res, amount

    res, asked = first("requested")
    _, used = first("used")
    _, limit = first("limited")
    what = res.removeprefix("requests.").removeprefix("limits.") or "resources"
    return (
        f"the job would exceed your quota of {what}: it asks for {asked or '?'} more, {used or '?'} of "
        f"{limit or '?'} are in use (your notebook servers count too); ask for less or stop another job"
    )


def translate(exc: Exception, kind: str, name: str, namespace: str) -> TfdistError:
    from kubernetes_asyncio.client.exceptions import ApiException

    if not isinstance(exc, ApiException):
        return BackendUnavailable(f"cannot reach the Kubernetes API: {exc}")
    try:
        message = json.loads(exc.body or "{}").get("message") or exc.reason
    except ValueError:
        message = exc.reason
    if exc.status == 403 and "exceeded quota" in message:
        return JobSpecError(quota_sentence(message))
    if exc.status in (403, 422) and "denied request:" in message:  # the admin's admission policy
        return JobSpecError(
            f"the cluster refused the job ({kind} {name!r}): {message.split('denied request:', 1)[1].strip()}"
        )
    if exc.status == 403 and "violates PodSecurity" in message:
        return JobSpecError(f"the cluster refused {kind} {name!r}: {message}")
    if exc.status == 403:
        return BackendUnavailable(
            f"not allowed to create {kind} {name!r} in namespace {namespace!r}: {message}. The notebook's "
            "service account needs the tfdist Role in that namespace (hub_config/rbac-notebook.yaml, or "
            "user namespaces prepared by the spawner)"
        )
    if exc.status == 404:
        return JobSpecError(f"namespace {namespace!r} does not exist ({message})")
    if exc.status == 409:
        return JobSpecError(
            f"a job named {name!r} already exists in namespace {namespace!r}: pick another --name"
        )
    if exc.status == 422:
        return JobSpecError(f"the API server refused {kind} {name!r}: {message}")
    return BackendUnavailable(f"the API server refused {kind} {name!r} ({exc.status}): {message}")
