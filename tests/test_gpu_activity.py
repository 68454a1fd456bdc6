"""A server's GPU idle time counts its running jobs' GPUs (on Kubernetes a job's GPUs are in its own pods),
and only samples at or above the admin's threshold make a server busy."""

from __future__ import annotations

from tfdist.labserver.activity import GpuActivity

T0 = 1_000_000.0


def tracked(idle_for: float) -> GpuActivity:
    """A tracker whose server GPU has been at 0 % since T0 - idle_for (no NVML: samples set directly)."""
    a = GpuActivity(interval_s=10)
    a.since = T0 - idle_for
    for k in range(int(idle_for // 10)):
        a.samples.append((T0 - idle_for + 10 * k, [0.0], [100.0]))
    return a


def test_a_busy_job_makes_an_idle_server_busy():
    a = tracked(3600)
    assert a.idle_s(5, now=T0) == 3600
    a.note_jobs([2.0, 80.0], now=T0 - 30)  # one of the job's GPUs busy 30 s ago
    assert a.idle_s(5, now=T0) == 30


def test_a_job_below_the_threshold_or_without_gpus_changes_nothing():
    a = tracked(3600)
    a.note_jobs([3.0, 4.9], now=T0 - 30)
    a.note_jobs([], now=T0 - 10)
    assert a.idle_s(5, now=T0) == 3600
    assert a.idle_s(3, now=T0) == 30  # a lower threshold: that sample was busy


def test_the_servers_own_busy_gpu_and_a_job_sample_the_later_one_wins():
    a = tracked(600)
    a.samples.append((T0 - 100, [90.0], [100.0]))
    a.note_jobs([50.0], now=T0 - 300)
    assert a.idle_s(10, now=T0) == 100
    a.note_jobs([50.0], now=T0 - 5)
    assert a.idle_s(10, now=T0) == 5
