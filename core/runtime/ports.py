"""A local job's ports, and whether a TF server listens: one TCP connect (a server pod asks before its other
imports)."""

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


class PortTaken(Exception):
    """A port of --base-port's range is in use: the sentence says which and what the range is."""


def allocate_ports(n: int, base: int | None) -> list[int]:
    """Free ports on 127.0.0.1 (in this namespace), or base..base+n-1 checked free."""
    if base is not None:
        ports = list(range(base, base + n))
        for p in ports:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    raise PortTaken(
                        f"port {p} is already in use (--base-port {base} needs ports {base}-{base + n - 1})"
                    ) from None
        return ports
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
