"""Backends that run a job: one interface (base.Backend), local processes and Kubernetes."""

from __future__ import annotations

import contextlib
import importlib
import threading

from ..errors import BackendUnavailable, JobSpecError
from ..settings import Settings
from .base import Backend, Launch


def get_backend(name: str, settings: Settings) -> Backend:
    if name == "local":
        from .local import LocalBackend

        return LocalBackend(settings.state_dir)
    if name == "kubernetes":
        try:
            from .kubernetes import KubernetesBackend  # type: ignore[import-not-found]
        except ImportError as exc:
            raise BackendUnavailable(
                f"the Kubernetes backend cannot be loaded here ({exc}); use --backend local"
            ) from None
        return KubernetesBackend(settings)
    raise JobSpecError(f"--backend {name!r} is unknown: choose local or kubernetes")


# What a kernel's first job on a backend imports beyond what the extension's load did: for Kubernetes, its
# client and this backend's modules (~0.7 s of CPU on 2 cores, most of the kernel's 1.5 CPU-seconds on its
# first job against 0.3 on later ones: benchmarks/results/k8s_bare-3fceecb.json, the first repeat)
FIRST_JOB_IMPORTS = {
    "kubernetes": (
        "tfdist.backends.kubernetes",
        "kubernetes_asyncio.client",
        "kubernetes_asyncio.config",
        "kubernetes_asyncio.watch",
    ),
}


def import_ahead(name: str) -> threading.Thread | None:
    """Import a backend's first-job modules in a daemon thread (at the extension's load, while the user
    writes the cell); a module that fails to import is left for the first job to report."""
    modules = FIRST_JOB_IMPORTS.get(name)
    if not modules:
        return None

    def run() -> None:
        for module in modules:
            with contextlib.suppress(Exception):
                importlib.import_module(module)

    thread = threading.Thread(target=run, name=f"tfdist-import-{name}", daemon=True)
    thread.start()
    return thread


__all__ = ["Backend", "Launch", "get_backend", "import_ahead"]
