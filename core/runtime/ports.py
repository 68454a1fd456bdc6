"""Whether a TF server listens: one TCP connect (a server pod asks before its other imports)."""

from __future__ import annotations

import socket


def answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Does a TF server listen at host:port (DNS resolves and a TCP connect succeeds)?"""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
