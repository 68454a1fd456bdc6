"""A finished job's utilization history in state.json: bounded, evenly spread, first and last kept."""

from __future__ import annotations

import itertools

from tfdist.runtime.history import STORED_SAMPLES, downsample


def test_short_history_is_kept_whole_and_long_one_is_bounded() -> None:
    short = [{"t": i} for i in range(10)]
    assert downsample(short) == short
    long = [{"t": i} for i in range(600)]
    out = downsample(long)
    assert len(out) == STORED_SAMPLES
    ts = [s["t"] for s in out]
    assert ts[0] == 0 and ts[-1] == 599 and ts == sorted(set(ts))
    gaps = [b - a for a, b in itertools.pairwise(ts)]
    assert max(gaps) - min(gaps) <= 1  # evenly spread over the whole run


def test_edge_sizes() -> None:
    assert downsample([]) == []
    assert downsample([{"t": 1}, {"t": 2}], keep=1) == [{"t": 2}]
    assert downsample([{"t": 1}], keep=0) == []
    assert [s["t"] for s in downsample([{"t": i} for i in range(5)], keep=2)] == [0, 4]
