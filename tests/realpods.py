"""`runs_in_real_pods(...)`: a pod-runtime test (the pods' entry points as local processes) that a real-node
test repeats in real containers is skipped where the real node runs (TFDIST_REALNODE=1, set by scripts/test
once the node is built): the same code then trains in real pods and the suite does not pay for it twice. On
a machine without the real node (no root), the local version is the coverage and runs."""

from __future__ import annotations

import os

import pytest


def real_node_enabled() -> bool:
    return os.environ.get("TFDIST_REALNODE", "") not in ("", "0")


def runs_in_real_pods(where: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(real_node_enabled(), reason=f"the real node runs this in real pods: {where}")
