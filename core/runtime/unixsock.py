"""Unix socket paths of any length.

Why: AF_UNIX addresses hold 107 bytes; a job's control socket lives in its directory under the user's
home or state dir, and a long home, user name or job name passed that limit ("AF_UNIX path too long").
A long path is reached through /proc/self/fd/N of its directory instead, which is always short.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

SUN_PATH_MAX = 107


@contextlib.contextmanager
def short_path(path: str) -> Iterator[str]:
    """`path`, or an equivalent short one valid while the context is open (bind or connect inside it)."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        yield path
        return
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)
