"""How long a queued job will still wait, from how fast its own line has moved.

A user may read only their own namespace and Kueue's visibility answer for their LocalQueue: neither says
how long the workloads ahead will run (their Jobs, and the history of finished ones, are other users' or
already gone). What a waiting job can observe is its place in line over time: each step forward is one
workload ahead admitted or withdrawn. The estimate is the places still ahead times the mean time per step
so far, given only after the line has moved (a line that has not moved yet gives no number, never a
guess), and never shorter than the time since the last step would already make it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: steps forward needed before an estimate is given (one step is a fair first guess on a slow line)
MIN_STEPS = 1


@dataclass
class QueuePace:
    """The places a waiting job was seen at, in time order; fed by the queue watch (one per tick)."""

    first_t: float | None = None
    first_position: int | None = None
    last_step_t: float | None = None
    last_position: int | None = None
    steps: int = 0
    #: what the places count (`see_counted`); "" for a caller that never says
    counted: str = ""

    def see(self, t: float, position: int) -> None:
        """One observation: at time ``t`` (seconds) the job was ``position`` in line (1 is next)."""
        if position < 1:
            raise ValueError(f"a place in line starts at 1, not {position}")
        if self.first_t is None:
            self.first_t, self.first_position = t, position
            self.last_step_t, self.last_position = t, position
            return
        assert self.last_position is not None
        if position < self.last_position:
            self.steps += self.last_position - position
            self.last_step_t = t
        # a place further back (a higher priority came in ahead) makes the line longer, not slower
        self.last_position = position

    def see_counted(self, t: float, position: int, counted: str) -> None:
        """`see`, where `counted` says what the place counts (the queue's whole line, or only the user's
        own jobs: tfdist.job.events.QueueInfo.scope). Places of another count are not steps of this one
        (from 5th of the queue to 1st of one's own is no four admissions): the pace starts again."""
        if counted != self.counted:
            self.first_t = self.last_step_t = None
            self.first_position = self.last_position = None
            self.steps, self.counted = 0, counted
        self.see(t, position)

    def wait_s(self, now: float) -> float | None:
        """Seconds until admission at the pace seen so far, or None before the line has moved."""
        if self.steps < MIN_STEPS or self.first_t is None or self.last_step_t is None:
            return None
        assert self.last_position is not None
        per_step = (self.last_step_t - self.first_t) / self.steps
        remaining = self.last_position * per_step - (now - self.last_step_t)
        # overdue (the next step is late): at least one step's time, never zero or negative
        return max(remaining, per_step)
