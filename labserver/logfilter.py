"""Which log lines the panel shows: TensorFlow's start-up chatter is left out (the log files keep all of it).

Why: a job's first lines are mostly TensorFlow talking about itself (absl's preamble, CUDA probes on a
machine without a GPU, oneDNN and CPU-instruction notes, Keras UserWarnings with their source line), so
the panel's log view would open on a screen of warnings that say nothing about the job. `%tfdist logs`
and the files under the job's directory stay complete.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..runtime.events import is_noise

# Python's warnings.showwarning format: "/path/module.py:123: UserWarning: text"
_PY_WARNING = re.compile(r"^\S.*?\.py:\d+: [A-Za-z]*Warning: ")
_TF_CHATTER = re.compile(
    r"oneDNN custom operations are on"
    r"|This TensorFlow binary is optimized to use available CPU instructions"
    r"|To enable the following instructions:"
    r"|rebuild TensorFlow with the appropriate compiler flags"
    r"|Unable to register cu(DNN|FFT|BLAS) factory"
    r"|failed call to cuInit"
    r"|Could not find cuda drivers on your machine"
    r"|TF-TRT Warning"
    r"|computation placer already registered"
    r"|All log messages before absl::InitializeLog"
    r"|^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] (tensorflow|external/local_xla|external/local_tsl)/\S+\] "
)
_MAX_CONTINUATION = 4  # a warning's own source line(s), indented, after it


class NoiseFilter:
    """Stateful per stream: an indented line right after a hidden warning belongs to it."""

    def __init__(self) -> None:
        self._after_warning = 0
        self.hidden = 0

    def keep(self, line: str) -> bool:
        if self._after_warning and line[:1] in (" ", "\t"):
            self._after_warning -= 1
            self.hidden += 1
            return False
        self._after_warning = 0
        if is_noise(line) or _TF_CHATTER.search(line):
            self.hidden += 1
            return False
        if _PY_WARNING.match(line):
            self._after_warning = _MAX_CONTINUATION
            self.hidden += 1
            return False
        return True


def readable(lines: Iterable[str]) -> tuple[list[str], int]:
    """The lines worth reading first, and how many were left out."""
    f = NoiseFilter()
    kept = [line for line in lines if f.keep(line)]
    return kept, f.hidden
