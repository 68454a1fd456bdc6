"""A finished job's utilization history, small enough for its state.json.

Why: once the supervisor is gone, the lab panel and `%tfdist status` read only what it left on disk; keeping
every 1 Hz sample of a long job would make that file grow with the job's length, so it keeps at most `keep`
samples spread evenly over the whole run (first and last always kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

STORED_SAMPLES = 120


def downsample(samples: Sequence[dict[str, Any]], keep: int = STORED_SAMPLES) -> list[dict[str, Any]]:
    """At most `keep` of `samples`, evenly spaced, in order, with the first and the last one."""
    n = len(samples)
    if keep <= 0 or n == 0:
        return []
    if n <= keep:
        return list(samples)
    if keep == 1:
        return [samples[-1]]
    picks = sorted({round(i * (n - 1) / (keep - 1)) for i in range(keep)})
    return [samples[i] for i in picks]
