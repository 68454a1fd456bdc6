"""docs/configuration.md, generated: every ``TFDIST_*`` variable (from the settings groups) and every
configurable trait of the spawners and services (from their ``help=``), one table per group.

Generated rather than written so that it cannot drift: tests/test_settings_reference.py fails when the
committed file differs from `render()`.
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from typing import Any

from .fields import Group, Var
from .groups import GROUPS

# where the configurable classes live; the hub ones need the `hub` extra (jupyterhub, kubespawner)
TRAIT_MODULES = (
    "tfdist.spawner.base",
    "tfdist.spawner.local",
    "tfdist.spawner.kube",
    "tfdist.spawner.localhub",
    "tfdist.hubadmin",
)
COMMAND = "python -m tfdist.settings --reference > docs/configuration.md"


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


def _default(value: Any) -> str:
    if value is None or value == "" or value == ():
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _table(head: str, rows: list[tuple[str, str, str, str]]) -> list[str]:
    out = [f"| {head} | type | default | description |", "| --- | --- | --- | --- |"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _var_row(v: Var[Any]) -> tuple[str, str, str, str]:
    kind = ", ".join(p for p in (v.type_name, v.bounds()) if p)
    default = "required" if v.required else (f"`{v.default_text}`" if v.default_text else _default(v.default))
    return f"`{v.name}`", kind, default, v.description


def _annotation(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(f"`{a}`" for a in typing.get_args(tp))
    return re.sub(r"\btyping\.", "", tp.__name__ if isinstance(tp, type) else str(tp))


def _settings_rows() -> list[tuple[str, str, str, str]]:
    from .server import Settings

    rows = []
    for f in Settings.model_fields.values():
        if f.exclude:
            continue
        alias = f.validation_alias
        names = getattr(alias, "choices", None) or [alias]
        bounds = [f"≥ {m.ge}" for m in f.metadata if hasattr(m, "ge")]
        bounds += [f"≤ {m.le}" for m in f.metadata if hasattr(m, "le")]
        kind = ", ".join([_annotation(f.annotation), *bounds])
        rows.append((" / ".join(f"`{n}`" for n in names), kind, _default(f.default), f.description or ""))
    return rows


def _group_section(group: type[Group]) -> list[str]:
    lines = [f"### {group.title} (`{group.__name__}`)", "", group.reader, ""]
    return lines + _table("variable", [_var_row(v) for v in group.variables()]) + [""]


def _configurables() -> list[tuple[str, type]]:
    from traitlets import HasTraits

    found = []
    for name in TRAIT_MODULES:
        mod = importlib.import_module(name)
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, HasTraits) and cls.class_own_traits(config=True):
                found.append((name, cls))
    return found


def _trait_section(module: str, cls: type) -> list[str]:
    rows = []
    dynamic = getattr(cls, "_trait_default_generators", {})
    for tname, trait in sorted(cls.class_own_traits(config=True).items()):
        default = "computed" if tname in dynamic else f"`{trait.default_value_repr()}`"
        rows.append((f"`{tname}`", type(trait).__name__, default, trait.help or ""))
    head = f"### `c.{cls.__name__}` (`{module}`)"
    return [head, "", _cell((cls.__doc__ or "").strip().split("\n\n")[0]), "", *_table("trait", rows), ""]


def render() -> str:
    """The whole reference, as committed in docs/configuration.md."""
    from .server import Settings

    lines = [
        "# Configuration reference",
        "",
        "Every setting of tfdist: the `TFDIST_*` environment variables, by the process that reads them, and "
        "the traitlets options of the spawners (in `jupyterhub_config.py`). Back to the "
        "[README](../README.md).",
        "",
        f"Generated from `tfdist.settings` and the traits' `help=`; do not edit: `{COMMAND}`. "
        "A value that does not parse stops what reads it with the variable's name, unless its description "
        "says it falls back to the default. An empty value counts as unset.",
        "",
        "## Environment variables",
        "",
        f"### Notebook server: written by the spawner (`{Settings.__name__}`)",
        "",
        "Read once per kernel and by the lab server; the spawners write them into each server's environment.",
        "",
        *_table("variable", _settings_rows()),
        "",
    ]
    for group in GROUPS:
        lines += _group_section(group)
    lines += ["## Spawner and service options (traitlets)", ""]
    for module, cls in _configurables():
        lines += _trait_section(module, cls)
    return "\n".join(lines).rstrip("\n") + "\n"
