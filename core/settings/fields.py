"""Typed ``TFDIST_*`` variables without pydantic: job pods and task processes import these, and must not
pay for pydantic at start.

A group (`Group` subclass) lists its variables as `Var` attributes. Reading a field parses that one
variable from the group's mapping when it is read, so a process sees the environment as it is then (as the
code that read ``os.environ`` did) and a broken variable fails only the code that reads it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar, overload

from tfdist.errors import TfdistError

T = TypeVar("T")


class SettingsError(TfdistError):
    """An environment holds a value for a tfdist variable that tfdist (or its admin) would never write."""


class Var(Generic[T]):
    """One variable: its name, parser, default, bounds and a one-line description (the reference's)."""

    def __init__(
        self,
        name: str,
        parse: Callable[[str], T],
        default: T,
        description: str,
        *,
        type_name: str = "",
        ge: float | None = None,
        gt: float | None = None,
        le: float | None = None,
        lt: float | None = None,
        fallback: bool = False,
        required: bool = False,
        default_text: str = "",
    ) -> None:
        self.name, self.parse, self.default, self.description = name, parse, default, description
        self.type_name = type_name or getattr(parse, "__name__", "str")
        self.ge, self.gt, self.le, self.lt = ge, gt, le, lt
        self.fallback, self.required, self.default_text = fallback, required, default_text
        self.attr = name

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    @overload
    def __get__(self, obj: None, owner: type) -> Var[T]: ...
    @overload
    def __get__(self, obj: Group, owner: type) -> T: ...
    def __get__(self, obj: Group | None, owner: type) -> Var[T] | T:
        return self if obj is None else self.read(obj.env, type(obj).broken)

    def bounds(self) -> str:
        marks = (("≥", self.ge), (">", self.gt), ("≤", self.le), ("<", self.lt))
        return ", ".join(f"{mark} {bound:g}" for mark, bound in marks if bound is not None)

    def read(self, env: Mapping[str, str], broken: str = "") -> T:
        raw = env.get(self.name)
        if raw is None or raw == "":  # "" is how a spawner or a chart writes "not given"
            if self.required:
                raise SettingsError(f"{self.name} is not set: {self.description}")
            return self.default
        try:
            value = self.parse(raw)
            self._check(value)
        except (ValueError, TypeError, OverflowError) as e:
            if self.fallback:
                return self.default
            why = f"{self.name}={raw!r} is not valid ({e})"
            raise SettingsError(f"{broken or 'tfdist settings are broken'}: {why}") from None
        return value

    def _check(self, value: Any) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return
        if math.isnan(value):
            raise ValueError("not a number")
        for bound, ok, word in (
            (self.ge, lambda b: value >= b, "at least"),
            (self.gt, lambda b: value > b, "more than"),
            (self.le, lambda b: value <= b, "at most"),
            (self.lt, lambda b: value < b, "less than"),
        ):
            if bound is not None and not ok(bound):
                raise ValueError(f"must be {word} {bound:g}")


class Group:
    """Typed view of some variables of `env` (default: this process's environment, read at each access)."""

    title: ClassVar[str] = ""  # the reference's heading
    reader: ClassVar[str] = ""  # who reads them and who writes them, for the reference
    broken: ClassVar[str] = "tfdist settings are broken"  # how an error starts

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env: Mapping[str, str] = os.environ if env is None else env

    @classmethod
    def variables(cls) -> list[Var[Any]]:
        return [v for v in vars(cls).values() if isinstance(v, Var)]

    def __repr__(self) -> str:
        fields = ", ".join(f"{v.attr}={getattr(self, v.attr)!r}" for v in self.variables())
        return f"{type(self).__name__}({fields})"


# parsers: each raises ValueError with a short reason


def flag_1(raw: str) -> bool:
    """On only when "1" (any other value is off, as the code that wrote "0"/"1" always read it)."""
    return raw == "1"


flag_1.__name__ = "bool"


def json_object(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


json_object.__name__ = "JSON object"


def words(raw: str) -> tuple[str, ...]:
    """Space-separated values (a chart's --set writes one string, not a list)."""
    return tuple(raw.split())


words.__name__ = "space-separated list"


def digits(raw: str) -> int:
    """A count written as digits only (a sign, a point or a unit is not one)."""
    if not raw.strip().isdigit():
        raise ValueError("not a whole number")
    return int(raw.strip())


digits.__name__ = "int"

BYTE_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}


def byte_size(raw: str) -> int:
    """Bytes, or with a unit: 2Gi, 1500Mi, 3G."""
    raw = raw.strip()
    num, mult = raw, 1
    for u in sorted(BYTE_UNITS, key=len, reverse=True):
        if raw.endswith(u):
            num, mult = raw[: -len(u)], BYTE_UNITS[u]
            break
    value = float(num) * mult
    if not 0 <= value < math.inf:  # negative, nan or inf
        raise ValueError("not a size")
    return int(value)


byte_size.__name__ = "bytes (2Gi, 1500Mi)"
