"""The wire format between job parts: one JSON object per line. Tiny on purpose: sockets, pipes and
pod logs all carry lines."""

from __future__ import annotations

import json
import math
import re
from typing import Any


def dumps(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, default=_default, allow_nan=False, separators=(",", ":")) + "\n").encode()


def loads(line: bytes | str) -> dict[str, Any]:
    return json.loads(line)


def clean_number(x: Any) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy scalars
        return clean_number(obj.item())
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


# TensorFlow start-up chatter that says nothing about the job; kept in the log files, not in live tails.
_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog|[IWE]0000 00:00:\S+ +\d+ "
    r"(port\.cc|cudart_stub\.cc|cuda_platform\.cc|cuda_executor\.cc|cpu_feature_guard\.cc))"
)


def is_noise(line: str) -> bool:
    return bool(_NOISE.match(line))
