"""Admin profiles: the YAML file hub admins write, read into the typed models of
`tfdist.spawner.profile_schema`.

Why a module of its own: the file is read once at hub start (a broken file must stop the hub with the file,
the key and the reason) and again when it changes on disk. The models are re-exported here, so
`tfdist.spawner.profiles` stays the one import path that hub configs and the spawners use.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .profile_schema import (
    ANY_GROUP,
    CustomImage,
    FloatRange,
    GpuModel,
    ImageChoice,
    IntRange,
    JobLimits,
    KueueQueue,
    KueueQueues,
    Profile,
    ProfilesConfig,
    Toleration,
)

__all__ = [
    "ANY_GROUP",
    "CustomImage",
    "FloatRange",
    "GpuModel",
    "ImageChoice",
    "IntRange",
    "JobLimits",
    "KueueQueue",
    "KueueQueues",
    "Profile",
    "ProfilesConfig",
    "ProfilesFileError",
    "ProfilesSource",
    "Toleration",
    "load_profiles",
    "load_profiles_or_exit",
    "parse_profiles",
]


class ProfilesFileError(Exception):
    """A profiles file that cannot be used; `str()` is one line per problem: ``file: key: reason``."""

    def __init__(self, path: str, problems: list[tuple[str, str]]) -> None:
        self.path = path
        self.problems = problems
        super().__init__("\n".join(f"{path}: {key}: {reason}" for key, reason in problems))


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key written twice (PyYAML would silently keep the last one)."""


def _construct_mapping(
    loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False
) -> dict[Any, Any]:
    seen: dict[Any, Any] = {}
    for key_node, _value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"the key {key!r} is written twice",
                key_node.start_mark,
            )
        seen[key] = True
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _key_path(loc: tuple[int | str, ...], data: Any) -> str:
    """pydantic's loc as a readable key path, naming the profile by slug: ``profiles[1] (gpu).cpu.max``."""
    out = ""
    node = data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            if isinstance(node, list) and 0 <= part < len(node):
                node = node[part]
                slug = node.get("slug") if isinstance(node, dict) else None
                if isinstance(slug, str) and out.startswith("profiles[") and out.count("[") == 1:
                    out += f" ({slug})"
            else:
                node = None
        else:
            if part in ("function-after", "function-before") or "[" in part:
                continue  # pydantic's internal validator step names
            out += f".{part}" if out else part
            node = node.get(part) if isinstance(node, dict) else None
    return out or "(top level)"


def parse_profiles(data: Any, path: str = "<profiles>") -> ProfilesConfig:
    """Validate already-parsed YAML/JSON data; raises ProfilesFileError naming every bad key."""
    if not isinstance(data, Mapping):
        raise ProfilesFileError(
            path, [("(top level)", "must be a mapping with 'profiles' (and 'gpu_models')")]
        )
    try:
        return ProfilesConfig.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors(include_url=False):
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            if err["type"] == "extra_forbidden":
                msg = "unknown key (check the spelling)"
            problems.append((_key_path(tuple(err["loc"]), data), msg))
        raise ProfilesFileError(path, problems) from None


def load_profiles(path: str | os.PathLike[str]) -> ProfilesConfig:
    """Read and validate a profiles YAML file; raises ProfilesFileError (file, key, reason)."""
    p = str(path)
    try:
        text = Path(p).read_text(encoding="utf-8")
    except OSError as e:
        raise ProfilesFileError(p, [("(file)", f"cannot be read: {e.strerror or e}")]) from None
    except UnicodeDecodeError as e:
        raise ProfilesFileError(p, [("(file)", f"is not UTF-8 ({e.reason} at byte {e.start})")]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        raise ProfilesFileError(p, [(where, f"not valid YAML: {e.problem or e.context}")]) from None
    except yaml.YAMLError as e:
        raise ProfilesFileError(p, [("(file)", f"not valid YAML: {e}")]) from None
    return parse_profiles(data, p)


def load_profiles_or_exit(path: str | os.PathLike[str]) -> ProfilesConfig:
    """For jupyterhub_config.py: a broken file stops the hub with a one-line-per-problem message.

    SystemExit is not an Exception, so traitlets' config loader does not swallow it into a traceback.
    """
    try:
        return load_profiles(path)
    except ProfilesFileError as e:
        print(
            f"tfdist: the GPU profiles file is not usable, so the hub will not start:\n{e}", file=sys.stderr
        )
        raise SystemExit(2) from None


class ProfilesSource:
    """The profiles of a running hub, re-read when the file changes on disk.

    A file broken while the hub runs keeps the last good profiles (and logs why), so an admin's typo never
    takes down spawning for everyone; at hub start the file must be good (see load_profiles_or_exit).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._config: ProfilesConfig | None = None
        self.last_error: ProfilesFileError | None = None

    def get(self) -> ProfilesConfig:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        with self._lock:
            if self._config is not None and stamp == self._stamp:
                return self._config
            try:
                cfg = load_profiles(self.path)
            except ProfilesFileError as e:
                if self._config is None:
                    raise
                self.last_error = e
                self._stamp = stamp  # do not re-read a broken file on every request
                return self._config
            self._config, self._stamp, self.last_error = cfg, stamp, None
            return cfg
