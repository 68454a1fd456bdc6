"""Running a local job in its own network namespace.

TensorFlow's gRPC server listens on every interface (`*:port`, whatever TF_CONFIG says) and runs any
graph it is sent. A job in a fresh network namespace has only its own loopback, so nothing outside the
job can reach those ports; the kernel talks to the job over a Unix socket in the job's directory.
"""

from __future__ import annotations

import fcntl
import shutil
import socket
import struct
import subprocess

from tfdist.settings import ENV_ISOLATION

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def wrapper_command() -> list[str] | None:
    """The command prefix that puts a process in a new network namespace here, or None if none works.

    Tries a user namespace first (works unprivileged where the kernel allows it), then plain root.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ([unshare, "--net", "--map-root-user"], [unshare, "--net"]):
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return prefix
    return None


class IsolationUnavailable(RuntimeError):
    """No network namespace can be made here, and the admin did not say the network is trusted."""


def isolation_prefix(isolation: str, what: str) -> list[str]:
    """The command prefix that starts `what` (TensorFlow servers of this server's user) in its own network
    namespace; [] where the admin set TFDIST_ISOLATION=none. ValueError: an unknown setting."""
    if isolation == "none":
        return []
    if isolation != "netns":
        raise ValueError(f"{ENV_ISOLATION}={isolation!r} is unknown: use 'netns' or 'none'")
    prefix = wrapper_command()
    if not prefix:
        raise IsolationUnavailable(
            f"cannot give {what} its own network namespace (`unshare --net` is not permitted here). "
            f"TensorFlow's servers listen on every interface and run any graph sent to them, so {what} "
            f"was not started. If this machine's network is trusted, set {ENV_ISOLATION}=none."
        )
    return prefix


def bring_up_loopback() -> None:
    """A new namespace's `lo` is down; TF needs 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))
