"""The local job's control protocol: JOBDIR/control.sock, one JSON request line per connection.

`{"op": "stop", "reason": ...}` is acknowledged and stops the job; any other op gets the job's view as a
snapshot, and `{"op": "watch"}` then every event as it happens (one JSON object per line, the wire of
tfdist.runtime.events) until the job ends or the client goes. A reader that stops reading is dropped, so a
stalled notebook never holds the supervisor's memory. The socket is the owner's only (0600).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

from tfdist.job.events import SnapshotEvent, to_wire
from tfdist.job.vocab import Reason
from tfdist.runtime import events
from tfdist.runtime.unixsock import short_path

WATCHER_BUFFER_MAX = 8 * 2**20
REQUEST_TIMEOUT_S = 10


class ControlServer:
    """Serves the socket; `view()` is the job's view now, `finished()` whether it ended, `stop(code)` is
    called on a stop request with INTERRUPTED (the kernel's interrupted cell) or STOPPED."""

    def __init__(
        self,
        path: str,
        view: Callable[[], dict[str, Any]],
        finished: Callable[[], bool],
        stop: Callable[[Reason], None],
    ) -> None:
        self.path = path
        self._view, self._finished, self._stop = view, finished, stop
        self.watchers: set[asyncio.StreamWriter] = set()
        self._clients: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with short_path(self.path) as bindable:  # long homes and job names pass AF_UNIX's 107 bytes
            self._server = await asyncio.start_unix_server(self.serve_client, path=bindable)
        os.chmod(self.path, 0o600)

    def broadcast(self, data: bytes) -> None:
        """One encoded event to every watcher; a stalled or broken one is dropped."""
        for w in list(self.watchers):
            try:
                if w.transport.get_write_buffer_size() > WATCHER_BUFFER_MAX:  # a stalled reader
                    self.watchers.discard(w)
                    w.close()
                    continue
                w.write(data)
            except Exception:
                self.watchers.discard(w)

    async def serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:
            self._clients.add(me)
        try:
            line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)
            req = json.loads(line or b"{}")
            op = req.get("op")
            if op == "stop":
                writer.write(events.dumps({"type": "ack"}))
                await writer.drain()
                # the kernel says "interrupted" when its cell was; %tfdist stop and the panel say nothing
                code = Reason.parse(req.get("reason"), Reason.STOPPED)
                self._stop(code if code in (Reason.INTERRUPTED, Reason.STOPPED) else Reason.STOPPED)
                return
            # its own view, folded from checked records: sent without checking it again (one per poll)
            writer.write(events.dumps(to_wire(SnapshotEvent.model_construct(view=self._view()))))
            await writer.drain()
            if op == "watch" and not self._finished():
                self.watchers.add(writer)
                await reader.read()  # until the client goes away
        except Exception:
            pass
        finally:
            self._clients.discard(me)  # type: ignore[arg-type]
            self.watchers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def close(self) -> None:
        """Flush and close every watcher (they have the final event), then the socket."""
        for w in list(self.watchers):
            with contextlib.suppress(Exception):
                await w.drain()
                w.close()
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        # each watcher's handler sees its connection closed and returns; one still waiting when the loop
        # ends would be cancelled, and Python 3.11's stream callback logs that as an error in the job's log
        if self._clients:
            await asyncio.wait(list(self._clients), timeout=2)
