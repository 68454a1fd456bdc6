"""The stall watchdog's rules (tfdist.kernel_magics.stall), on views as the coordinator's events make them."""

from __future__ import annotations

from tfdist.jobview import JobView
from tfdist.kernel_magics.stall import StallWatch


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_stuck_once_then_moving_again_and_never_while_the_results_are_written_back():
    clock = Clock()
    w = StallWatch(4, clock=clock)
    view = JobView(name="j", state="running", phase="fit", epoch=0, step=3)
    assert w.check(view) is None
    clock.t = 3.9
    assert w.check(view) is None  # under the limit
    clock.t = 4.5
    said = w.check(view)
    assert said and said.startswith(
        "tfdist: job j looks stuck: no training progress for 4 s (at fit, epoch 0"
    )
    clock.t = 30
    assert w.check(view) is None  # said once, not every check
    view.step = 4
    assert w.check(view) == "tfdist: job j is making progress again"
    # the cell's code ended: writing the results back takes long under load, but nothing trains any more
    view.phase = "returning"
    assert w.check(view) is None
    clock.t = 300
    assert w.check(view) is None
    # a job that is not running (starting: --timeout's business; ended) is never called stuck
    for state in ("starting", "succeeded", "failed"):
        other = StallWatch(4, clock=clock)
        v = JobView(name="k", state=state, phase="fit")
        other.check(v)
        clock.t += 100
        assert other.check(v) is None
