"""jupyter-tfdist: distributed TensorFlow from a notebook cell.

`%load_ext tfdist` registers the `%%tfdist` magics (see :mod:`tfdist.kernel_magics`).
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython):  # pragma: no cover - thin delegation
    from .kernel_magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):  # pragma: no cover
    from .kernel_magics import unload_ipython_extension as _unload

    _unload(ipython)
