"""Backends that run a job: one interface (base.Backend), local processes and Kubernetes."""

from __future__ import annotations

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


__all__ = ["Backend", "Launch", "get_backend"]
