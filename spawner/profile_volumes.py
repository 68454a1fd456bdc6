"""The profiles' shared data volumes (docs/admins.md, "Shared data"): a model of its own module so that the
schema (tfdist.spawner.profile_schema) stays one page; the path rules are tfdist.datamounts'."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tfdist.datamounts import DataMount, check_mount_path, under

__all__ = ["DataVolume", "distinct_volumes"]

# a PersistentVolumeClaim's name: a DNS-1123 subdomain
_CLAIM = r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?"


class DataVolume(BaseModel):
    """A shared data volume (docs/admins.md, "Shared data"): an existing PersistentVolumeClaim of the user's
    namespace (ReadWriteMany, or ReadOnlyMany when read-only), mounted at `mount` in the notebook pod and in
    every pod of its `%%tfdist` jobs. Read-only unless the profile says otherwise: a team's dataset is not
    one user's to overwrite."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    claim: str = Field(pattern=f"^{_CLAIM}$", max_length=253)
    mount: str
    read_only: bool = Field(True, strict=True)

    @field_validator("mount")
    @classmethod
    def _mount(cls, v: str) -> str:
        return check_mount_path(v)

    def record(self) -> DataMount:
        """What the settings, the manifests and the tenancy carry (tfdist.datamounts)."""
        return DataMount(claim=self.claim, mount=self.mount, read_only=self.read_only)


def distinct_volumes(volumes: list[DataVolume]) -> None:
    """A claim once, a path once, no path inside another (the order of nested mounts would decide what
    a path shows)."""
    seen: dict[str, str] = {}
    for v in volumes:
        if v.claim in seen:
            raise ValueError(f"data_volumes names claim {v.claim!r} twice (at {seen[v.claim]} and {v.mount})")
        seen[v.claim] = v.mount
    for i, a in enumerate(volumes):
        for b in volumes[i + 1 :]:
            if a.mount == b.mount:
                raise ValueError(f"data_volumes mounts {a.claim!r} and {b.claim!r} both at {a.mount}")
            if under(a.mount, b.mount) or under(b.mount, a.mount):
                outer, inner = (a, b) if under(b.mount, a.mount) else (b, a)
                raise ValueError(
                    f"data_volumes mounts {inner.claim!r} at {inner.mount}, inside {outer.claim!r} at "
                    f"{outer.mount}: give each its own path"
                )
