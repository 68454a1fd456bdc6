"""What both tfdist spawners share: profiles, the form, validation on every path, remembered choices.

Why a mixin: the embedded spawner (LocalProcessSpawner) and the Kubernetes one (KubeSpawner) must show the
same form and apply the same rules; only what a valid choice becomes differs (`apply_choice`), and where the
free GPU counts come from (`gpu_availability`).

Paths into validation (all call `validation.validate_options`):
- form POST: `options_from_form` -> the form comes back with the message (HTTP 400);
- REST ``POST /hub/api/users/{name}/server``: `apply_user_options` -> 400 with the message;
- ``/hub/spawn?opt-...``: `options_from_query`, like the form.
A 4xx is a "handled rejection" for JupyterHub, so bad input never counts towards
``consecutive_failure_limit`` (which restarts the hub) and never shows as a 500.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tornado import web
from traitlets import Unicode, default
from traitlets.config import LoggingConfigurable

from tfdist.settings import ENV_GPU_ADMIN_URL

from .allocator import ModelAvailability
from .form import form_to_raw, render_form
from .profiles import Profile, ProfilesConfig, ProfilesSource
from .validation import Choice, OptionsError, UserContext, validate_options

__all__ = ["GpuFormMixin", "user_error"]

_STATE_KEY = "tfdist_last_choice"
_CHOICE_KEY = "tfdist_choice"
_sources: dict[str, ProfilesSource] = {}


def user_error(message: str, status: int = 400) -> web.HTTPError:
    """An HTTPError JupyterHub shows verbatim on the form page and in the REST JSON ``message``."""
    err = web.HTTPError(status, "%s", message)  # message as an argument: a '%' in user input is safe
    err.jupyterhub_message = message  # type: ignore[attr-defined]
    return err


async def _apply_user_options_hook(spawner: Any, user_options: Mapping[str, Any]) -> None:
    await spawner.tfdist_apply(user_options)


class GpuFormMixin(LoggingConfigurable):
    """Mix in before the concrete Spawner class: ``class S(GpuFormMixin, LocalProcessSpawner)``."""

    profiles_file = Unicode(
        "",
        config=True,
        help="""Path of the GPU profiles YAML (see hub_config/profiles.yaml). Re-read when it changes; a file
        broken while the hub runs keeps the last good profiles. Load it once in jupyterhub_config.py with
        tfdist.spawner.profiles.load_profiles_or_exit so a broken file stops the hub at start.""",
    )

    gpu_admin_report_url = Unicode(
        "",
        config=True,
        help="""Where each server pushes its GPU activity (TFDIST_GPU_ADMIN_URL in its environment): the
        GPU admin service's report route. Set by tfdist.hubadmin.hubconfig.enable_gpu_admin; empty: none.""",
    )

    #: where this spawner's GPUs are, as the form and its messages name it
    tfdist_place = "This machine"

    # set when options were validated for this spawn; persisted in state so a restarted hub knows
    tfdist_choice: Choice | None = None
    _tfdist_last_valid: dict[str, Any] | None = None
    _tfdist_submitted: dict[str, Any] | None = None
    _tfdist_applied_for: Any = None

    # ---- hooks for the concrete spawners -------------------------------------------------------------

    async def gpu_availability(self) -> dict[str, ModelAvailability] | None:
        """Free/total GPUs per model key now; None when unknown (e.g. the cluster view is not loaded)."""
        return None

    def apply_choice(self, choice: Choice, profile: Profile, cfg: ProfilesConfig) -> None:
        """Turn a validated choice into this spawner's traits (override)."""
        raise NotImplementedError

    def queues_gpu_servers(self, cfg: ProfilesConfig) -> bool:
        """Whether GPU servers of profiles with a Kueue queue wait in it (then a shortage is no refusal)."""
        return False

    async def queue_waiting(self, cfg: ProfilesConfig) -> dict[str, int] | None:
        """Workloads waiting per Kueue queue now, for the form; None when unknown or not queued."""
        return None

    async def largest_node_gpus(self, cfg: ProfilesConfig) -> dict[str, int] | None:
        """The most GPUs per model one node has in all (Kubernetes); None when unknown or not applicable."""
        return None

    # ---- shared plumbing ------------------------------------------------------------------------------

    def get_env(self) -> dict[str, Any]:
        """The server reports to the GPU admin service with its own token; this says where."""
        env: dict[str, Any] = super().get_env()  # type: ignore[misc]
        if self.gpu_admin_report_url:
            env[ENV_GPU_ADMIN_URL] = self.gpu_admin_report_url
        return env

    def tfdist_profiles(self) -> ProfilesConfig:
        if not self.profiles_file:
            raise user_error("The hub has no GPU profiles file configured (profiles_file).", 500)
        src = _sources.get(self.profiles_file)
        if src is None:
            src = _sources[self.profiles_file] = ProfilesSource(self.profiles_file)
        cfg = src.get()
        if src.last_error is not None:
            self.log.error("Keeping the last good GPU profiles; the file is broken now:\n%s", src.last_error)
        return cfg

    def tfdist_groups(self) -> frozenset[str]:
        try:
            return frozenset(g.name for g in self.user.groups)
        except AttributeError:
            return frozenset()

    def tfdist_gpus_held_elsewhere(self) -> int:
        """GPUs held by this user's other servers that are running or starting (for the per-user cap)."""
        total = 0
        for sp in getattr(self.user, "spawners", {}).values():
            if sp is self or not getattr(sp, "active", False):
                continue
            choice = getattr(sp, "tfdist_choice", None)
            if choice is not None:
                total += choice.gpus
        return total

    async def tfdist_context(self, with_availability: bool = True, with_queues: bool = False) -> UserContext:
        av = await self.gpu_availability() if with_availability else None
        cfg = self.tfdist_profiles()
        queued = self.queues_gpu_servers(cfg)
        return UserContext(
            queues_gpu_servers=queued,
            queue_waiting=await self.queue_waiting(cfg) if queued and with_queues else None,
            largest_node_gpus=await self.largest_node_gpus(cfg) if queued and with_availability else None,
            groups=self.tfdist_groups(),
            gpus_held_elsewhere=self.tfdist_gpus_held_elsewhere(),
            free_gpus={k: a.free for k, a in av.items()} if av is not None else None,
            max_free_on_node=(
                {k: a.max_on_node for k, a in av.items() if a.max_on_node is not None}
                if av is not None
                else None
            ),
            gpus_total={k: a.total for k, a in av.items()} if av is not None else None,
            place=self.tfdist_place,
        )

    def tfdist_validate(self, raw: Any, cfg: ProfilesConfig, ctx: UserContext) -> Choice:
        try:
            return validate_options(raw, cfg, ctx)
        except OptionsError as e:
            self.log.info("Rejected options for %s: %s", self._log_name, e.message)
            raise user_error(e.message) from None
        except (ValueError, TypeError, ArithmeticError) as e:  # a case the checks missed: still a 400
            self.log.warning("Unexpected options error for %s: %r", self._log_name, e)
            raise user_error(f"These options cannot be used ({type(e).__name__}).") from None

    # ---- the form -------------------------------------------------------------------------------------

    @default("options_form")
    def _tfdist_options_form_default(self) -> Any:
        return _render_options_form

    async def tfdist_render_form(self) -> str:
        cfg = self.tfdist_profiles()
        ctx = await self.tfdist_context(with_availability=False, with_queues=True)
        availability = await self.gpu_availability()
        submitted, self._tfdist_submitted = self._tfdist_submitted, None
        return render_form(
            cfg,
            ctx,
            availability,
            remembered=(self._tfdist_last_valid, dict(self.user_options or {})),
            submitted=submitted,
        )

    @default("options_from_form")
    def _tfdist_options_from_form_default(self) -> Any:
        return self._tfdist_options_from_form

    async def _tfdist_options_from_form(self, formdata: Mapping[str, Any]) -> dict[str, Any]:
        raw = form_to_raw(formdata)
        cfg = self.tfdist_profiles()
        try:
            choice = self.tfdist_validate(raw, cfg, await self.tfdist_context())
        except web.HTTPError:
            # JupyterHub re-renders the form of the user's default server; keep what they typed there
            target = getattr(self.user, "spawner", None) or self
            target._tfdist_submitted = {k: v for k, v in raw.items() if isinstance(v, str)}
            raise
        return choice.as_user_options()

    def options_from_query(self, query_data: Mapping[str, Any]) -> Any:
        # A GET carries no XSRF token: a link from another site must not start (GPU) servers.
        raise user_error("Servers with options start from the form or the REST API, not from a link.")

    # ---- every spawn, whatever path it came by --------------------------------------------------------

    @default("apply_user_options")
    def _tfdist_apply_user_options_default(self) -> Any:
        return _apply_user_options_hook

    async def tfdist_apply(self, user_options: Mapping[str, Any] | None) -> Choice:
        """Validate (again: REST skips the form) and apply; HTTP 400 with the message when invalid."""
        cfg = self.tfdist_profiles()
        opts = dict(user_options or {})
        choice = self.tfdist_validate(opts, cfg, await self.tfdist_context())
        profile = cfg.profile(choice.profile)
        assert profile is not None  # validated
        self.apply_choice(choice, profile, cfg)
        self.tfdist_choice = choice
        # What was applied, not what was asked, is the server's user_options (the hub stores them, and the
        # GPU admin service reads the profile and GPU count there): `{}` over REST starts the first
        # allowed profile's defaults, which the raw request does not name.
        applied = choice.as_user_options()
        self.user_options = applied
        orm = getattr(self, "orm_spawner", None)
        if orm is not None:
            orm.user_options = dict(applied)
        self._tfdist_applied_for = self.user_options
        self._tfdist_last_valid = dict(applied)
        return choice

    async def tfdist_ensure_applied(self) -> Choice:
        """For start(): apply here if an admin's own apply_user_options replaced ours."""
        if self.tfdist_choice is None or self._tfdist_applied_for is not self.user_options:
            return await self.tfdist_apply(self.user_options)
        return self.tfdist_choice

    # ---- state: the last valid choice outlives stop (clear_state keeps it) ----------------------------

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()  # type: ignore[misc]
        if self._tfdist_last_valid:
            state[_STATE_KEY] = self._tfdist_last_valid
        if self.tfdist_choice is not None:
            state[_CHOICE_KEY] = self.tfdist_choice.as_user_options()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)  # type: ignore[misc]
        last = state.get(_STATE_KEY)
        if isinstance(last, dict):
            self._tfdist_last_valid = json.loads(json.dumps(last))
        chosen = state.get(_CHOICE_KEY)
        if isinstance(chosen, dict):
            try:
                cfg = self.tfdist_profiles()
                p = cfg.profile(str(chosen.get("profile")))
                self.tfdist_choice = Choice(
                    profile=str(chosen["profile"]),
                    cpu=float(chosen["cpu"]),
                    memory_gib=float(chosen["memory"]),
                    gpus=int(chosen.get("gpus", 0)),
                    gpu_model=chosen.get("gpu_model") if p is not None else None,
                    image=str(chosen["image"]),
                )
            except (KeyError, TypeError, ValueError, web.HTTPError):
                self.tfdist_choice = None

    def clear_state(self) -> None:
        super().clear_state()  # type: ignore[misc]
        self.tfdist_choice = None
        self._tfdist_applied_for = None


async def _render_options_form(spawner: Any) -> str:
    return await spawner.tfdist_render_form()
