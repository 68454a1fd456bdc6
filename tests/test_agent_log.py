"""The coordinator agent's event log stays within its bytes, whatever the job's size (issue: ~840 MiB at
66 tasks when it was bounded by count only)."""

from __future__ import annotations

from tfdist.runtime.joblog import JobLog


def _metrics(tasks: int, t: float) -> dict:
    return {
        "type": "metrics",
        "t": t,
        "tasks": {f"worker-{i}": {"cpu (%)": 1.5, "rss (MiB)": 600.0, "gpus": []} for i in range(tasks)},
    }


def test_the_log_is_bounded_by_bytes_and_readers_skip_ahead() -> None:
    log = JobLog(keep=20000, keep_bytes=1 << 20)
    for i in range(3000):  # 66 tasks: about 4 KiB per event, 12 MiB in all
        log.add(_metrics(66, float(i)))
    assert log.nbytes <= 1 << 20
    first, events = log.read(0, wait=0)
    assert first > 0 and events[-1]["t"] == 2999.0  # the newest kept, the oldest dropped
    assert log.read(first + len(events) - 1, wait=0)[1][0]["t"] == 2999.0


def test_small_events_are_still_bounded_by_count() -> None:
    log = JobLog(keep=10)
    for i in range(25):
        log.add({"type": "progress", "epoch": i})
    first, events = log.read(0, wait=0)
    assert (first, len(events), events[0]["epoch"]) == (15, 10, 15)
