"""MIG profiles a GPU model may name (``resource: nvidia.com/mig-<profile>``, the GPU operator's mixed
strategy), so that a typo such as ``mig-1g.10g`` stops the hub instead of offering a model no node has.

The list is NVIDIA's MIG user guide's profiles for the A30, A100 (40/80 GB), H100 (80/94/96 GB), H200 and
B200 (the "+me" media-extension variants are left out: '+' is not valid in a Kubernetes resource name); a
newer GPU's profiles go here when it arrives.
"""

from __future__ import annotations

import re

__all__ = ["KNOWN_MIG_PROFILES", "check_mig_resource", "mig_profile", "profile_for"]

_BY_GPU = {
    "A30": "1g.6gb 2g.12gb 4g.24gb",
    "A100 40GB": "1g.5gb 1g.10gb 2g.10gb 3g.20gb 4g.20gb 7g.40gb",
    "A100/H100 80GB": "1g.10gb 1g.20gb 2g.20gb 3g.40gb 4g.40gb 7g.80gb",
    "H100 94GB": "1g.12gb 1g.24gb 2g.24gb 3g.47gb 4g.47gb 7g.94gb",
    "H100 96GB": "1g.12gb 1g.24gb 2g.24gb 3g.48gb 4g.48gb 7g.96gb",
    "H200": "1g.18gb 1g.35gb 2g.35gb 3g.71gb 4g.71gb 7g.141gb",
    "B200": "1g.23gb 1g.45gb 2g.45gb 3g.90gb 4g.90gb 7g.180gb",
}
KNOWN_MIG_PROFILES: frozenset[str] = frozenset(p for v in _BY_GPU.values() for p in v.split())
_PREFIX = "nvidia.com/mig-"


def check_mig_resource(resource: str) -> str:
    """`resource` unchanged, or ValueError naming the unknown MIG profile and the known ones."""
    if not resource.startswith(_PREFIX):
        return resource
    profile = resource[len(_PREFIX) :]
    if profile not in KNOWN_MIG_PROFILES:
        shape = re.fullmatch(r"[1-8]g\.\d+gb", profile)
        known = "; ".join(f"{gpu}: {v}" for gpu, v in _BY_GPU.items())
        what = "an unknown MIG profile" if shape else "not a MIG profile name (like 1g.10gb)"
        raise ValueError(f"{profile!r} is {what}; known MIG profiles: {known}")
    return resource


def mig_profile(resource: str) -> str:
    """The MIG profile a GPU model's resource names ("1g.10gb" for nvidia.com/mig-1g.10gb), "" for none.

    The embedded hub hands out MIG instances of that profile for such a model, whole GPUs for the others."""
    return resource[len(_PREFIX) :] if resource.startswith(_PREFIX) else ""


def profile_for(slices: int, memory_gib: float) -> str:
    """The known profile with `slices` compute slices whose memory is nearest `memory_gib` (NVML's
    attributes of a MIG device whose name does not carry its profile); "" when none has that many slices."""
    same = [p for p in KNOWN_MIG_PROFILES if p.startswith(f"{slices}g.")]
    if not same:
        return ""
    return min(same, key=lambda p: (abs(int(p.split(".")[1][:-2]) - memory_gib), p))
