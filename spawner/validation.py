"""The one check of what a user asked for: used by the form POST and by the REST API alike.

Pure: no I/O, no spawner. It takes the raw options (form strings or REST JSON values), the admin profiles
and what is known about the user and the GPUs, and returns a `Choice` or raises `OptionsError` whose text is
shown to the user as is (the form comes back with it; the REST API answers 400 with it). Every rule is here
so the two paths can never drift apart (kubespawner validates the form in the browser with a full-match
`pattern` but on the server with a prefix `re.match`, and lets unknown choice keys through to a KeyError).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .profiles import GpuModel, Profile, ProfilesConfig

__all__ = [
    "OPTION_KEYS",
    "Choice",
    "OptionsError",
    "UserContext",
    "gpu_queue",
    "queue_refusal",
    "show_value",
    "validate_options",
]

#: Every key user_options may have. Anything else is rejected, never ignored.
OPTION_KEYS = ("profile", "cpu", "memory", "gpus", "gpu_model", "image")
_MAX_STR = 512
# ASCII only: Python's float()/int() also accept '١٢' (Arabic-Indic digits), '1_000', '1e3' and ' inf '.
_DECIMAL = re.compile(r"-?[0-9]{1,40}(\.[0-9]{1,9})?", re.ASCII)
_WHOLE = re.compile(r"-?[0-9]{1,40}", re.ASCII)


class OptionsError(ValueError):
    """Bad user options. `str(e)` is the message for the user; `field` names the option (or None)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass(frozen=True)
class UserContext:
    """What validation needs to know beyond the options themselves."""

    groups: frozenset[str] = frozenset()
    #: GPUs this user's other running or starting servers hold (for the per-user cap)
    gpus_held_elsewhere: int = 0
    #: free GPUs per model key right now; None when unknown (then the scheduler decides)
    free_gpus: Mapping[str, int] | None = None
    #: most GPUs free on any one node per model key (Kubernetes: one pod's GPUs are on one node); None, or
    #: a model missing, when not applicable (the embedded hub is one machine) or unknown
    max_free_on_node: Mapping[str, int] | None = None
    #: all GPUs (free or not) per model key; None when unknown. Known and 0 for every model of a GPU
    #: profile: the hub has no GPU for it, so it is not offered and cannot be chosen
    gpus_total: Mapping[str, int] | None = None
    #: where the GPUs are, as messages name it ("This machine", "The cluster")
    place: str = "This hub"
    #: GPU servers of a profile with a Kueue queue (``kueue_queue`` and a ``kueue:`` section) wait in that
    #: queue (the Kubernetes spawner): a shortage now is no refusal, only what the queue can never hold is
    queues_gpu_servers: bool = False
    #: Workloads waiting per queue name now, for the form; None when unknown
    queue_waiting: Mapping[str, int] | None = None
    #: the most GPUs per model key one node has in all (free or not); None, or a model missing, when
    #: unknown: a queued server asking for more could never start
    largest_node_gpus: Mapping[str, int] | None = None


def gpu_queue(profile: Profile, cfg: ProfilesConfig, ctx: UserContext) -> str | None:
    """The Kueue queue a GPU server of ``profile`` waits in, or None when it starts now or not at all."""
    if ctx.queues_gpu_servers and cfg.kueue is not None and profile.kueue_queue:
        return profile.kueue_queue
    return None


def queue_refusal(cfg: ProfilesConfig, queue: str, model: str, gpus: int) -> str | None:
    """Why ``gpus`` GPUs of ``model`` can never start in ``queue`` (the numbers in one sentence), or None."""
    from tfdist.kube.queueing import gpu_capacity

    name = cfg.gpu_models[model].display_name
    cap = gpu_capacity(cfg, queue, model)
    if cap is None:
        return f"{name}: queue {queue} has no quota for {name} GPUs, so this server could never start."
    most = int(cap.maximum)
    if gpus <= most:
        return None
    return (
        f"{name}: you asked for {gpus} GPUs, but queue {queue} can never hold more than {most} "
        f"(its quota {int(cap.nominal)} + {int(cap.borrowable)} it may borrow), so this server could never "
        f"start. Ask for at most {most}."
    )


def lacks_gpus(profile: Profile, ctx: UserContext) -> bool:
    """A GPU profile on a hub known to have none of its GPU models (a machine without GPUs)."""
    if not profile.offers_gpus or ctx.gpus_total is None:
        return False
    return sum(max(int(ctx.gpus_total.get(m, 0)), 0) for m in profile.gpu_models) == 0


@dataclass(frozen=True)
class Choice:
    """A validated choice: what the spawner applies and what is remembered as the user's last choice."""

    profile: str
    cpu: float
    memory_gib: float
    gpus: int
    gpu_model: str | None
    image: str
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def memory_bytes(self) -> int:
        return round(self.memory_gib * 2**30)

    def as_user_options(self) -> dict[str, Any]:
        """Canonical user_options (JSON types); validating them again yields the same Choice."""
        out: dict[str, Any] = {
            "profile": self.profile,
            "cpu": self.cpu,
            "memory": self.memory_gib,
            "gpus": self.gpus,
            "image": self.image,
        }
        if self.gpu_model is not None:
            out["gpu_model"] = self.gpu_model
        return out


def show_value(v: Any, limit: int = 60) -> str:
    """A user-supplied value for a message: quoted and cut short; JSON words for non-strings."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, str):
        r = repr(v)
        return r if len(r) <= limit else r[: limit - 2] + "…'"
    return f"a {type(v).__name__}"


def _fmt(x: float) -> str:
    return f"{x:g}"


def _number(raw: Any, key: str, label: str, unit_hint: str) -> float:
    """A JSON number, or a string of plain ASCII decimal digits (from the form)."""
    if isinstance(raw, bool) or raw is None or isinstance(raw, (list, dict)):
        raise OptionsError(f"{label} must be a number {unit_hint}, got {show_value(raw)}.", key)
    if isinstance(raw, (int, float)):
        try:
            val = float(raw)
        except OverflowError:
            raise OptionsError(f"{label} is out of range {unit_hint}.", key) from None
        if not math.isfinite(val):
            raise OptionsError(f"{label} must be a finite number {unit_hint}, got {show_value(raw)}.", key)
        return val
    if isinstance(raw, str):
        s = raw.strip(" \t")
        if len(raw) <= 64 and _DECIMAL.fullmatch(s):
            return float(s)
        hint = ""
        if re.search(r"[0-9]\s*[A-Za-z]", raw):
            hint = " Write the number only; the unit is fixed."
        raise OptionsError(
            f"{label} must be a number {unit_hint}, using digits 0-9 and at most one '.', "
            f"got {show_value(raw)}.{hint}",
            key,
        )
    raise OptionsError(f"{label} must be a number {unit_hint}, got {show_value(raw)}.", key)


def _whole(raw: Any, key: str, label: str) -> int:
    if isinstance(raw, bool) or raw is None or isinstance(raw, (list, dict, float)):
        raise OptionsError(f"{label} must be a whole number like 0, 1 or 2, got {show_value(raw)}.", key)
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        s = raw.strip(" \t")
        if len(raw) <= 64 and _WHOLE.fullmatch(s):
            return int(s)
        raise OptionsError(f"{label} must be a whole number like 0, 1 or 2, got {show_value(raw)}.", key)
    raise OptionsError(f"{label} must be a whole number like 0, 1 or 2, got {show_value(raw)}.", key)


def _string(raw: Any, key: str, label: str) -> str:
    if not isinstance(raw, str):
        raise OptionsError(f"{label} must be a string, got {show_value(raw)}.", key)
    if len(raw) > _MAX_STR:
        raise OptionsError(f"{label} is too long ({len(raw)} characters; at most {_MAX_STR}).", key)
    return raw


def _in_range(val: float, lo: float, hi: float, key: str, label: str, unit: str, profile: Profile) -> None:
    if not lo <= val <= hi:
        raise OptionsError(
            f"{label} must be between {_fmt(lo)} and {_fmt(hi)}{unit} in profile "
            f"{profile.display_name!r}, got {_fmt(val)}.",
            key,
        )


def _within_share(model: GpuModel, gpus: int, cpu: float, mem: float) -> None:
    """A node's share per GPU (GpuModel.cpu_per_gpu): more CPUs or memory than `gpus` shares would keep the
    node's other GPUs from everyone (the admission policy bounds %%tfdist's pods the same way)."""
    for per, asked, key, label, unit in (
        (model.cpu_per_gpu, cpu, "cpu", "CPU", " cores"),
        (model.memory_gib_per_gpu, mem, "memory", "Memory", " GiB"),
    ):
        if per is not None and asked > per * gpus:
            raise OptionsError(
                f"{label}: at most {_fmt(per)}{unit} per GPU of {model.display_name} (a node's share per "
                f"GPU), so at most {_fmt(per * gpus)}{unit} with {gpus} GPU{'s' if gpus != 1 else ''}; "
                f"you asked for {_fmt(asked)}. Ask for less, or for more GPUs.",
                key,
            )


def _required_keys(profile: Profile) -> list[str]:
    keys = ["profile", "cpu", "memory", "image"]
    if profile.offers_gpus:
        keys.append("gpus")
    return keys


def _defaults(cfg: ProfilesConfig, ctx: UserContext) -> dict[str, Any]:
    allowed = cfg.allowed_profiles(ctx.groups)
    if not allowed:
        raise OptionsError(
            "No profile is available to you. Ask a hub admin to add you to a group.", "profile"
        )
    p = next((q for q in allowed if not lacks_gpus(q, ctx)), allowed[0])
    out: dict[str, Any] = {
        "profile": p.slug,
        "cpu": p.cpu.default,
        "memory": p.memory_gib.default,
        "image": p.images[0].image,
    }
    if p.offers_gpus:
        out["gpus"] = p.gpus.default
        out["gpu_model"] = p.default_model
    return out


def validate_options(raw: Any, cfg: ProfilesConfig, ctx: UserContext) -> Choice:
    """Check user options against the profiles; return the Choice or raise OptionsError.

    No options at all (``{}``) means the defaults of the first profile the user may use (what the admin
    panel's "start server" and a bare REST POST send). Otherwise every key the profile needs must be there.
    """
    if not isinstance(raw, Mapping):
        raise OptionsError(f"Options must be an object of option names to values, got {show_value(raw)}.")
    unknown = sorted(str(k) for k in raw if k not in OPTION_KEYS)
    if unknown:
        shown = ", ".join(show_value(k, 40) for k in unknown[:5]) + (" …" if len(unknown) > 5 else "")
        raise OptionsError(f"Unknown option(s): {shown}. Known options: {', '.join(OPTION_KEYS)}.")
    opts: Mapping[str, Any] = raw if raw else _defaults(cfg, ctx)

    if "profile" not in opts:
        raise OptionsError("Missing option: profile.", "profile")
    slug = _string(opts["profile"], "profile", "profile")
    profile = cfg.profile(slug)
    if profile is None:
        names = ", ".join(p.slug for p in cfg.allowed_profiles(ctx.groups)) or "none"
        raise OptionsError(f"No such profile: {show_value(slug)}. Profiles you may use: {names}.", "profile")
    if not profile.allowed_for(ctx.groups):
        raise OptionsError(
            f"Profile {profile.display_name!r} is not available to you: it is for the groups "
            f"{', '.join(profile.groups)}, and you are in none of them.",
            "profile",
        )
    if lacks_gpus(profile, ctx):
        others = [p.display_name for p in cfg.allowed_profiles(ctx.groups) if not lacks_gpus(p, ctx)]
        what = "has no GPUs" if not any(ctx.gpus_total.values()) else "has none of this profile's GPU models"
        hint = (
            f"Choose a profile without GPUs: {', '.join(repr(n) for n in others)}."
            if others
            else "Ask a hub admin for a profile without GPUs."
        )
        raise OptionsError(
            f"{ctx.place} {what}, so profile {profile.display_name!r} cannot start here. {hint}", "profile"
        )
    missing = [k for k in _required_keys(profile) if k not in opts]
    if missing:
        raise OptionsError(
            f"Missing option(s): {', '.join(missing)}. Profile {profile.display_name!r} needs "
            f"{', '.join(_required_keys(profile))} (or send no options at all for its defaults).",
            missing[0],
        )

    cpu = _number(opts["cpu"], "cpu", "CPU", "of cores like 2 or 0.5")
    _in_range(cpu, profile.cpu.min, profile.cpu.max, "cpu", "CPU", " cores", profile)
    mem = _number(opts["memory"], "memory", "Memory", "of GiB like 4 or 0.5")
    _in_range(mem, profile.memory_gib.min, profile.memory_gib.max, "memory", "Memory", " GiB", profile)

    gpus = 0
    model: str | None = None
    if not profile.offers_gpus:
        if "gpus" in opts:
            g = _whole(opts["gpus"], "gpus", "GPUs")
            if g != 0:
                raise OptionsError(
                    f"Profile {profile.display_name!r} offers no GPUs, so GPUs must be 0, got {g}.", "gpus"
                )
        if opts.get("gpu_model") not in (None, ""):
            raise OptionsError(f"Profile {profile.display_name!r} offers no GPU model.", "gpu_model")
    else:
        gpus = _whole(opts["gpus"], "gpus", "GPUs")
        if gpus < 0:
            raise OptionsError(f"GPUs cannot be negative, got {gpus}.", "gpus")
        _in_range(gpus, profile.gpus.min, profile.gpus.max, "gpus", "GPUs", "", profile)
        raw_model = opts.get("gpu_model")
        if raw_model in (None, ""):
            if gpus > 0:
                raise OptionsError(
                    f"Missing option: gpu_model (one of {', '.join(profile.gpu_models)}).", "gpu_model"
                )
        else:
            m = _string(raw_model, "gpu_model", "gpu_model")
            if m not in profile.gpu_models:
                raise OptionsError(
                    f"No GPU model {show_value(m)} in profile {profile.display_name!r}; "
                    f"choose one of: {', '.join(profile.gpu_models)}.",
                    "gpu_model",
                )
            model = m if gpus > 0 else None
    if model is not None:
        _within_share(cfg.gpu_models[model], gpus, cpu, mem)

    image = _string(opts["image"], "image", "image")
    listed = {i.image for i in profile.images}
    if image not in listed:
        custom = profile.custom_image
        if custom is None:
            raise OptionsError(
                f"Image {show_value(image)} is not on the list for profile {profile.display_name!r}, "
                "and this profile allows no other image.",
                "image",
            )
        if not custom.matches(image):
            help_text = f" ({custom.help})" if custom.help else ""
            raise OptionsError(
                f"Image {show_value(image)} is not on the list and does not fully match the pattern for "
                f"other images{help_text}.",
                "image",
            )

    if gpus > 0 and profile.max_gpus_per_user is not None:
        cap = profile.max_gpus_per_user
        held = ctx.gpus_held_elsewhere
        if held + gpus > cap:
            left = max(cap - held, 0)
            raise OptionsError(
                f"You may hold at most {cap} GPUs across all your servers with profile "
                f"{profile.display_name!r}; your other servers hold {held}, so you can ask for at most "
                f"{left} now (you asked for {gpus}).",
                "gpus",
            )

    queue = gpu_queue(profile, cfg, ctx)
    if gpus > 0 and model is not None and queue is not None:
        # a shortage now is a wait in the queue (Kueue admits the server when a GPU frees); only what the
        # queue can never hold is refused, before anything is created
        why = queue_refusal(cfg, queue, model, gpus)
        if why is not None:
            raise OptionsError(why, "gpus")
        biggest = (ctx.largest_node_gpus or {}).get(model)
        if biggest is not None and gpus > biggest:
            name = cfg.gpu_models[model].display_name
            raise OptionsError(
                f"{name}: you asked for {gpus} GPUs, but no node has more than {biggest} {name} GPUs in all, "
                f"and a server's GPUs must all be on one node, so this server could never start. Ask for at "
                f"most {biggest}.",
                "gpus",
            )
        return Choice(profile=profile.slug, cpu=cpu, memory_gib=mem, gpus=gpus, gpu_model=model, image=image)

    if gpus > 0 and model is not None and ctx.free_gpus is not None:
        free = max(int(ctx.free_gpus.get(model, 0)), 0)
        if gpus > free:
            name = cfg.gpu_models[model].display_name
            raise OptionsError(
                f"{name}: you asked for {gpus} GPU{'s' if gpus != 1 else ''} but only {free} free right now.",
                "gpus",
            )

    if gpus > 0 and model is not None and ctx.max_free_on_node is not None and model in ctx.max_free_on_node:
        most = max(int(ctx.max_free_on_node[model]), 0)
        if gpus > most:
            name = cfg.gpu_models[model].display_name
            total = (
                f" ({max(int(ctx.free_gpus.get(model, 0)), 0)} free in total across nodes)"
                if ctx.free_gpus is not None
                else ""
            )
            gpus_are = "GPUs are" if most != 1 else "GPU is"
            raise OptionsError(
                f"{name}: you asked for {gpus} GPUs, but at most {most} {name} {gpus_are} free on one node "
                f"now{total}, and a server's GPUs must all be on one node. Ask for at most {most}.",
                "gpus",
            )

    return Choice(profile=profile.slug, cpu=cpu, memory_gib=mem, gpus=gpus, gpu_model=model, image=image)
