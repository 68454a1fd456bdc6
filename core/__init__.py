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


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """The jobs panel's server side lives in tfdist.labserver (tornado stays out of the kernel)."""
    return [{"module": "tfdist.labserver"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    from .labserver import _jupyter_labextension_paths as _paths

    return _paths()
