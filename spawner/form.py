"""The spawn form: profiles a user may use, bounded inputs, GPU models with their free counts, images.

Why a module of its own: rendering is pure (profiles + availability + remembered values in, HTML out), so it
is fast to test and benchmark, and it never decides what is valid: it only helps the user stay inside what
`validation.validate_options` accepts. Jinja2 autoescaping is on, so anything an admin (display names,
descriptions) or a user (remembered values) wrote is escaped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from .allocator import ModelAvailability
from .profiles import FloatRange, Profile, ProfilesConfig
from .validation import UserContext, gpu_queue, lacks_gpus, queue_refusal, validate_options

__all__ = ["CUSTOM_IMAGE", "form_to_raw", "render_form"]

#: value of the image <select> option that means "use the free-form image field"
CUSTOM_IMAGE = "__custom__"
#: the free-form image field's name; only the form uses it (REST sends the image itself)
CUSTOM_IMAGE_FIELD = "image_custom"

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def form_to_raw(formdata: Mapping[str, Any]) -> dict[str, Any]:
    """Form POST data ({name: [values]}) to raw options for validation; parsing only, no judgement.

    A field sent more than once stays a list, so validation rejects it as the wrong type instead of this
    function silently keeping the first value.
    """
    raw: dict[str, Any] = {}
    for key, values in formdata.items():
        if key == "_xsrf":
            continue
        if isinstance(values, (list, tuple)):
            raw[key] = values[0] if len(values) == 1 else list(values)
        else:
            raw[key] = values
    if raw.get("image") == CUSTOM_IMAGE:
        raw["image"] = raw.pop(CUSTOM_IMAGE_FIELD, "")
    elif isinstance(raw.get(CUSTOM_IMAGE_FIELD), str):
        raw.pop(CUSTOM_IMAGE_FIELD)  # the hidden free-form field, left empty or stale
    if "gpu_model" in raw and raw.get("gpus") in ("0", 0) and isinstance(raw["gpu_model"], str):
        raw["gpu_model"] = ""  # the model <select> is always sent; with 0 GPUs it means nothing
    return raw


@dataclass
class _ModelView:
    key: str
    display_name: str
    free: int | None
    total: int | None
    selected: bool
    #: most free on one node (Kubernetes); None when not applicable or unknown
    max_on_node: int | None = None
    #: the Kueue queue a server of this model waits in when no GPU is free (then `free` is None: the
    #: browser caps the GPU count by nothing but the queue's own limit, and `free_now` is shown)
    queue: str | None = None
    #: Workloads waiting in that queue now (None: unknown)
    waiting: int | None = None
    #: GPUs free now, shown beside the queue
    free_now: int | None = None
    #: the queue can never hold one GPU of this model
    never: bool = False
    #: the most GPUs of this model a queued server can ever get (the queue's quota plus what it may
    #: borrow, and the largest node's GPUs): the browser caps the count there, as validation does
    queue_max: int | None = None

    @property
    def fit(self) -> int | None:
        """The largest GPU count of this model a spawn can get now (None: unknown)."""
        if self.free is None:
            return None
        return min(self.free, self.max_on_node) if self.max_on_node is not None else self.free

    @property
    def split(self) -> bool:
        """Free GPUs are spread over nodes: fewer fit one server than are free in total."""
        return self.free is not None and self.max_on_node is not None and self.max_on_node < self.free

    @property
    def disabled(self) -> bool:
        none_here = self.queue is not None and self.total == 0
        return self.never or none_here or (self.fit is not None and self.fit <= 0)

    @property
    def status(self) -> str:
        if self.queue is not None:
            return self._queue_status()
        if self.free is None:
            return "availability unknown"
        if self.total == 0:
            return "none on this hub"
        if self.split:
            return f"{self.free} of {self.total} free, at most {self.max_on_node} on one node"
        return f"{self.free} of {self.total} free"

    def _queue_status(self) -> str:
        if self.never:
            return f"queue {self.queue} has no quota for it"
        if self.total == 0:
            return "none on this hub"
        free = "availability unknown" if self.free_now is None else f"{self.free_now} free"
        line = (
            f"{self.waiting} waiting in {self.queue}"
            if self.waiting is not None
            else f"waits in queue {self.queue}"
        )
        tail = ": your server will start when a GPU frees" if not self.free_now else ""
        return f"{free} · {line}{tail}"


def _queue_max(cfg: ProfilesConfig, ctx: UserContext, queue: str, model: str) -> int | None:
    """What validation accepts at most for a queued server of ``model``: more could never start."""
    from tfdist.kube.queueing import gpu_capacity

    cap = gpu_capacity(cfg, queue, model)
    limits = [int(cap.maximum)] if cap is not None else [0]
    node = (ctx.largest_node_gpus or {}).get(model)
    if node is not None:
        limits.append(node)
    return min(limits)


@dataclass
class _ProfileView:
    profile: Profile
    selected: bool
    values: dict[str, str]
    models: list[_ModelView] = field(default_factory=list)
    gpu_cap_left: int | None = None
    notes: list[str] = field(default_factory=list)
    disabled_reason: str = ""

    @property
    def slug(self) -> str:
        return self.profile.slug


def _num(x: float) -> str:
    return f"{x:g}"


def _step(r: FloatRange) -> str:
    return "0.5" if all(math.isclose(v * 2, round(v * 2)) for v in (r.min, r.max, r.default)) else "any"


def _prefill(
    cfg: ProfilesConfig, ctx: UserContext, candidates: Iterable[Mapping[str, Any] | None]
) -> dict[str, Any] | None:
    """The first remembered choice that is still valid (ranges, lists and the machine may have changed)."""
    check = UserContext(groups=ctx.groups, gpus_total=ctx.gpus_total, place=ctx.place)
    for c in candidates:
        if not c:
            continue
        try:
            return validate_options(c, cfg, check).as_user_options()
        except ValueError:
            continue
    return None


def _values_for(p: Profile, chosen: Mapping[str, Any] | None) -> dict[str, str]:
    image_keys = {i.image for i in p.images}
    v = {
        "cpu": _num(p.cpu.default),
        "memory": _num(p.memory_gib.default),
        "gpus": str(p.gpus.default),
        "gpu_model": p.default_model or "",
        "image": p.images[0].image,
        "image_custom": "",
    }
    if chosen and chosen.get("profile") == p.slug:
        for k in ("cpu", "memory", "gpus"):
            if k in chosen and isinstance(chosen[k], (int, float, str)):
                v[k] = _num(chosen[k]) if isinstance(chosen[k], (int, float)) else chosen[k]
        if isinstance(chosen.get("gpu_model"), str) and chosen["gpu_model"]:
            v["gpu_model"] = chosen["gpu_model"]
        img = chosen.get("image")
        if isinstance(img, str):
            if img in image_keys:
                v["image"] = img
            elif p.custom_image is not None:
                v["image"], v["image_custom"] = CUSTOM_IMAGE, img
    return v


def render_form(
    cfg: ProfilesConfig,
    ctx: UserContext,
    availability: Mapping[str, ModelAvailability] | None,
    remembered: Iterable[Mapping[str, Any] | None] = (),
    submitted: Mapping[str, Any] | None = None,
) -> str:
    """HTML for JupyterHub's spawn page (inserted into its <form>).

    `remembered`: candidate previous choices, best first (the last valid one is pre-selected).
    `submitted`: raw options of a POST that failed validation, shown again so the user can fix them.
    """
    if availability is not None and ctx.gpus_total is None:
        ctx = dataclasses.replace(ctx, gpus_total={k: a.total for k, a in availability.items()})
    listed = cfg.allowed_profiles(ctx.groups)
    # GPU profiles on a hub without their GPUs cannot start: not offered at all (validation refuses them too)
    allowed = [p for p in listed if not lacks_gpus(p, ctx)]
    hidden_gpu_profiles = len(listed) - len(allowed)
    chosen: Mapping[str, Any] | None = None
    if (
        submitted
        and isinstance(submitted.get("profile"), str)
        and cfg.profile(submitted["profile"]) in allowed
    ):
        chosen = submitted
    else:
        chosen = _prefill(cfg, ctx, remembered)
    selected_slug = chosen["profile"] if chosen else (allowed[0].slug if allowed else None)

    views = []
    for p in allowed:
        values = _values_for(p, chosen)
        view = _ProfileView(profile=p, selected=p.slug == selected_slug, values=values)
        if p.offers_gpus:
            queue = gpu_queue(p, cfg, ctx)
            for key in p.gpu_models:
                av = availability.get(key) if availability is not None else None
                m = _ModelView(
                    key=key,
                    display_name=cfg.gpu_models[key].display_name,
                    free=av.free if av else (0 if availability is not None else None),
                    total=av.total if av else (0 if availability is not None else None),
                    selected=key == values["gpu_model"],
                    max_on_node=av.max_on_node if av else None,
                )
                if queue is not None:
                    # a shortage is a wait in the queue, not a cap: only the queue's own limit is
                    m.free_now, m.free, m.max_on_node = m.free, None, None
                    m.queue = queue
                    m.waiting = ctx.queue_waiting.get(queue, 0) if ctx.queue_waiting is not None else None
                    m.never = queue_refusal(cfg, queue, key, 1) is not None
                    m.queue_max = _queue_max(cfg, ctx, queue, key)
                view.models.append(m)
            if p.max_gpus_per_user is not None:
                view.gpu_cap_left = max(p.max_gpus_per_user - ctx.gpus_held_elsewhere, 0)
                view.notes.append(
                    f"At most {p.max_gpus_per_user} GPUs per user across all servers; "
                    f"your other servers hold {ctx.gpus_held_elsewhere}, so up to {view.gpu_cap_left} here."
                )
            fits = [m for m in view.models if not m.disabled]
            need = max(p.gpus.min, 1)
            if p.gpus.min > 0 and (
                not any((m.fit is None or m.fit >= need) for m in fits)
                or (view.gpu_cap_left is not None and view.gpu_cap_left < need)
            ):
                view.disabled_reason = (
                    f"Needs at least {p.gpus.min} GPU{'s' if p.gpus.min != 1 else ''} and that many are not "
                    "free for you right now."
                )
            if view.selected and values["gpu_model"] not in {m.key for m in fits} and fits:
                # the remembered model has none free now: pre-select one that has
                values["gpu_model"] = fits[0].key
                for m in view.models:
                    m.selected = m.key == fits[0].key
        views.append(view)

    # a selected profile that cannot fit gives way to the first one that can
    if any(v.selected and v.disabled_reason for v in views):
        fallback = next((v for v in views if not v.disabled_reason), None)
        if fallback is not None:
            for v in views:
                v.selected = v is fallback

    summary = []
    no_gpus = (
        availability is not None
        and hidden_gpu_profiles > 0
        and not any(a.total for a in availability.values())
    )
    if availability is not None and not no_gpus:
        keys = [k for v in views for k in v.profile.gpu_models]
        for key in dict.fromkeys(keys):
            av = availability.get(key, ModelAvailability(0, 0))
            node_max = av.max_on_node if av.max_on_node is not None and av.max_on_node < av.free else None
            summary.append((cfg.gpu_models[key].display_name, av.free, av.total, node_max))
    return _env.get_template("form.html").render(
        profiles=views,
        summary=summary,
        availability_known=availability is not None,
        no_gpus_text=f"{ctx.place} has no GPUs: CPU profiles only." if no_gpus else "",
        custom_value=CUSTOM_IMAGE,
        custom_field=CUSTOM_IMAGE_FIELD,
        num=_num,
        step=_step,
    )
