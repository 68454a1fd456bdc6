"""Whether a TF server listens: one TCP connect (a server pod asks before its other imports)."""

from __future__ import annotations

import socket
import time


def answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Does a TF server listen at host:port (DNS resolves and a TCP connect succeeds)?"""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_all(addresses: list[str], timeout: float, every: float = 0.02) -> list[str]:
    """Until every "host:port" answers or `timeout` s passed; those that did not answer. A coordinator
    connecting to a server that is not listening yet waits out gRPC's reconnect backoff (a second and
    more); asked this way, it connects the moment the last one listens."""
    left = list(addresses)
    deadline = time.monotonic() + timeout
    while left:
        left = [a for a in left if not answers(*_split(a), timeout=min(1.0, every * 10))]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(every)
    return left


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
