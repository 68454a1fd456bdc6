"""Kubernetes resource quantities ("500m", "4Gi", "8", "1e3") as numbers: one parser for the spawner's GPU
view and the backend's quota messages."""

from __future__ import annotations

import re
from typing import Any

_QTY = re.compile(r"([+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)([numkMGTPE]|[KMGTPE]i)?")
_FACTOR: dict[str | None, float] = {
    None: 1,
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def parse_quantity(q: Any) -> float:
    """A quantity as the API server writes it (a string, or a JSON number); ValueError for anything else."""
    if isinstance(q, bool):
        raise ValueError(f"not a quantity: {q!r}")
    if isinstance(q, (int, float)):
        return float(q)
    m = _QTY.fullmatch(str(q).strip())
    if not m:
        raise ValueError(f"not a quantity: {q!r}")
    return float(m.group(1)) * _FACTOR[m.group(2)]
