"""Admin profiles' schema: the typed, frozen models a profiles file is parsed into.

Why a module of its own: the form, the validation, the allocator and the Kubernetes spawner read these models,
and none of them reads the file; what reads the file and names the bad key is `tfdist.spawner.profiles`.
Unknown keys are errors, not silently ignored: a typo such as ``max_gpu_per_user`` would otherwise leave a
cap unset.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tfdist.datamounts import DataMount
from tfdist.hubadmin.config import GpuAdmin
from tfdist.spawner.mig import check_mig_resource

from .profile_volumes import DataVolume, distinct_volumes

__all__ = [
    "ANY_GROUP",
    "CustomImage",
    "DataVolume",
    "FloatRange",
    "GpuModel",
    "ImageChoice",
    "IntRange",
    "JobLimits",
    "KueueQueue",
    "KueueQueues",
    "Profile",
    "ProfilesConfig",
    "Toleration",
]

#: The group entry that lets every authenticated user use a profile.
ANY_GROUP = "*"

_SLUG = r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?"

# Kubernetes extended resource name: domain-prefixed, e.g. nvidia.com/gpu or nvidia.com/mig-1g.10gb
_RESOURCE = r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?"


def _regex(v: str) -> str:
    """A pattern admins write in YAML, refused at load time if Python cannot compile it."""
    try:
        re.compile(v)
    except re.error as e:
        raise ValueError(f"not a valid regular expression ({e})") from None
    return v


# what Python's re has and RE2 (the API server's CEL `matches`, which checks job pods' images against the
# same pattern) has not, or reads otherwise: lookaround, backreferences, atomic groups, conditionals,
# comments, the inline flags x, a, L and u, possessive quantifiers, \Z, \N{...}, \u and \U escapes, `{,n}`
# (a repeat in Python, text in RE2) and `[[:` (a set in Python, a POSIX class in RE2)
_NOT_RE2 = re.compile(r"\(\?(?:[=!>(#]|<[=!]|P=|[a-zA-Z-]*[xaLu])|\\[1-9ZNuU]|(?<!\\)[*+?}]\+|\{,|\[\[:")
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
RE2_MAX_REPEAT = 1000


def _re2_regex(v: str) -> str:
    """`_regex`, and one the admission policy's RE2 reads the same way (hub_config/admission-policy.yaml)."""
    for m in _REPEAT.finditer(v):
        if any(int(n) > RE2_MAX_REPEAT for n in m.groups() if n):
            raise ValueError(
                f"repeats {m.group(0)}: RE2 (the admission policy's) counts at most {RE2_MAX_REPEAT}"
            )
    bad = _NOT_RE2.search(v)
    if bad:
        raise ValueError(
            f"uses {bad.group(0)!r}, which RE2 (the admission policy's regular expressions, checking job "
            "pods' images against the same pattern) does not have or reads otherwise: no lookaround, "
            "backreferences, atomic groups, comments, (?x)/(?a)/(?L)/(?u), possessive quantifiers, \\Z, "
            "\\N/\\u/\\U escapes, {,n} or [[:"
        )
    return _regex(v)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _finite(v: float, what: str) -> float:
    if isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number")
    return v


class FloatRange(_Strict):
    """A bounded numeric choice (CPU cores, memory in GiB)."""

    min: float = Field(gt=0)
    max: float = Field(gt=0)
    default: float = Field(gt=0)
    #: limit = guarantee * limit_factor on Kubernetes (1 = Guaranteed QoS for this resource)
    limit_factor: float = Field(1.0, ge=1.0)

    @model_validator(mode="after")
    def _ordered(self) -> FloatRange:
        for name in ("min", "max", "default", "limit_factor"):
            _finite(getattr(self, name), name)
        if self.min > self.max:
            raise ValueError(f"min ({self.min:g}) is above max ({self.max:g})")
        if not self.min <= self.default <= self.max:
            raise ValueError(f"default ({self.default:g}) is outside min..max ({self.min:g}..{self.max:g})")
        return self


class IntRange(_Strict):
    """A bounded whole-number choice (GPUs)."""

    min: int = Field(0, ge=0, strict=True)
    max: int = Field(0, ge=0, strict=True)
    default: int = Field(0, ge=0, strict=True)

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        if not self.min <= self.default <= self.max:
            raise ValueError(f"default ({self.default}) is outside min..max ({self.min}..{self.max})")
        return self


class Toleration(_Strict):
    """A Kubernetes toleration, written as in a pod spec (camelCase keys)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, alias="tolerationSeconds")

    def as_k8s(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class GpuModel(_Strict):
    """One GPU model the cluster (or this machine) has, and how to land a pod on it."""

    display_name: str = Field(min_length=1, max_length=200)
    #: the extended resource requested for it (nvidia.com/gpu, or a MIG slice such as nvidia.com/mig-1g.10gb)
    resource: str = Field("nvidia.com/gpu", pattern=f"^{_RESOURCE}$", max_length=253)
    #: at most 8 labels: the admission policy refuses a job pod with more (tfdist-user-placement)
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=8)
    tolerations: list[Toleration] = Field(default_factory=list)
    #: embedded mode: a regex that must fully match the NVML device name, e.g. "NVIDIA H100.*"
    nvml_name: str = ".*"
    #: a node's share per GPU (its CPUs and memory over its GPUs): a pod with N GPUs of this model, a
    #: notebook or a %%tfdist task, may ask for at most N shares, so no one pod keeps the other GPUs of
    #: its node from being used (96 CPUs and 8 GPUs: 12); unset, only the profile's quotas bound them
    cpu_per_gpu: float | None = Field(None, gt=0, le=4096)
    memory_gib_per_gpu: float | None = Field(None, gt=0, le=65536)

    @field_validator("resource")
    @classmethod
    def _known_mig(cls, v: str) -> str:
        return check_mig_resource(v)  # nvidia.com/mig-<profile>: a profile NVIDIA's GPUs have

    @field_validator("nvml_name")
    @classmethod
    def _compiles(cls, v: str) -> str:
        return _regex(v)

    def matches_nvml(self, name: str) -> bool:
        return re.fullmatch(self.nvml_name, name) is not None


class ImageChoice(_Strict):
    """An image on the list; a bare string in YAML is the image itself."""

    image: str = Field(min_length=1, max_length=512)
    display_name: str | None = Field(None, max_length=200)

    @property
    def label(self) -> str:
        return self.display_name or self.image


class CustomImage(_Strict):
    """Free-form images: allowed when the whole string matches `regex` (re.fullmatch, never a prefix)."""

    regex: str = Field(min_length=1)
    display_name: str = "Other image…"
    #: shown next to the field and in the error message, e.g. "images from registry.example.org/team/"
    help: str = ""

    @field_validator("regex")
    @classmethod
    def _compiles(cls, v: str) -> str:
        return _re2_regex(v)

    def matches(self, image: str) -> bool:
        return re.fullmatch(self.regex, image) is not None


class JobLimits(_Strict):
    """Kubernetes: what a user's `%%tfdist` jobs may hold together, beside their notebook servers (the
    user namespace's ResourceQuota adds the profile's own cpu/memory maxima for the notebook). Unset cpu or
    memory: no cap on it. The counts and disks have default caps (``null``: no cap), so that one user
    cannot fill the API server, the nodes' disks or the storage class."""

    cpu: float | None = Field(None, gt=0)
    memory_gib: float | None = Field(None, gt=0)
    #: pods in the user's namespace, notebook servers included (and the most tasks one Job may have)
    pods: int = Field(32, ge=1, strict=True)
    #: %%tfdist jobs at once (each is 2-3 batch Jobs, a Service or more, a Secret, a NetworkPolicy)
    jobs: int | None = Field(16, ge=1, strict=True)
    #: local disk (ephemeral storage) of all the namespace's containers, requests and limits
    local_disk_gib: float | None = Field(100, gt=0)
    #: persistent volume claims (the notebook's home included) and the storage they request
    volume_claims: int | None = Field(4, ge=0, strict=True)
    storage_gib: float | None = Field(100, gt=0)

    @model_validator(mode="after")
    def _finite_values(self) -> JobLimits:
        for name in ("cpu", "memory_gib", "local_disk_gib", "storage_gib"):
            v = getattr(self, name)
            if v is not None:
                _finite(v, name)
        return self


class KueueQueue(_Strict):
    """One Kueue ClusterQueue (per team or profile): the nominal quota of all jobs queued in it together
    (tfdist.kube.queueing turns it into Kueue's objects). Unset cpu or memory: no cap on it."""

    cpu: float | None = Field(None, gt=0)
    memory_gib: float | None = Field(None, gt=0)
    #: GPUs (or MIG slices) per GPU model key of gpu_models: one Kueue ResourceFlavor per model
    gpus: dict[str, int] = Field(default_factory=dict)
    #: GPUs per model it may borrow beyond its own from the cohort's idle quota (None: all that is idle;
    #: 0: never borrows); cpu and memory are borrowed freely
    borrowing_limit_gpus: int | None = Field(None, ge=0, strict=True)
    #: the users of this queue take turns by what each used lately (Kueue's Admission Fair Sharing between
    #: their LocalQueues), not by who submitted first; Kueue's Configuration needs ``admissionFairSharing``
    fair_sharing: bool = Field(False, strict=True)

    @model_validator(mode="after")
    def _values(self) -> KueueQueue:
        for name in ("cpu", "memory_gib"):
            v = getattr(self, name)
            if v is not None:
                _finite(v, name)
        for key, n in self.gpus.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"gpus.{key} must be a whole number of GPUs, 0 or more")
        return self


class KueueQueues(_Strict):
    """Kubernetes with Kueue: the queues profiles name in ``kueue_queue`` (a LocalQueue of that name in each
    user's namespace feeds the ClusterQueue of that name); all of them share one cohort, so a queue may
    borrow what another leaves idle."""

    cohort: str = Field("tfdist", pattern=f"^{_SLUG}$")
    queues: dict[str, KueueQueue] = Field(min_length=1)

    @field_validator("queues")
    @classmethod
    def _queue_names(cls, v: dict[str, KueueQueue]) -> dict[str, KueueQueue]:
        for key in v:
            if not re.fullmatch(_SLUG, key):
                raise ValueError(f"queue name {key!r} must be lowercase letters, digits and '-'")
        return v


class Profile(_Strict):
    """What one group of users may choose."""

    slug: str = Field(pattern=f"^{_SLUG}$")
    display_name: str = Field(min_length=1, max_length=200)
    description: str = Field("", max_length=2000)
    #: group names that may use it; "*" means every user
    groups: list[str] = Field(min_length=1)
    cpu: FloatRange
    memory_gib: FloatRange
    gpus: IntRange = Field(default_factory=IntRange)
    #: keys of the top-level gpu_models offered here (empty for a CPU-only profile)
    gpu_models: list[str] = Field(default_factory=list)
    default_gpu_model: str | None = None
    images: list[ImageChoice] = Field(min_length=1)
    custom_image: CustomImage | None = None
    #: cap on the GPUs one user holds across all of their servers when starting with this profile
    max_gpus_per_user: int | None = Field(None, ge=0, strict=True)
    #: optional Kueue LocalQueue for %%tfdist jobs from this profile (TFDIST_KUEUE_QUEUE)
    kueue_queue: str | None = None
    #: Kubernetes: the quota of the user's jobs (CPU, memory, pods), enforced by the user namespace's quota
    jobs: JobLimits = Field(default_factory=JobLimits)
    #: Kubernetes: shared data volumes mounted in the notebook and every pod of its jobs (DataVolume)
    #: at most 16: every pod of a job mounts each (the admission policy's bound on a pod's volumes)
    data_volumes: list[DataVolume] = Field(default_factory=list, max_length=16)

    @field_validator("data_volumes")
    @classmethod
    def _volumes(cls, v: list[DataVolume]) -> list[DataVolume]:
        distinct_volumes(v)
        return v

    @property
    def data_mounts(self) -> tuple[DataMount, ...]:
        return tuple(v.record() for v in self.data_volumes)

    @field_validator("images", mode="before")
    @classmethod
    def _bare_strings(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"image": i} if isinstance(i, str) else i for i in v]
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        if self.gpus.max > 0 and not self.gpu_models:
            raise ValueError("gpus.max is above 0 but gpu_models is empty: say which GPU models it offers")
        if self.gpus.max == 0 and self.gpu_models:
            raise ValueError("gpu_models is set but gpus.max is 0 (a CPU-only profile offers no GPU model)")
        if self.default_gpu_model is not None and self.default_gpu_model not in self.gpu_models:
            raise ValueError(f"default_gpu_model {self.default_gpu_model!r} is not in gpu_models")
        if len(set(self.gpu_models)) != len(self.gpu_models):
            raise ValueError("gpu_models lists a model twice")
        images = [i.image for i in self.images]
        if len(set(images)) != len(images):
            raise ValueError("images lists an image twice")
        if self.max_gpus_per_user is not None and self.max_gpus_per_user < self.gpus.min:
            raise ValueError(
                f"max_gpus_per_user ({self.max_gpus_per_user}) is below gpus.min ({self.gpus.min})"
            )
        return self

    @property
    def offers_gpus(self) -> bool:
        return self.gpus.max > 0

    @property
    def default_model(self) -> str | None:
        return self.default_gpu_model or (self.gpu_models[0] if self.gpu_models else None)

    def allowed_for(self, groups: Iterable[str]) -> bool:
        return ANY_GROUP in self.groups or not set(self.groups).isdisjoint(groups)


class ProfilesConfig(_Strict):
    """The whole profiles file."""

    gpu_models: dict[str, GpuModel] = Field(default_factory=dict)
    profiles: list[Profile] = Field(min_length=1)
    #: hub admins' GPU section (GPU-idle culling per profile): tfdist.hubadmin.config
    gpu_admin: GpuAdmin = Field(default_factory=GpuAdmin)
    #: Kueue's queues and their quota (docs/queueing.md); unset: kueue_queue is only a label
    kueue: KueueQueues | None = None

    @field_validator("gpu_models")
    @classmethod
    def _model_keys(cls, v: dict[str, GpuModel]) -> dict[str, GpuModel]:
        for key in v:
            if not re.fullmatch(_SLUG, key):
                raise ValueError(f"GPU model key {key!r} must be lowercase letters, digits and '-'")
        return v

    @model_validator(mode="after")
    def _references(self) -> ProfilesConfig:
        seen: set[str] = set()
        for p in self.profiles:
            if p.slug in seen:
                raise ValueError(f"two profiles have the slug {p.slug!r}")
            seen.add(p.slug)
            for m in p.gpu_models:
                if m not in self.gpu_models:
                    raise ValueError(
                        f"profile {p.slug!r} offers GPU model {m!r}, which gpu_models does not define"
                    )
        self.gpu_admin.check_references(seen)
        self._queue_references()
        return self

    def _queue_references(self) -> None:
        if self.kueue is None:
            return
        for name, q in self.kueue.queues.items():
            for m in q.gpus:
                if m not in self.gpu_models:
                    raise ValueError(
                        f"queue {name!r} has quota for GPU model {m!r}, which gpu_models does not define"
                    )
        for p in self.profiles:
            if p.kueue_queue is not None and p.kueue_queue not in self.kueue.queues:
                raise ValueError(
                    f"profile {p.slug!r} names kueue_queue {p.kueue_queue!r}, not a queue of kueue.queues"
                )

    def profile(self, slug: str) -> Profile | None:
        for p in self.profiles:
            if p.slug == slug:
                return p
        return None

    def allowed_profiles(self, groups: Iterable[str]) -> list[Profile]:
        g = set(groups)
        return [p for p in self.profiles if p.allowed_for(g)]
