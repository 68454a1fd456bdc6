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
    kube: KubeApi,
    root: dict[str, Any],
    done: Callable[[], bool],
    grace_s: float,
    renew_s: float,
    retry_s: float = 1.0,
) -> None:
    """Renew until `done()` or the root is gone; one update (PUT) per renew_s. A failed renewal (the API
    server away or overloaded) is tried again after retry_s, doubling up to renew_s, not a whole renew_s
    later: at most renew_s passes without a renewal attempt, so the grace's misses are really misses."""
    name, ns = root["metadata"]["name"], root["metadata"]["namespace"]
    wait, failures = renew_s, 0
    while not done():
        await asyncio.sleep(wait)
        if done():
            return
        try:
            if not (root.get("status") or {}).get("startTime"):
                root = await kube.read_job(name, ns) or root
            start = (root.get("status") or {}).get("startTime")
            if not start:
                wait = renew_s
                continue
            started = datetime.fromisoformat(str(start).replace("Z", "+00:00")).timestamp()
            root["spec"]["activeDeadlineSeconds"] = deadline_for(started, time.time(), grace_s)
            root = await kube.replace_job(root, keep=("suspend", "activeDeadlineSeconds"))
            wait, failures = renew_s, 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return  # the job is gone
            failures += 1
            wait = min(renew_s, retry_s * 2 ** (failures - 1))
