"""Mutual authentication between the notebook and its job's agent, without the token ever travelling.

Why: the notebook finds the coordinator pod's address through the API server; anything that could pose as
that pod (a pod someone else labelled as the job's coordinator, a reused IP) must learn nothing and be
able to hand back nothing. So neither side sends the job's token: each request carries an HMAC of
(method, path, time, nonce, body digest) under the token, and each response an HMAC of (the request's
nonce, status, body digest). The kernel unpickles a result only after its response HMAC checks out; an
agent runs a payload only after its request HMAC checks out.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

SCHEME = "TFDIST-HMAC"
RESPONSE_HEADER = "X-Tfdist-Signature"
MAX_SKEW_S = 300.0


class BadSignature(Exception):
    """A request or response that was not made with the job's token."""


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
    return f"{SCHEME} ts={ts},nonce={nonce},sig={sig}", nonce


def verify_request(
    token: str, header: str, method: str, path: str, body_digest: str, now: float | None = None
) -> str:
    """The request's nonce if `header` was made with `token` for exactly this request; else BadSignature."""
    scheme, _, rest = header.partition(" ")
    if scheme != SCHEME:
        raise BadSignature("not a signed request")
    fields = dict(p.split("=", 1) for p in rest.split(",") if "=" in p)
    try:
        ts, nonce, sig = fields["ts"], fields["nonce"], fields["sig"]
        age = abs((now if now is not None else time.time()) - int(ts))
    except (KeyError, ValueError):
        raise BadSignature("malformed signature") from None
    if age > MAX_SKEW_S:
        raise BadSignature(f"signature too old ({age:.0f}s)")
    if not hmac.compare_digest(sig, _mac(token, method.upper(), path, ts, nonce, body_digest)):
        raise BadSignature("wrong signature")
    return nonce


def sign_response(token: str, nonce: str, status: int, body_digest: str) -> str:
    return _mac(token, "response", nonce, str(status), body_digest)


def verify_response(token: str, nonce: str, status: int, body: bytes, signature: str | None) -> None:
    """Raise BadSignature unless `body` came from a holder of `token`, answering the request `nonce`."""
    if not signature or not hmac.compare_digest(signature, sign_response(token, nonce, status, digest(body))):
        raise BadSignature("the response is not signed with the job's token")
