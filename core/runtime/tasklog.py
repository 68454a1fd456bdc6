"""A task's output, of any shape, read without ever blocking the task: bounded lines, a bounded file.

Why: reading a task's pipe line by line (asyncio's 64 KiB line limit) failed on one long line or on a
progress bar that rewrites itself with '\\r' and no newline; the reader died, the pipe filled, the task
blocked on write and the job held its GPUs until someone stopped it. Output is read in chunks; lines end at
'\\n' or '\\r'; a line is cut at MAX_LINE characters; the file keeps at most about 2 x MAX_FILE bytes.
"""

from __future__ import annotations

import os
import re
from typing import BinaryIO

MAX_LINE = 2000  # characters of one line kept for the live log tail
MAX_FILE = 16 * 2**20  # bytes per log file before it rolls over to NAME.log.1
_EOL = re.compile(rb"[\r\n]")


class LineSplitter:
    """Bytes in, complete lines out; a line longer than `max_line` is cut and the rest of it skipped."""

    def __init__(self, max_line: int = MAX_LINE):
        self.max_line = max_line
        self._buf = b""
        self._skipping = False  # inside a line that was already cut

    def feed(self, chunk: bytes) -> list[str]:
        out: list[str] = []
        parts = _EOL.split(self._buf + chunk)
        self._buf = parts.pop()
        for raw in parts:
            if self._skipping:  # the end of a line whose head was already sent
                self._skipping = False
            elif raw:
                out.append(raw.decode(errors="replace")[: self.max_line])
        if len(self._buf) > self.max_line * 4:  # a line still going: send its head once, drop the rest
            if not self._skipping:
                head = self._buf[: self.max_line * 4].decode(errors="replace")
                out.append(head[: self.max_line] + " [...]")
                self._skipping = True
            self._buf = b""
        return out

    def flush(self) -> list[str]:
        rest, self._buf = self._buf, b""
        if self._skipping or not rest:
            return []
        return [rest.decode(errors="replace")[: self.max_line]]


class RollingLog:
    """An append-only log file that rolls over once to NAME.1 when it reaches `max_bytes`."""

    def __init__(self, path: str, max_bytes: int = MAX_FILE):
        self.path, self.max_bytes = path, max_bytes
        self._f: BinaryIO = open(path, "ab")
        self._size = self._f.tell()

    def write(self, data: bytes) -> None:
        if self._size + len(data) > self.max_bytes:
            self._f.close()
            os.replace(self.path, self.path + ".1")
            self._f = open(self.path, "ab")
            self._size = 0
            data = data[-self.max_bytes :]
        self._f.write(data)
        self._f.flush()
        self._size += len(data)

    def close(self) -> None:
        self._f.close()


def tail_lines(path: str, lines: int, block: int = 64 * 1024, max_bytes: int | None = None) -> str:
    """The last `lines` lines of a log file (ended by '\\n' or '\\r', as LineSplitter ends them).

    Why: the lab panel asks for a tail of every task's log each second. The file is read backwards a block
    at a time, each byte once, and at most `max_bytes` of it (by default room for `lines` lines of MAX_LINE
    characters): a progress bar that only ever writes '\\r', or output with no line end at all, once made
    every poll re-read the whole file once per block. A line cut by that bound starts with "[...] "."""
    if max_bytes is None:
        max_bytes = min((lines + 1) * (4 * MAX_LINE + 2), MAX_FILE)
    blocks, cut = _read_back(path, lines, block, max_bytes)
    text = b"".join(reversed(blocks)).decode(errors="replace")
    pieces = text.splitlines()
    out = pieces[-lines:] if lines > 0 else []
    if out and cut and len(pieces) <= lines:  # the first line's head lies before what was read
        out[0] = "[...] " + out[0]
    return "\n".join(out) + ("\n" if out and text.endswith(("\n", "\r")) else "")


def _read_back(path: str, lines: int, block: int, max_bytes: int) -> tuple[list[bytes], bool]:
    """(blocks from the end backwards, whether the file goes on before them): until `lines` + 1 line ends
    or `max_bytes`."""
    blocks: list[bytes] = []
    ends = 0
    with open(path, "rb") as f:
        pos = end = f.seek(0, os.SEEK_END)
        while pos > 0 and ends <= lines and end - pos < max_bytes:
            size = min(block, pos, max_bytes - (end - pos))
            pos -= size
            f.seek(pos)
            chunk = f.read(size)
            ends += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
            if blocks and chunk.endswith(b"\r") and blocks[-1].startswith(b"\n"):
                ends -= 1  # one "\r\n" across two blocks
            blocks.append(chunk)
    return blocks, pos > 0
