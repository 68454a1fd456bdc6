"""The lifeline's renewals (tfdist.kube.lifeline.keep) against an API server that fails: a failed renewal is
tried again within seconds, not a whole renewal period later (with the default 60 s grace and 20 s period,
two failures used to leave 42 s between attempts), and a Job that is gone ends the loop.

The API server is a double here (tests/doubles/flaky_jobs.py): a real one cannot be made to refuse a given
request; it raises what kubernetes_asyncio raises (ApiException with the HTTP status)."""

from __future__ import annotations

import asyncio
import time

from tests.doubles.flaky_jobs import FlakyJobs
from tfdist.kube import lifeline

GRACE_S, RENEW_S = 6.0, 1.0


def root() -> dict:
    return {
        "metadata": {"name": "digits", "namespace": "u"},
        "spec": {"suspend": False},
        "status": {"startTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 30))},
    }


def run_until(kube: FlakyJobs, stop_after_puts: int, retry_s: float) -> None:
    async def go() -> None:
        task = asyncio.create_task(
            lifeline.keep(kube, root(), lambda: len(kube.puts) >= stop_after_puts, GRACE_S, RENEW_S, retry_s)
        )
        await asyncio.wait_for(task, 10)

    asyncio.run(go())


def test_a_failed_renewal_is_retried_within_the_retry_time_not_a_whole_period_later():
    kube = FlakyJobs(fail=[503, 503])  # two refusals, then the API server answers again
    run_until(kube, stop_after_puts=3, retry_s=0.1)
    t = [at for at, _ in kube.puts]
    assert [code for _, code in kube.puts] == [503, 503, 200]
    assert t[1] - t[0] < 0.5 and t[2] - t[1] < 0.5, t  # 0.1 s, then 0.2 s: not RENEW_S each
    deadline = kube.jobs[-1]["spec"]["activeDeadlineSeconds"]
    assert 30 + GRACE_S <= deadline <= 30 + GRACE_S + 5  # counted from the Job's start: grace from now


def test_renewals_keep_their_period_while_the_server_answers_and_a_gone_job_ends_the_loop():
    kube = FlakyJobs(fail=[])
    run_until(kube, stop_after_puts=2, retry_s=0.1)
    (t0, _), (t1, _) = kube.puts
    assert t1 - t0 >= RENEW_S * 0.9
    gone = FlakyJobs(fail=[404])

    async def go() -> None:
        await asyncio.wait_for(lifeline.keep(gone, root(), lambda: False, GRACE_S, 0.05), 5)

    asyncio.run(go())  # returns: the Job was deleted
    assert [code for _, code in gone.puts] == [404]
