"""The queued job's wait estimate: from its own line's pace, none before the line moves."""

from __future__ import annotations

import pytest

from tfdist.job.events import QueueEvent
from tfdist.kube.queuepace import QueuePace


def test_no_estimate_until_the_line_moves() -> None:
    p = QueuePace()
    p.see(0.0, 3)
    p.see(60.0, 3)
    assert p.wait_s(60.0) is None  # standing still says nothing about the pace


def test_places_ahead_times_the_time_per_step() -> None:
    p = QueuePace()
    p.see(0.0, 4)
    p.see(600.0, 3)  # one step in 10 min
    assert p.wait_s(600.0) == pytest.approx(3 * 600.0)
    assert p.wait_s(900.0) == pytest.approx(3 * 600.0 - 300.0)  # time since the step counts down
    p.see(1200.0, 1)  # two more steps: 3 steps in 20 min
    assert p.wait_s(1200.0) == pytest.approx(400.0)


def test_an_overdue_step_still_gives_one_steps_time_and_a_longer_line_no_faster_pace() -> None:
    p = QueuePace()
    p.see(0.0, 2)
    p.see(100.0, 1)
    assert p.wait_s(10_000.0) == pytest.approx(100.0)  # late: about one step, never zero or negative
    p.see(150.0, 2)  # a higher priority came in ahead
    assert p.steps == 1 and p.wait_s(150.0) == pytest.approx(2 * 100.0 - 50.0)


def test_the_estimate_reads_as_the_cell_says_it() -> None:
    p = QueuePace()
    p.see(0.0, 3)
    p.see(420.0, 2)
    ev = QueueEvent(position=2, queue="team-a", wait_s=p.wait_s(420.0))
    assert ev.info().sentence() == "queued: 2nd in team-a, about 14 min"


def test_a_place_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="starts at 1"):
        QueuePace().see(0.0, 0)


def test_a_place_counted_another_way_starts_the_pace_again() -> None:
    """Where Kueue's visibility API stops answering, the place is counted among the user's own jobs only
    (QueueInfo.scope): 5th in the queue, then 1st of one's own, is no four admissions in 2 s."""
    p = QueuePace()
    p.see_counted(0.0, 6, "visibility")
    p.see_counted(600.0, 5, "visibility")  # one step in 10 min
    assert p.wait_s(600.0) == pytest.approx(5 * 600.0)
    p.see_counted(602.0, 1, "workloads")  # the count changed, not the line
    assert p.wait_s(602.0) is None  # no pace of this count yet
    p.see_counted(902.0, 1, "workloads")
    assert p.wait_s(902.0) is None
    p.see_counted(1202.0, 1, "visibility")  # back: its old pace is not this wait's either
    p.see_counted(1502.0, 4, "visibility")  # further back: longer, not slower
    assert p.wait_s(1502.0) is None
