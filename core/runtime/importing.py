"""Heavy imports with Python's cyclic garbage collector paused.

`import tensorflow` (tf_keras with it) creates hundreds of thousands of objects and almost no garbage, yet
the collector runs over them again and again while they are made: measured here, 8 alternating runs,
3.9 s of CPU with it paused against 4.3 s without. Every task of a job starts with this import under
its CPU limit (a 0.45-core pod: ~1 s of its way to the first epoch), so each one pauses it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterator

# What a coordinator imports before its fit beyond TensorFlow: modules only, none of which makes a
# context, thread pool or server at import, so a fork server may hold them (tests/test_warm_pool.py).
COORDINATOR_MODULES = (
    "cloudpickle",
    "tfdist.payload",
    "tfdist.job.events",
    "tfdist.runtime.coordinator",
    "tfdist.runtime.strategy",
    "tfdist.runtime.psrecovery",
    "tf_keras.src.saving.saving_lib",
)


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


def import_coordinator() -> None:
    """TensorFlow, the tf.keras API and the coordinator's modules, with the collector paused. tf.keras
    is loaded on its first use, not by `import tensorflow`: the API tree of tf_keras, ~0.4 s of CPU,
    which a coordinator would otherwise pay after its payload came (on 2 cores, warm pool: ~0.2 s of
    the cell's way to its fit; a 0.45-core pod: ~1 s)."""
    with collector_paused():
        import tensorflow

        with contextlib.suppress(ImportError, AttributeError):  # no tf_keras: the cell's import says so
            tensorflow.keras.Model  # noqa: B018
        for name in COORDINATOR_MODULES:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
