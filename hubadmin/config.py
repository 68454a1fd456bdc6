"""The ``gpu_admin:`` section of the profiles YAML: what hub admins set for GPU-idle culling.

Why a section of the profiles file (not traitlets): thresholds are per profile, and a threshold naming a
profile that does not exist, or a negative time, must stop the hub with file, key and reason the way the
rest of the file does (`tfdist.spawner.profiles.parse_profiles`). Kept apart from the profiles models so the
spawner's file and this one change independently; `ProfilesConfig.gpu_admin` holds it.

```yaml
gpu_admin:
  culling:
    check_interval_s: 60          # how often the service looks at every GPU server
    default:                      # every GPU profile not listed below
      idle_below_percent: 5       # a GPU below this utilization counts as idle
      idle_minutes: 60            # idle this long (all of the server's GPUs) -> stopped
      warn_minutes: 10            # the user is warned this long before
      cull_during_jobs: false     # never stop a server while one of its %%tfdist jobs runs
    profiles:
      gpu-large: {idle_minutes: 20}
```
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["MAX_IDLE_MINUTES", "CullingConfig", "CullingRule", "GpuAdmin"]

#: the servers' activity trackers keep six hours (tfdist.labserver.activity.RETENTION_S)
MAX_IDLE_MINUTES = 360.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CullingRule(_Strict):
    """When a GPU server counts as idle, and what happens then."""

    enabled: bool = True
    idle_below_percent: float = Field(5.0, gt=0, le=100)
    idle_minutes: float = Field(60.0, gt=0, le=MAX_IDLE_MINUTES)
    warn_minutes: float = Field(10.0, ge=0)
    cull_during_jobs: bool = False

    @model_validator(mode="after")
    def _sane(self) -> CullingRule:
        for name in ("idle_below_percent", "idle_minutes", "warn_minutes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number")
        if self.warn_minutes >= self.idle_minutes:
            raise ValueError(
                f"warn_minutes ({self.warn_minutes:g}) must be below idle_minutes ({self.idle_minutes:g})"
            )
        return self


class _RuleOverride(_Strict):
    """A profile's changes to the default rule (unset fields keep the default's value)."""

    enabled: bool | None = None
    idle_below_percent: float | None = Field(None, gt=0, le=100)
    idle_minutes: float | None = Field(None, gt=0, le=MAX_IDLE_MINUTES)
    warn_minutes: float | None = Field(None, ge=0)
    cull_during_jobs: bool | None = None


class CullingConfig(_Strict):
    """GPU-idle culling; absent from the file: no server is culled for an idle GPU."""

    check_interval_s: float = Field(60.0, gt=0, le=3600)
    default: CullingRule = Field(default_factory=CullingRule)
    profiles: dict[str, _RuleOverride] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _merged_rules_valid(self) -> CullingConfig:
        for slug in self.profiles:
            try:
                self.rule(slug)
            except ValidationError as e:  # the merged rule breaks a rule-wide check (warn vs idle time)
                why = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
                raise ValueError(f"profiles.{slug}: {why}") from None
        return self

    def rule(self, profile: str | None) -> CullingRule:
        over = self.profiles.get(profile or "")
        if over is None:
            return self.default
        merged: dict[str, Any] = self.default.model_dump()
        merged.update(over.model_dump(exclude_none=True))
        return CullingRule.model_validate(merged)


class GpuAdmin(_Strict):
    """The whole ``gpu_admin:`` section."""

    culling: CullingConfig | None = None

    def check_references(self, profile_slugs: set[str]) -> None:
        """Called by the profiles model: every profile named here must exist (a typo would cull nothing)."""
        if self.culling is None:
            return
        for slug in self.culling.profiles:
            if slug not in profile_slugs:
                known = ", ".join(sorted(profile_slugs))
                raise ValueError(
                    f"gpu_admin.culling.profiles names {slug!r}, which is not a profile (profiles: {known})"
                )
