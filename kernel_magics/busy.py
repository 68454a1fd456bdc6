"""Keep JupyterLab's kernel status "busy" for the whole `%%tfdist` cell.

Why it said "Idle" mid-cell: while the cell blocks the main shell, the kernel still answers the control
channel and publishes a busy/idle pair for each request, with that request as parent. When the monitor's
widgets open, JupyterLab 4.6 (default `commsOverSubshells: perCommTarget`) asks the kernel for a subshell
for the widget comm target: a `create_subshell_request` on the control channel, in the middle of the cell
(jupyter-resource-usage's `usage_request` does the same). JupyterLab sets its status from every status
message whose parent type is not in the server's `untracked_message_types`, so the last word was "idle"
while the job trained. While the cell runs, each such "idle" is followed at once by "busy" with the cell's
own parent; the cell's own final "idle" comes after, untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _msg_id(parent: Any) -> Any:
    return (parent or {}).get("header", {}).get("msg_id")


@contextlib.contextmanager
def stay_busy(shell: Any) -> Iterator[None]:
    kernel = getattr(shell, "kernel", None)
    publish = getattr(kernel, "_publish_status", None)
    if kernel is None or publish is None or "_publish_status" in vars(kernel):
        yield  # not an ipykernel we know, or already wrapped (a nested run): leave it alone
        return
    try:
        cell = kernel.get_parent("shell")
    except TypeError:  # an ipykernel without per-channel parents
        cell = kernel.get_parent()
    ours = _msg_id(cell)

    def publish_status(status: str, channel: str, parent: Any = None) -> None:
        publish(status, channel, parent)
        if status != "idle" or ours is None:
            return
        try:
            other = parent or kernel.get_parent(channel)
        except TypeError:
            other = parent
        if _msg_id(other) != ours:
            publish("busy", "shell", cell)

    kernel._publish_status = publish_status
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            del kernel._publish_status
