"""The checks a Kubernetes submit runs together before it creates anything (`first_refusal`): where
several refuse, the first in order speaks, whatever answered first. CI once failed on a job that both its
queue and its namespace quota refuse: the quota's answer came back first and the cell named it instead."""

from __future__ import annotations

import asyncio
import time

import pytest

from tfdist.backends.kubesubmit import first_refusal


class Refused(Exception):
    pass


async def check(delay: float, refusal: str | None = None, ran: list[str] | None = None) -> None:
    await asyncio.sleep(delay)
    if ran is not None:
        ran.append(refusal or "ok")
    if refusal is not None:
        raise Refused(refusal)


async def test_the_first_refusal_in_order_is_raised_even_when_a_later_one_answers_first() -> None:
    for _ in range(5):
        with pytest.raises(Refused, match="queue"):
            await first_refusal(check(0.02), check(0.05, "queue"), check(0.0, "quota"))


async def test_a_refusal_does_not_wait_for_the_checks_after_it() -> None:
    """The queue's refusal comes at once, not after the quota waited for ending jobs to let go."""
    ran: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(Refused, match="queue"):
        await first_refusal(check(0.0), check(0.01, "queue"), check(30.0, "quota", ran))
    assert time.monotonic() - t0 < 5 and ran == []  # the waiting check was cancelled


async def test_every_check_passing_raises_nothing() -> None:
    ran: list[str] = []
    await first_refusal(check(0.02, ran=ran), check(0.0, ran=ran), check(0.01, ran=ran))
    assert ran == ["ok", "ok", "ok"]
