"""The lifeline of an attached Kubernetes job: while the kernel lives it keeps the root Job's
`activeDeadlineSeconds` a grace period ahead of now; a kernel that is gone (SIGKILL, node lost) stops
renewing, the deadline passes, and the Job controller ends the job (the TTL and the garbage collector free
the rest). The cluster, not the kernel, does the clean-up: nothing depends on the kernel's last words."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .cluster import KubeApi

LIFELINE_RENEW_S = 20.0  # the grace is tfdist.settings' lifeline_grace_s (TFDIST_LIFELINE_GRACE_S)


def renew_every(grace_s: float) -> float:
    """A third of the grace (at most LIFELINE_RENEW_S): two renewals can fail before the deadline passes."""
    return min(LIFELINE_RENEW_S, grace_s / 3)


def deadline_for(started: float, now: float, grace_s: float) -> int:
    """The root's activeDeadlineSeconds (counted from its start) that ends the job grace_s from now."""
    return math.ceil(now - started + grace_s)


async def keep(
    kube: KubeApi, root: dict[str, Any], done: Callable[[], bool], grace_s: float, renew_s: float
) -> None:
    """Renew until `done()` or the root is gone; one update (PUT) per renew_s."""
    name, ns = root["metadata"]["name"], root["metadata"]["namespace"]
    while not done():
        await asyncio.sleep(renew_s)
        if done():
            return
        try:
            if not (root.get("status") or {}).get("startTime"):
                root = await kube.read_job(name, ns) or root
            start = (root.get("status") or {}).get("startTime")
            if not start:
                continue
            started = datetime.fromisoformat(str(start).replace("Z", "+00:00")).timestamp()
            root["spec"]["activeDeadlineSeconds"] = deadline_for(started, time.time(), grace_s)
            root = await kube.replace_job(root, keep=("suspend", "activeDeadlineSeconds"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return  # the job is gone
            await asyncio.sleep(1)  # API server away: try again; the grace covers a few misses
