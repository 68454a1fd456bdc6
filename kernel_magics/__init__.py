"""IPython magics: `%%tfdist run` and the `%tfdist` line magics. Load with `%load_ext tfdist`."""

from __future__ import annotations

import atexit
from typing import Any

from ..errors import JobFailed, TfdistError

_magics: Any = None


def _show_error(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None) -> list[str]:
    """User errors as a message, not a kernel-side traceback; a failed job with the remote traceback;
    an interrupt tfdist handled as the one line "KeyboardInterrupt: ..." (the cell ends interrupted)."""
    from .magics import CellInterrupted

    if isinstance(value, CellInterrupted):
        etype = KeyboardInterrupt
    lines = []
    if isinstance(value, JobFailed) and value.remote_traceback:
        lines.append(value.remote_traceback.rstrip())
    lines.append(f"{etype.__name__}: {value}")
    shell._showtraceback(etype, value, lines)
    return lines


def load_ipython_extension(ipython: Any) -> None:
    global _magics
    from .magics import CellInterrupted, TfdistMagics

    # first, so that broken settings (SettingsError) read while loading show as one sentence too
    ipython.set_custom_exc((TfdistError, CellInterrupted), _show_error)
    _magics = TfdistMagics(ipython)
    ipython.register_magics(_magics)
    atexit.register(_magics.close)  # a clean kernel shutdown; a killed kernel is covered by the lifeline
    _magics.warm_up_first()  # TensorFlow imports for the first job while the user writes its cell


def unload_ipython_extension(ipython: Any) -> None:
    global _magics
    if _magics is not None:
        _magics.close()
        _magics = None
    ipython.set_custom_exc((), None)
