"""Let a stopping Jupyter server exit while a request of it still holds an AnyIO worker thread.

jupyter_server runs blocking work (the nbconvert exporter list JupyterLab asks for on every page load, file
contents) in AnyIO worker threads. They are not daemon threads, and AnyIO stops one only when the task that
started it finishes (agronholm/anyio#321, jupyterlab/jupyterlab#10442). A server told to stop (SIGINT
from the hub's spawner, SIGTERM from the hub or the kubelet) ends its event loop with such a request still
pending, so its task never finishes and the interpreter waits on the idle thread at exit: the hub's spawner
SIGKILLed it after its interrupt and term timeouts (60 s); the kubelet kills it at the end of the pod's
grace period (1 s under KubeSpawner) instead of letting it exit.

Python runs the callbacks of `threading._register_atexit` (as concurrent.futures does for its workers)
after the main thread returned and before it joins the other non-daemon threads: there each AnyIO worker is
told to stop, the way AnyIO's own done-callback tells it. A worker that is running a job ends it first.
"""

from __future__ import annotations

import contextlib
import queue
import threading


def stop_anyio_workers() -> int:
    """Ask every live AnyIO worker thread to end after its current job; returns how many were asked."""
    try:
        from anyio._backends._asyncio import WorkerThread
    except ImportError:  # another AnyIO layout: nothing of ours to stop
        return 0
    asked = 0
    for thread in threading.enumerate():
        if not isinstance(thread, WorkerThread) or not thread.is_alive():
            continue
        with contextlib.suppress(queue.Full):
            thread.queue.put(None, timeout=1)  # AnyIO's own stop message; its queue holds two
            asked += 1
    return asked


def release_workers_at_exit() -> None:
    """Register `stop_anyio_workers` to run before the interpreter joins its threads (once per process)."""
    global _registered
    register = getattr(threading, "_register_atexit", None)
    if _registered or register is None:
        return
    register(stop_anyio_workers)
    _registered = True


_registered = False
