"""A private asyncio loop on a daemon thread: how synchronous code (magics) calls the async backends.

Like kr8s's Portal: the kernel's own event loop is never used or blocked from inside a cell.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Portal:
    _instance: Portal | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tfdist-portal", daemon=True)
        self._thread.start()

    @classmethod
    def get(cls) -> Portal:
        with cls._lock:
            if cls._instance is None:
                cls._instance = Portal()
            return cls._instance

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run in the background; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)
