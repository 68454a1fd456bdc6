"""A KubeApi double for the lifeline (read_job / replace_job only) whose updates fail with the HTTP statuses
given, in order, then succeed; raising kubernetes_asyncio's own ApiException as the real client does."""

from __future__ import annotations

import copy
import time
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException


class FlakyJobs:
    def __init__(self, fail: list[int]) -> None:
        self.fail = list(fail)
        self.puts: list[tuple[float, int]] = []  # (monotonic time, status answered)
        self.jobs: list[dict[str, Any]] = []  # what each successful update wrote

    async def read_job(self, name: str, ns: str) -> dict[str, Any] | None:
        return self.jobs[-1] if self.jobs else None

    async def replace_job(self, job: dict[str, Any], keep: tuple[str, ...]) -> dict[str, Any]:
        if self.fail:
            status = self.fail.pop(0)
            self.puts.append((time.monotonic(), status))
            raise ApiException(status=status, reason="refused by the test")
        self.puts.append((time.monotonic(), 200))
        self.jobs.append(copy.deepcopy(job))
        return copy.deepcopy(job)
