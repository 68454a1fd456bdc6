"""The profile's shared data volumes in Kubernetes objects, as plain dicts. Pure: no API calls.

The notebook pod (the spawner) and every pod of its `%%tfdist` jobs (tfdist.kube.manifests, both strategies)
mount the same claims at the same paths, read-only where the profile says so; the admission policy refuses
any other claim, and a read-only one mounted writable (hub_config/admission-policy.yaml).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..datamounts import DataMount

__all__ = ["data_volume_parts", "with_data_volumes"]


def data_volume_parts(mounts: Sequence[DataMount]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) of the profile's data volumes: the same for the notebook pod (the spawner)
    and every pod of its jobs (`with_data_volumes`); read-only in both places where the profile says so
    (the admission policy refuses a read-only claim mounted writable)."""
    volumes = [
        {"name": f"tfdist-data-{i}", "persistentVolumeClaim": {"claimName": m.claim, "readOnly": m.read_only}}
        for i, m in enumerate(mounts)
    ]
    vmounts = [
        {"name": f"tfdist-data-{i}", "mountPath": m.mount, "readOnly": m.read_only}
        for i, m in enumerate(mounts)
    ]
    return volumes, vmounts


def with_data_volumes(obj: dict[str, Any], mounts: Sequence[DataMount]) -> dict[str, Any]:
    """`obj` with the data volumes mounted in every container of its pod template (a Job; other kinds and
    no mounts: unchanged). Both strategies' Jobs go through it, so every pod of a job reads the same paths."""
    if obj.get("kind") != "Job" or not mounts:
        return obj
    volumes, vmounts = data_volume_parts(mounts)
    pod = obj["spec"]["template"]["spec"]
    pod["volumes"] = [*pod.get("volumes", []), *volumes]
    for c in pod["containers"]:
        c["volumeMounts"] = [*c.get("volumeMounts", []), *vmounts]
    return obj
