"""Chromium in a network namespace of its own, with only the loopback ports a test names relayed to the
host's: Chromium watches the host's interfaces and addresses over netlink and aborts every request in
flight on any change (net::ERR_NETWORK_CHANGED). On this machine the real node's pods and Services change
them all the time (a veth per pod, an address per Service), so a browser test beside the real-node tests
lost its kernel's websocket handshake mid-test (CI on 6022d26). Inside its own namespace Chromium sees
only that namespace's loopback, which never changes; the pages it loads are the same.

Root only (a named namespace and setns); elsewhere `chromium()` is plain Chromium and nothing is relayed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
CHROMIUM = "/usr/bin/chromium"


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class QuietNetwork:
    """A named network namespace with its loopback up, a Chromium that runs in it (`executable`), and
    relays from its 127.0.0.1:port to the host's 127.0.0.1:port (`relay`)."""

    def __init__(self) -> None:
        self.name = f"tfdist-browser-{uuid.uuid4().hex[:8]}"
        ip = shutil.which("ip") or "/usr/sbin/ip"
        subprocess.run([ip, "netns", "add", self.name], check=True, capture_output=True)
        subprocess.run([ip, "-n", self.name, "link", "set", "lo", "up"], check=True, capture_output=True)
        self._ip = ip
        self._dir = Path(tempfile.mkdtemp(prefix="tfdist-browser-"))
        self.executable = str(self._dir / "chromium")
        Path(self.executable).write_text(f'#!/bin/sh\nexec {ip} netns exec {self.name} {CHROMIUM} "$@"\n')
        os.chmod(self.executable, 0o755)
        self._listeners: list[socket.socket] = []

    def relay(self, port: int) -> None:
        """127.0.0.1:port inside the namespace reaches 127.0.0.1:port of the host."""
        host = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        inside = os.open(NETNS_DIR / self.name, os.O_RDONLY)
        made: list[socket.socket] = []

        def listen() -> None:  # a thread of its own: setns moves only the calling thread
            _setns(inside)
            try:
                made.append(socket.create_server(("127.0.0.1", port)))
            finally:
                _setns(host)

        t = threading.Thread(target=listen)
        t.start()
        t.join()
        os.close(host)
        os.close(inside)
        if not made:
            raise RuntimeError(f"could not listen on 127.0.0.1:{port} in {self.name}")
        server = made[0]
        self._listeners.append(server)
        threading.Thread(target=self._accept, args=(server, port), daemon=True).start()

    def _accept(self, server: socket.socket, port: int) -> None:
        while True:
            try:
                inner, _ = server.accept()
            except OSError:  # closed
                return
            try:
                outer = socket.create_connection(("127.0.0.1", port), timeout=10)
                outer.settimeout(None)
            except OSError:
                inner.close()
                continue
            for a, b in ((inner, outer), (outer, inner)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        for s in self._listeners:
            with contextlib.suppress(OSError):
                s.close()
        subprocess.run([self._ip, "netns", "del", self.name], capture_output=True)
        shutil.rmtree(self._dir, ignore_errors=True)


def loopback_port(url: str) -> int:
    """The port of a loopback URL (the hubs and servers the browser tests start); others cannot be relayed."""
    parts = urlsplit(url)
    if parts.hostname != "127.0.0.1" or parts.port is None:
        raise ValueError(f"{url}: only 127.0.0.1 with a port is relayed into the browser's namespace")
    return parts.port


@contextlib.contextmanager
def quiet_chromium(*urls: str) -> Iterator[str]:
    """The Chromium executable for playwright's `launch(executable_path=...)`: in a namespace of its own,
    the ports of ``urls`` (loopback) relayed, where this runs as root; else plain Chromium."""
    ports = [loopback_port(u) for u in urls]
    if os.geteuid() != 0:
        yield CHROMIUM
        return
    net = QuietNetwork()
    try:
        for port in ports:
            net.relay(port)
        yield net.executable
    finally:
        net.close()
