"""TensorFlow's import-time log lines, held to TF_CPP_MIN_LOG_LEVEL.

Why: TensorFlow logs through absl before absl is initialised, and absl then writes every line to stderr
whatever TF_CPP_MIN_LOG_LEVEL says (tensorflow/tensorflow#100442). On a CPU with AVX-512 VNNI, BF16 or
AMX, every `import tensorflow` prints absl's preamble and oneDNN's INFO notice (twice, one per copy of
absl in TensorFlow's libraries): a red box under a notebook's first cell, though the spawner asked for
level 2. The package's IPython startup file (etc/ipython/startup, every kernel of the environment) calls
install(): while `tensorflow` is first imported, file descriptor 2 goes to a temporary file, and what
was written there is then written back without the log lines below the level. Nothing is held unless
TF_CPP_MIN_LOG_LEVEL is set, and nothing but TensorFlow's own import is touched.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Iterator

SEVERITIES = "IWEF"  # TF_CPP_MIN_LOG_LEVEL 0..3: the lowest severity still written
# absl: "I0000 00:00:1796149594.761801    5449 port.cc:153] ..."; TensorFlow's own (tsl) format:
# "2026-01-30 22:44:42.456316: I tensorflow/core/util/port.cc:153] ..."
_ABSL = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] ")  # seconds since 1970 before init
_TSL = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF]) \S+:\d+\] ")
_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


def min_level(environ: dict[str, str] | os._Environ = os.environ) -> int | None:
    """TF_CPP_MIN_LOG_LEVEL as TensorFlow reads it (0-3), or None when unset or not a level."""
    raw = (environ.get("TF_CPP_MIN_LOG_LEVEL") or "").strip()
    return int(raw) if raw in ("0", "1", "2", "3") else None


def below_level(text: str, level: int) -> str:
    """`text` without the log lines (and their continuation lines) of a severity below `level`; absl's
    preamble is a warning about those lines, so it goes once warnings do."""
    kept: list[str] = []
    dropping = False  # anything that is not a log line continues the one before (TensorFlow's span lines)
    for line in text.splitlines(keepends=True):
        m = _ABSL.match(line) or _TSL.match(line)
        if m:
            dropping = SEVERITIES.index(m.group(1)) < level
        elif line.startswith(_PREAMBLE):
            dropping = False  # its own line only: what follows is judged by its own header
            if level >= 1:
                continue
        if not dropping:
            kept.append(line)
    return "".join(kept)


@contextlib.contextmanager
def held_stderr(level: int) -> Iterator[None]:
    """File descriptor 2 into a temporary file for the block; then what was written, below_level (what
    other threads wrote meanwhile comes late, not lost). No fd 2 to hold: the block runs as it is."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        saved = os.dup(2)  # also keeps a pipe on fd 2 (ipykernel's capture) open meanwhile
    except OSError:
        yield
        return
    try:
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
                tmp.seek(0)
                rest = below_level(tmp.read().decode("utf-8", "replace"), level).encode()
                while rest:
                    rest = rest[os.write(2, rest) :]
    finally:
        os.close(saved)


class _QuietTensorflow(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first `import tensorflow` it takes itself out of sys.meta_path and
    wraps the real loader's exec_module (the module keeps its own loader and spec)."""

    def __init__(self, level: int) -> None:
        self.level = level

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tensorflow":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:  # the import goes on without us, and says what is wrong itself
            return None
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        real = loader.exec_module
        level = self.level

        def exec_module(module):
            try:
                with held_stderr(level):
                    real(module)
            finally:
                with contextlib.suppress(AttributeError):
                    del loader.exec_module  # the instance attribute: the class's method again

        loader.exec_module = exec_module
        return spec


def install(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Hold TensorFlow's first import to TF_CPP_MIN_LOG_LEVEL; False when there is nothing to do."""
    level = min_level(environ)
    if level is None or level == 0 or "tensorflow" in sys.modules:
        return False
    if any(isinstance(f, _QuietTensorflow) for f in sys.meta_path):
        return True
    sys.meta_path.insert(0, _QuietTensorflow(level))
    return True
