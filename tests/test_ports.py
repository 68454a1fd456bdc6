"""A PS coordinator waits for its servers' ports before it connects (runtime.ports.wait_all): it connects
the moment the last one listens, not after gRPC's reconnect backoff, and never waits past its bound."""

from __future__ import annotations

import socket
import threading
import time

from tests.kube_plane import free_port
from tfdist.runtime.ports import wait_all


def test_returns_once_a_late_server_listens():
    port = free_port()
    late = socket.socket()
    late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.5)
        late.bind(("127.0.0.1", port))
        late.listen()

    threading.Thread(target=listen_later).start()
    with socket.socket() as early:
        early.bind(("127.0.0.1", 0))
        early.listen()
        t0 = time.monotonic()
        left = wait_all([f"127.0.0.1:{early.getsockname()[1]}", f"127.0.0.1:{port}"], timeout=10)
        took = time.monotonic() - t0
    late.close()
    assert left == []
    assert 0.45 < took < 3, took  # waited for the late one, not the 10 s bound (2 loaded cores)


def test_gives_up_at_its_bound_and_names_what_never_answered():
    port = free_port()
    t0 = time.monotonic()
    assert wait_all([f"127.0.0.1:{port}"], timeout=0.4) == [f"127.0.0.1:{port}"]
    assert time.monotonic() - t0 < 1.5
