"""The spawn-time check of a profile's data volumes: each claim exists in the user's namespace and can be
mounted by the notebook and its jobs' pods at once, or the spawn is refused with a sentence naming the claim
and the namespace, before the server's pod or home claim exists (docs/admins.md, "Shared data")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tfdist.datamounts import DataMount

__all__ = ["claim_refusal", "data_claims_refusal"]

#: access modes that let several pods on any nodes mount a claim at once (ReadOnlyMany: read-only only)
SHARED = "ReadWriteMany"
SHARED_READ = "ReadOnlyMany"


def claim_refusal(m: DataMount, namespace: str, access_modes: Sequence[str] | None) -> str | None:
    """Why the claim of `m` cannot be mounted (``access_modes``: the live claim's, None when it does not
    exist), or None when it can. Pure."""
    if access_modes is None:
        return (
            f"The data volume {m.mount} of your profile needs the PersistentVolumeClaim {m.claim!r} in "
            f"namespace {namespace!r}, which does not exist: your server was not started. Ask your admin "
            "to create it there (docs/admins.md, Shared data)."
        )
    if SHARED in access_modes or (m.read_only and SHARED_READ in access_modes):
        return None
    need = f"{SHARED} or {SHARED_READ}" if m.read_only else SHARED
    return (
        f"The data volume {m.mount} of your profile is the PersistentVolumeClaim {m.claim!r} in namespace "
        f"{namespace!r}, whose access modes ({', '.join(access_modes) or 'none'}) do not let the notebook "
        f"and its jobs' pods mount it at once ({need} needed): your server was not started. Ask your admin."
    )


async def data_claims_refusal(core: Any, namespace: str, mounts: Sequence[DataMount]) -> str | None:
    """The first refusal among `mounts`' claims, read live with ``core`` (kubernetes_asyncio CoreV1Api)."""
    from kubernetes_asyncio.client.exceptions import ApiException

    for m in mounts:
        try:
            claim = await core.read_namespaced_persistent_volume_claim(m.claim, namespace)
            modes: list[str] | None = list(claim.spec.access_modes or [])
        except ApiException as e:
            if e.status != 404:
                raise
            modes = None
        why = claim_refusal(m, namespace, modes)
        if why is not None:
            return why
    return None
