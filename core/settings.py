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

from tfdist.errors import TfdistError

ENV_BACKEND = "TFDIST_BACKEND"  # "local" (default) or "kubernetes"
ENV_NAMESPACE = "TFDIST_NAMESPACE"  # Kubernetes namespace for job objects
ENV_WORKER_IMAGE = "TFDIST_WORKER_IMAGE"  # image of PS/worker/coordinator pods
ENV_GPUS = "TFDIST_GPUS"  # number of GPUs this server was given (the magic's default GPUs per worker)
ENV_GPU_MODEL = "TFDIST_GPU_MODEL"  # GPU model key of the profile: for the user's own code, tfdist reads none
ENV_POD_NAME = "TFDIST_POD_NAME"  # the notebook pod (owner of job objects), via the downward API
ENV_POD_UID = "TFDIST_POD_UID"
ENV_KUEUE_QUEUE = "TFDIST_KUEUE_QUEUE"  # optional Kueue LocalQueue name
ENV_GPU_NODE_SELECTOR = "TFDIST_GPU_NODE_SELECTOR"  # JSON: node selector of the GPU model (workers' pods)
ENV_GPU_TOLERATIONS = "TFDIST_GPU_TOLERATIONS"  # JSON list: tolerations of the GPU model
ENV_GPU_RESOURCE = "TFDIST_GPU_RESOURCE"  # extended resource of the GPU model (nvidia.com/mig-1g.10gb, ...)
ENV_USER = "TFDIST_USER"  # the hub user name (labels); falls back to JUPYTERHUB_USER / $USER
ENV_STATE_DIR = "TFDIST_STATE_DIR"  # where local jobs keep sockets, logs and results
ENV_LIFELINE_GRACE_S = "TFDIST_LIFELINE_GRACE_S"  # kernel gone this long: the cluster ends its attached jobs
# the grace's default and bounds: the spawner's lifeline_grace_seconds takes the same (the one contract)
LIFELINE_GRACE_S, LIFELINE_GRACE_MIN_S, LIFELINE_GRACE_MAX_S = 60, 15, 3600


class SettingsError(TfdistError):
    """The server's environment holds a value the spawner would never write."""


class Settings(BaseSettings):
    """What this notebook server was given. Read once per kernel (and lab server) from the environment."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=False)

    backend: Literal["local", "kubernetes"] = Field("local", validation_alias=ENV_BACKEND)
    namespace: str | None = Field(None, validation_alias=ENV_NAMESPACE)
    worker_image: str | None = Field(None, validation_alias=ENV_WORKER_IMAGE)
    gpus: int | None = Field(None, ge=0, validation_alias=ENV_GPUS)
    pod_name: str | None = Field(None, validation_alias=ENV_POD_NAME)
    pod_uid: str | None = Field(None, validation_alias=ENV_POD_UID)
    kueue_queue: str | None = Field(None, validation_alias=ENV_KUEUE_QUEUE)
    gpu_node_selector: dict[str, str] | None = Field(None, validation_alias=ENV_GPU_NODE_SELECTOR)
    gpu_tolerations: list[dict[str, Any]] | None = Field(None, validation_alias=ENV_GPU_TOLERATIONS)
    gpu_resource: str | None = Field(None, validation_alias=ENV_GPU_RESOURCE)
    user: str = Field("user", validation_alias=AliasChoices(ENV_USER, "JUPYTERHUB_USER", "USER"))
    state_dir: str = Field("", validation_alias=ENV_STATE_DIR)
    # shorter frees a dead kernel's pods sooner but needs the API server reachable more often (one update per
    # a third of it); bounded so that a kernel cannot keep its jobs alive long after it is gone
    lifeline_grace_s: int = Field(
        LIFELINE_GRACE_S,
        ge=LIFELINE_GRACE_MIN_S,
        le=LIFELINE_GRACE_MAX_S,
        validation_alias=ENV_LIFELINE_GRACE_S,
    )
    # only to derive state_dir's default (a per-login runtime directory when there is one)
    xdg_runtime_dir: str = Field("", validation_alias="XDG_RUNTIME_DIR", exclude=True, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_unset(cls, data: Any) -> Any:
        # the spawner writes "" for "not given"; an unset field must then fall to its default or next alias
        return {k: v for k, v in data.items() if v != ""} if isinstance(data, dict) else data

    @field_validator("gpu_node_selector", "gpu_tolerations", mode="before")
    @classmethod
    def _json(cls, v: Any) -> Any:
        return json.loads(v) if isinstance(v, str) else v

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
