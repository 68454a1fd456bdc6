"""Defaults for `%%tfdist` that the spawner hands to each notebook server through its environment.

The spawner (tfdist.spawner) writes these variables; the kernel and the lab server only read them, through
``Settings`` (pydantic-settings). Keeping the names in one place is the contract between the two sides; a
value that does not parse is an error that names the variable, not a silent default.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..datamounts import DataMount
from ..podidentity import DEFAULT as DEFAULT_IDENTITY
from ..podidentity import PodIdentity
from .fields import SettingsError
from .groups import LIFELINE_GRACE_MAX_S, LIFELINE_GRACE_MIN_S, LIFELINE_GRACE_S
from .names import (
    ENV_BACKEND,
    ENV_DATA_VOLUMES,
    ENV_GPU_NODE_SELECTOR,
    ENV_GPU_RESOURCE,
    ENV_GPU_TOLERATIONS,
    ENV_GPUS,
    ENV_KUEUE_QUEUE,
    ENV_LIFELINE_GRACE_S,
    ENV_NAMESPACE,
    ENV_POD_IDENTITY,
    ENV_POD_NAME,
    ENV_POD_UID,
    ENV_STATE_DIR,
    ENV_USER,
    ENV_WORKER_IMAGE,
)

__all__ = [
    "LIFELINE_GRACE_MAX_S",
    "LIFELINE_GRACE_MIN_S",
    "LIFELINE_GRACE_S",
    "Settings",
    "SettingsError",
    "from_environ",
]


class Settings(BaseSettings):
    """What this notebook server was given. Read once per kernel (and lab server) from the environment."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=False)

    backend: Literal["local", "kubernetes"] = Field(
        "local", validation_alias=ENV_BACKEND, description="Where `%%tfdist` runs jobs by default."
    )
    namespace: str | None = Field(
        None,
        validation_alias=ENV_NAMESPACE,
        description="Kubernetes namespace for job objects; unset: the notebook pod's own.",
    )
    worker_image: str | None = Field(
        None, validation_alias=ENV_WORKER_IMAGE, description="Image of the PS, worker and coordinator pods."
    )
    gpus: int | None = Field(
        None,
        ge=0,
        validation_alias=ENV_GPUS,
        description="GPUs this server was given: the magic's default GPUs per worker.",
    )
    pod_name: str | None = Field(
        None,
        validation_alias=ENV_POD_NAME,
        description="The notebook pod (owner of job objects), from the downward API.",
    )
    pod_uid: str | None = Field(None, validation_alias=ENV_POD_UID, description="That pod's UID.")
    kueue_queue: str | None = Field(
        None, validation_alias=ENV_KUEUE_QUEUE, description="Kueue LocalQueue of the jobs; unset: none."
    )
    gpu_node_selector: dict[str, str] | None = Field(
        None,
        validation_alias=ENV_GPU_NODE_SELECTOR,
        description="JSON object: node selector of the profile's GPU model (the workers' pods).",
    )
    gpu_tolerations: list[dict[str, Any]] | None = Field(
        None,
        validation_alias=ENV_GPU_TOLERATIONS,
        description="JSON list: tolerations of the profile's GPU model.",
    )
    gpu_resource: str | None = Field(
        None,
        validation_alias=ENV_GPU_RESOURCE,
        description="Extended resource of the GPU model (`nvidia.com/mig-1g.10gb`, ...); unset: whole GPUs.",
    )
    data_volumes: tuple[DataMount, ...] = Field(
        (),
        validation_alias=ENV_DATA_VOLUMES,
        description="JSON list of {claim, mount, read_only}: the profile's data volumes, which every pod "
        "of the server's jobs mounts where the notebook has them; unset: none.",
    )
    pod_identity: PodIdentity = Field(
        DEFAULT_IDENTITY,
        validation_alias=ENV_POD_IDENTITY,
        description="JSON object {runAsUser, runAsGroup, fsGroup?, supplementalGroups?}: who the notebook "
        "runs as, and so every pod of its jobs (the admission policy refuses any other); unset: 1000:1000, "
        "the images' user.",
    )
    user: str = Field(
        "user",
        validation_alias=AliasChoices(ENV_USER, "JUPYTERHUB_USER", "USER"),
        description="The hub user's name (job labels); unset: JUPYTERHUB_USER, else USER.",
    )
    state_dir: str = Field(
        "",
        validation_alias=ENV_STATE_DIR,
        description="Where local jobs keep sockets, logs and results; unset: "
        "`$XDG_RUNTIME_DIR/tfdist/jobs`, else `~/.local/state/tfdist/jobs`.",
    )
    # shorter frees a dead kernel's pods sooner but needs the API server reachable more often (one update per
    # a third of it); bounded so that a kernel cannot keep its jobs alive long after it is gone
    lifeline_grace_s: int = Field(
        LIFELINE_GRACE_S,
        ge=LIFELINE_GRACE_MIN_S,
        le=LIFELINE_GRACE_MAX_S,
        validation_alias=ENV_LIFELINE_GRACE_S,
        description="Kubernetes: a kernel gone this many seconds has its attached jobs ended by the cluster.",
    )
    # only to derive state_dir's default (a per-login runtime directory when there is one)
    xdg_runtime_dir: str = Field("", validation_alias="XDG_RUNTIME_DIR", exclude=True, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_unset(cls, data: Any) -> Any:
        # the spawner writes "" for "not given"; an unset field must then fall to its default or next alias
        return {k: v for k, v in data.items() if v != ""} if isinstance(data, dict) else data

    @field_validator("gpu_node_selector", "gpu_tolerations", "data_volumes", mode="before")
    @classmethod
    def _json(cls, v: Any) -> Any:
        return json.loads(v) if isinstance(v, str) else v

    @field_validator("pod_identity", mode="before")
    @classmethod
    def _identity(cls, v: Any) -> Any:
        return PodIdentity.load(v) if isinstance(v, (str, dict)) else v

    @model_validator(mode="after")
    def _default_state_dir(self) -> Settings:
        if not self.state_dir:
            runtime = self.xdg_runtime_dir or os.path.join(os.path.expanduser("~"), ".local", "state")
            object.__setattr__(self, "state_dir", os.path.join(runtime, "tfdist", "jobs"))
        return self


class _MappingSettings(Settings):
    """Settings from an explicit mapping only (tests, benchmarks, the lab server's per-user view)."""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, **_others):  # type: ignore[override]
        return (init_settings,)


def from_environ(env: dict[str, str] | None = None) -> Settings:
    """The settings in ``env`` (default: this process's environment), or SettingsError naming the variable."""
    try:
        if env is None:
            return Settings()
        # an explicit mapping is the whole environment: nothing leaks in from this process's own
        return _MappingSettings(**dict(env))
    except ValidationError as e:
        raise SettingsError(_describe(e, os.environ if env is None else env)) from None


def _describe(e: ValidationError, env: Mapping[str, str]) -> str:
    parts = []
    for err in e.errors():
        var = str(err["loc"][0]) if err.get("loc") else "?"
        value = env.get(var, err.get("input"))  # as written, not as half-parsed
        parts.append(f"{var}={value!r} is not valid ({err['msg']})")
    return (
        "This server's tfdist settings are broken: "
        + "; ".join(parts)
        + ". The spawner sets them: ask your hub admin."
    )
