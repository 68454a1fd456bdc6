"""One quantity parser (tfdist.quantity) for the spawner's GPU view and the backend's quota sentences."""

from __future__ import annotations

import pytest

from tfdist.kube.api_errors import quota_sentence
from tfdist.quantity import parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [("8", 8), ("500m", 0.5), ("4Gi", 4 * 2**30), ("1k", 1000), ("2.5M", 2.5e6), ("1e3", 1000), (3, 3.0)],
)
def test_quantities_as_the_api_server_writes_them(text, value):
    assert parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("junk", ["", "lots", "4GB", "1..5", True, None, "Gi"])
def test_junk_is_a_value_error(junk):
    with pytest.raises(ValueError, match="not a quantity"):
        parse_quantity(junk)


def test_a_quota_refusal_reads_as_one_sentence():
    msg = (
        'pods "j-worker-0" is forbidden: exceeded quota: tfdist, requested: requests.nvidia.com/gpu=8, '
        "used: requests.nvidia.com/gpu=4, limited: requests.nvidia.com/gpu=8"
    )
    s = quota_sentence(msg)
    assert s.startswith("the job would exceed your quota of nvidia.com/gpu: it asks for 8 more, 4 of 8")
