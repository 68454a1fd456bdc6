"""Which server a report comes from: the hub says whose token it is, never the report itself.

Why the hub: each server holds its own token (``JUPYTERHUB_API_TOKEN``, issued by the hub with the scope
``access:servers!server=<user>/<server>`` and nothing broader). Any token may ask ``GET /hub/api/user`` who
it is; the answer names the owner and lists the token's scopes. A report is attributed to the one server
that token was issued for, and only when that server belongs to the token's owner: a user's own API token
(``access:servers!user=...``), a token holding a share of someone else's server, or a service's token
identifies no server and is refused.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["IdentityCache", "ServerId", "server_of"]

SERVER_SCOPE = "access:servers!server="


@dataclass(frozen=True)
class ServerId:
    user: str
    name: str  # "" for the default server

    @property
    def key(self) -> str:
        return f"{self.user}/{self.name}"


def server_of(model: Any) -> ServerId | None:
    """The server a token was issued for, from the hub's ``/user`` answer for it; None: not a server's."""
    if not isinstance(model, dict) or model.get("kind") != "user" or not isinstance(model.get("name"), str):
        return None
    scopes = model.get("scopes")
    if not isinstance(scopes, list):
        return None
    owner = model["name"]
    found = {s[len(SERVER_SCOPE) :] for s in scopes if isinstance(s, str) and s.startswith(SERVER_SCOPE)}
    # a server token carries exactly one such scope; more (shares, a hand-made token) is not a server's
    own = [f for f in found if f.partition("/")[0] == owner]
    if len(found) != 1 or len(own) != 1:
        return None
    user, _, name = own[0].partition("/")
    return ServerId(user, name)


@dataclass
class IdentityCache:
    """Tokens seen recently -> their server (or None), so a report costs the hub one request a minute.

    Keyed by the token's SHA-256, never the token; bounded, oldest entries dropped first. Refused tokens
    are kept apart, in a smaller table: anyone can send made-up tokens, and those must not push the real
    servers' entries out (each real server would then cost the hub a request per report again)."""

    ask_hub: Callable[[str], Awaitable[Any]]  # token -> the hub's /user model, None when it refuses it
    max_age_s: float = 60.0
    max_entries: int = 10_000
    max_refused: int = 1_000

    def __post_init__(self) -> None:
        self._seen: dict[str, tuple[float, ServerId]] = {}
        self._refused: dict[str, float] = {}

    async def server_for(self, token: str) -> ServerId | None:
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        hit = self._seen.get(key)
        if hit and now - hit[0] < self.max_age_s:
            return hit[1]
        refused = self._refused.get(key)
        if refused is not None and now - refused < self.max_age_s:
            return None
        sid = server_of(await self.ask_hub(token))  # the hub unreachable: raises, nothing cached
        self._seen.pop(key, None)
        self._refused.pop(key, None)
        if sid is None:
            _put(self._refused, key, now, self.max_refused)
        else:
            _put(self._seen, key, (now, sid), self.max_entries)
        return sid


def _put(table: dict[str, Any], key: str, value: Any, bound: int) -> None:
    table[key] = value
    while len(table) > bound:
        del table[next(iter(table))]
