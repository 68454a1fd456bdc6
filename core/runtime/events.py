"""The wire format between job parts: one JSON object per line (sockets, pipes and pod logs all carry
lines). The codec lives with the event records in `tfdist.job.events`; this path stays because job images
of any version run it. `is_noise` is the live log tails' filter."""

from __future__ import annotations

import re

from ..job.events import clean_number, dumps, loads

__all__ = ["clean_number", "dumps", "is_noise", "loads"]

# TensorFlow start-up chatter that says nothing about the job; kept in the log files, not in live tails.
_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog|[IWE]0000 00:00:\S+ +\d+ "
    r"(port\.cc|cudart_stub\.cc|cuda_platform\.cc|cuda_executor\.cc|cpu_feature_guard\.cc))"
)


def is_noise(line: str) -> bool:
    return bool(_NOISE.match(line))
