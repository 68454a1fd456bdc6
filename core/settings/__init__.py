"""The one reader of tfdist's ``TFDIST_*`` environment variables, in typed groups.

* `Settings` (pydantic-settings, `server`): what the spawner hands each notebook server.
* `KernelSettings`, `TaskSettings`, `LabSettings`, `HubSettings`, `KubeHubSettings`, `AdminSettings` (plain,
  `groups`): the admin's knobs, a job's own processes and pods, the lab server, the embedded hub and its
  config file, the Kubernetes hub's config file (hub_config/), the GPU admin service.

Every variable's name is a constant in `names` (re-exported here). No other module reads a ``TFDIST_*``
variable from ``os.environ`` (tests/test_settings_reference.py checks it); docs/configuration.md is
generated from these groups (`python -m tfdist.settings --reference`).

The pydantic part loads only when one of its names is used: job pods and task processes import this
package at start and must not pay for pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .fields import Group, SettingsError, Var
from .groups import (
    GROUPS,
    LIFELINE_GRACE_MAX_S,
    LIFELINE_GRACE_MIN_S,
    LIFELINE_GRACE_S,
    AdminSettings,
    HubSettings,
    KernelSettings,
    KubeHubSettings,
    LabSettings,
    TaskSettings,
)
from .names import *  # noqa: F403 (every variable's name, as before this was a package)

if TYPE_CHECKING:
    from .server import Settings, _describe, _MappingSettings, from_environ  # noqa: F401

_SERVER = ("Settings", "_MappingSettings", "from_environ", "_describe")


def __getattr__(name: str) -> Any:
    if name in _SERVER:
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GROUPS",
    "LIFELINE_GRACE_MAX_S",
    "LIFELINE_GRACE_MIN_S",
    "LIFELINE_GRACE_S",
    "AdminSettings",
    "Group",
    "HubSettings",
    "KernelSettings",
    "KubeHubSettings",
    "LabSettings",
    "Settings",
    "SettingsError",
    "TaskSettings",
    "Var",
    "from_environ",
]
