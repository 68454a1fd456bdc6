"""Mutual authentication between the notebook and its job's agent, without the token ever travelling.

Why: the notebook finds the coordinator pod's address through the API server; anything that could pose as
that pod (a pod someone else labelled as the job's coordinator, a reused IP) must learn nothing and be
able to hand back nothing. So neither side sends the job's token: each request carries an HMAC of
(method, path, time, nonce, body digest) under the token, and each response an HMAC of (the request's
nonce, status, body digest). The kernel unpickles a result only after its response HMAC checks out; an
agent runs a payload only after its request HMAC checks out.

The request header also declares the body's digest (`sha256=`, which the HMAC covers): an agent checks the
signature before it reads a byte of the body, then the body against the digest. Agents older than that field
ignore it (the signed string is unchanged). An agent remembers each accepted nonce until its timestamp is
too old to pass (ReplayCache), so a captured request sent again is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import threading
import time
from dataclasses import dataclass

SCHEME = "TFDIST-HMAC"
RESPONSE_HEADER = "X-Tfdist-Signature"
MAX_SKEW_S = 300.0


class BadSignature(Exception):
    """A request or response that was not made with the job's token."""


class Replayed(BadSignature):
    """A request made with the job's token whose nonce the agent cannot take now: already received within its
    window, or no room left to remember it. Either way its sender's answer is to sign it again."""


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def sign_request(
    token: str, method: str, path: str, body_digest: str, now: float | None = None
) -> tuple[str, str]:
    """(Authorization header value, nonce) for one request; `path` includes the query string."""
    ts = str(int(now if now is not None else time.time()))
    nonce = secrets.token_hex(16)
    sig = _mac(token, method.upper(), path, ts, nonce, body_digest)
    return f"{SCHEME} ts={ts},nonce={nonce},sig={sig},sha256={body_digest}", nonce


@dataclass(frozen=True)
class SignedHeader:
    """The fields of a request's Authorization header, not yet checked."""

    ts: int
    nonce: str
    sig: str
    body_digest: str | None  # declared by senders of this version on; None from older ones


def parse_header(header: str) -> SignedHeader:
    """The header's fields; BadSignature when it is not one of ours (nothing is checked here)."""
    scheme, _, rest = header.partition(" ")
    if scheme != SCHEME:
        raise BadSignature("not a signed request")
    fields = dict(p.split("=", 1) for p in rest.split(",") if "=" in p)
    try:
        return SignedHeader(int(fields["ts"]), fields["nonce"], fields["sig"], fields.get("sha256"))
    except (KeyError, ValueError):
        raise BadSignature("malformed signature") from None


def verify_request(
    token: str,
    header: str,
    method: str,
    path: str,
    body_digest: str,
    now: float | None = None,
    seen: ReplayCache | None = None,
) -> str:
    """The request's nonce if `header` was made with `token` for exactly this request; else BadSignature
    (Replayed when `seen` already holds its nonce)."""
    h = parse_header(header)
    now = now if now is not None else time.time()
    age = abs(now - h.ts)
    if age > MAX_SKEW_S:
        raise BadSignature(f"signature too old ({age:.0f}s)")
    if not hmac.compare_digest(h.sig, _mac(token, method.upper(), path, str(h.ts), h.nonce, body_digest)):
        raise BadSignature("wrong signature")
    if seen is not None:  # only after the HMAC: nobody without the token can fill the cache
        seen.admit(h.nonce, h.ts, now)
    return h.nonce


class ReplayCache:
    """Nonces of accepted requests, each kept until its timestamp is too old for verify_request (ts +
    MAX_SKEW_S), so a captured request sent again within its validity is refused. Memory is bounded twice:
    by that window (nonces sit in buckets of `bucket_s` by expiry, dropped whole) and by `max_entries`. When
    full of live nonces it refuses new requests rather than forget one (a forgotten nonce could be
    replayed); at the job's own rate (a sample a second per pod) it holds ~20k of its 100k."""

    def __init__(self, max_entries: int = 100_000, window_s: float = MAX_SKEW_S, bucket_s: float = 10.0):
        self.max_entries, self.window_s, self.bucket_s = max_entries, window_s, bucket_s
        self._buckets: dict[int, set[str]] = {}  # bucket of the expiry -> nonces
        self._count = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._count

    def admit(self, nonce: str, ts: float, now: float | None = None) -> None:
        """Remember `nonce` (signed at `ts`); Replayed if it was seen or there is no room for it."""
        now = now if now is not None else time.time()
        with self._lock:
            self._expire(now)
            if any(nonce in bucket for bucket in self._buckets.values()):
                raise Replayed("this signed request was already received")
            if self._count >= self.max_entries:
                raise Replayed(f"{self._count} signed requests in the last {self.window_s:g}s")
            key = math.ceil((ts + self.window_s) / self.bucket_s)
            self._buckets.setdefault(key, set()).add(nonce)
            self._count += 1

    def _expire(self, now: float) -> None:
        for key in [k for k in self._buckets if k * self.bucket_s < now]:
            self._count -= len(self._buckets.pop(key))


def sign_response(token: str, nonce: str, status: int, body_digest: str) -> str:
    return _mac(token, "response", nonce, str(status), body_digest)


def verify_response(token: str, nonce: str, status: int, body: bytes, signature: str | None) -> None:
    """Raise BadSignature unless `body` came from a holder of `token`, answering the request `nonce`."""
    if not signature or not hmac.compare_digest(signature, sign_response(token, nonce, status, digest(body))):
        raise BadSignature("the response is not signed with the job's token")
