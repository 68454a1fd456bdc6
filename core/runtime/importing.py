"""Heavy imports with Python's cyclic garbage collector paused.

`import tensorflow` (tf_keras with it) creates hundreds of thousands of objects and almost no garbage, yet
the collector runs over them again and again while they are made: measured here, 8 alternating runs,
3.9 s of CPU with it paused against 4.3 s without. Every task of a job starts with this import under
its CPU limit (a 0.45-core pod: ~1 s of its way to the first epoch), so each one pauses it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside, and back as it was after (a caller that had it off keeps it off)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
