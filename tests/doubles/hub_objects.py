"""FakeHubUser and FakeHub: the two JupyterHub objects a Spawner reads, for building one outside a hub.

Named, minimal stand-ins (instead of kubespawner's private ``_mock=True`` constructor switch): they carry
exactly the attributes Spawner/KubeSpawner read while computing a pod manifest and the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeGroup:
    name: str


@dataclass
class FakeHubUser:
    name: str
    id: int = 1
    groups: list[FakeGroup] = field(default_factory=list)
    spawners: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"/user/{self.name}/"

    @property
    def escaped_name(self) -> str:
        return self.name


@dataclass
class FakeHub:
    api_url: str = "http://hub:8081/hub/api"
    base_url: str = "/hub/"
    public_host: str = ""
    url: str = "http://hub:8081/hub/"
    name: str = "hub"
