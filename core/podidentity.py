"""Who a user's pods run as on Kubernetes: the notebook's user and groups, pinned for every pod of its jobs.

Why: the profile's data volumes are shared between users (a team's datasets, a scratch volume), and file
permissions on them are the only thing between one user's files and another's. Pod Security `restricted`
refuses only UID 0, so a job pod that picked another user's UID, a group it is not in, or an `fsGroup` (the
kubelet then makes every file of the volume that group's, recursively, on mount) would read or overwrite
files its notebook cannot. The spawner resolves its `uid`/`gid`/`fs_gid`/`supplemental_gids` once, writes
them into the namespace's admission parameters (tfdist.kube.tenancy) and into the notebook's environment
(tfdist.settings); the Kubernetes backend sets exactly them on every job pod (tfdist.kube.runas), and the
admission policy refuses any other (hub_config/admission-policy.yaml).

A typed record and pure functions only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT", "MAX_SUPPLEMENTAL_GROUPS", "PodIdentity"]

#: hub_config/admission-policy.yaml refuses a job pod with more (a list no other bound counts)
MAX_SUPPLEMENTAL_GROUPS = 4


@dataclass(frozen=True)
class PodIdentity:
    """The user and groups a pod's processes run as (its pod-level securityContext)."""

    run_as_user: int
    run_as_group: int
    #: the group the kubelet gives the pod's volumes (KubeSpawner's fs_gid); None: no fsGroup
    fs_group: int | None = None
    supplemental_groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ids = [self.run_as_user, self.run_as_group, *self.supplemental_groups]
        ids += [] if self.fs_group is None else [self.fs_group]
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < 2**31 for i in ids):
            raise ValueError(f"user and group ids must be integers in 0..2^31-1, not {ids}")
        if self.run_as_user == 0:
            raise ValueError("runAsUser 0 (root) is refused by Pod Security `restricted`")
        if len(self.supplemental_groups) > MAX_SUPPLEMENTAL_GROUPS:
            raise ValueError(
                f"at most {MAX_SUPPLEMENTAL_GROUPS} supplementary groups (the admission policy's bound on "
                f"a job pod), not {len(self.supplemental_groups)}"
            )

    def security_context(self) -> dict[str, Any]:
        """The pod-level securityContext fields this identity sets (merged into the pod's own)."""
        sc: dict[str, Any] = {"runAsUser": self.run_as_user, "runAsGroup": self.run_as_group}
        if self.fs_group is not None:
            sc["fsGroup"] = self.fs_group
        if self.supplemental_groups:
            sc["supplementalGroups"] = list(self.supplemental_groups)
        return sc

    def dump(self) -> str:
        """The environment variable's value (the spawner writes it, `load` reads it in the kernel)."""
        return json.dumps(self.security_context(), sort_keys=True)

    @classmethod
    def load(cls, value: str | dict[str, Any]) -> PodIdentity:
        """From `dump`'s JSON (or its parsed dict); ValueError naming what is wrong."""
        d = json.loads(value) if isinstance(value, str) else value
        if not isinstance(d, dict) or not {"runAsUser", "runAsGroup"} <= set(d):
            raise ValueError("needs a JSON object with runAsUser and runAsGroup")
        unknown = set(d) - {"runAsUser", "runAsGroup", "fsGroup", "supplementalGroups"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        return cls(
            run_as_user=d["runAsUser"],
            run_as_group=d["runAsGroup"],
            fs_group=d.get("fsGroup"),
            supplemental_groups=tuple(d.get("supplementalGroups") or ()),
        )


#: the images' own user (docker/*.Dockerfile: `useradd --uid 1000 --user-group`, USER 1000) and z2jh's
#: `singleuser.uid`: what TfdistKubeSpawner runs notebooks as unless the admin sets uid/gid
DEFAULT = PodIdentity(run_as_user=1000, run_as_group=1000)
