"""Every pod of a job runs as its notebook (tfdist.podidentity), as plain dicts. Pure: no API calls."""

from __future__ import annotations

from typing import Any

from ..podidentity import PodIdentity

__all__ = ["with_identity"]


def with_identity(obj: dict[str, Any], identity: PodIdentity) -> dict[str, Any]:
    """`obj` with its pod template running as `identity` (a Job; other kinds unchanged). Both strategies'
    Jobs go through it; the admission policy refuses a job pod with any other user or groups."""
    if obj.get("kind") != "Job":
        return obj
    pod = obj["spec"]["template"]["spec"]
    pod["securityContext"] = {**pod.get("securityContext", {}), **identity.security_context()}
    return obj
