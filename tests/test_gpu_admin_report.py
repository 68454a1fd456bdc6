"""What a server may send the GPU admin service, and which server a token stands for; no hub.

The hub end to end (real tokens, real servers, the attacks) is in tests/test_hub_gpu_culler.py; here the two
pure checks the service relies on, with every malformed shape we could think of.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tfdist.hubadmin.hubconfig import SERVICE_SCOPES
from tfdist.hubadmin.identity import ServerId, server_of
from tfdist.hubadmin.report import MAX_BODY_BYTES, MAX_GPUS, MAX_SAMPLES, ReportError, parse_report

NOW = time.time()
GPU = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-1", "memory_total_mib": 81559}


def good(**over: object) -> dict:
    rep = {
        "busy_percent": 10,
        "idle_s": 12.5,
        "gpus": [GPU],
        "samples": [{"t": NOW - 1, "util": [3.0], "mem": [100.0]}],
        "jobs_running": [{"name": "train1", "state": "running", "gpu_util": [70.0]}],
    }
    rep.update(over)
    return rep


def test_a_good_report_is_taken_and_names_in_it_are_ignored() -> None:
    rep = parse_report(json.dumps(good(user="boss", server="x")).encode(), NOW)
    assert rep.idle_s == 12.5 and rep.gpus[0].uuid == "GPU-1" and rep.jobs_running[0].gpu_util == [70.0]
    assert not hasattr(rep, "user")  # who sent it comes from the token only
    assert parse_report(b"{}", NOW).gpus == []  # a CPU-only server with nothing to say


BAD = [
    ("not-json", b"{", "a report is a JSON object"),
    ("a-list", b"[1, 2]", "a report is a JSON object"),
    ("null", b"null", "a report is a JSON object"),
    ("gpus-a-string", json.dumps(good(gpus="x")).encode(), "gpus"),
    ("nan-idle", json.dumps(good(idle_s=float("nan"))).encode(), "idle_s"),
    ("inf-util", json.dumps(good(samples=[{"t": NOW, "util": [float("inf")], "mem": [1]}])).encode(), "util"),
    ("negative-idle", json.dumps(good(idle_s=-5)).encode(), "idle_s"),
    ("idle-as-text", json.dumps(good(idle_s="12")).encode(), "idle_s"),
    ("idle-as-bool", json.dumps(good(idle_s=True)).encode(), "idle_s"),
    ("util-over-100", json.dumps(good(samples=[{"t": NOW, "util": [1e9], "mem": [1]}])).encode(), "util"),
    ("negative-mem", json.dumps(good(samples=[{"t": NOW, "util": [1], "mem": [-1]}])).encode(), "mem"),
    ("too-many-gpus", json.dumps(good(gpus=[GPU] * (MAX_GPUS + 1))).encode(), "gpus"),
    (
        "too-many-samples",
        json.dumps(good(samples=[{"t": NOW, "util": [1], "mem": [1]}] * (MAX_SAMPLES + 1))).encode(),
        "samples",
    ),
    (
        "sample-gpu-count",
        json.dumps(good(samples=[{"t": NOW, "util": [1, 2], "mem": [1, 2]}])).encode(),
        "2 GPUs",
    ),
    (
        "sample-far-future",
        json.dumps(good(samples=[{"t": NOW + 86400, "util": [1], "mem": [1]}])).encode(),
        "samples.0.t",
    ),
    ("job-name-huge", json.dumps(good(jobs_running=[{"name": "j" * 5000, "state": "r"}])).encode(), "name"),
    ("gpu-name-object", json.dumps(good(gpus=[{**GPU, "name": {"a": 1}}])).encode(), "name"),
    ("too-big", b" " * (MAX_BODY_BYTES + 1), "at most"),
]


@pytest.mark.parametrize(("body", "why"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_reports_are_refused_with_a_sentence(body: bytes, why: str) -> None:
    with pytest.raises(ReportError) as e:
        parse_report(body, NOW)
    assert why in str(e.value), str(e.value)
    assert len(str(e.value)) < 300


def model(name: str, *scopes: str, kind: str = "user") -> dict:
    return {"kind": kind, "name": name, "scopes": list(scopes)}


def test_only_a_servers_own_token_names_a_server() -> None:
    # what JupyterHub 6 gives a server's JUPYTERHUB_API_TOKEN (checked against a real hub in
    # test_hub_gpu_culler): one access scope for exactly that server, plus its activity scope
    assert server_of(model("alice", "access:servers!server=alice/", "users:activity!user=alice")) == ServerId(
        "alice", ""
    )
    assert server_of(model("alice", "access:servers!server=alice/gpu1")) == ServerId("alice", "gpu1")
    # a user's own token (all their servers), a share of someone else's server, a service, an admin
    assert server_of(model("alice", "access:servers!user=alice")) is None
    assert server_of(model("alice", "access:servers!server=bob/")) is None
    assert server_of(model("alice", "access:servers!server=alice/", "access:servers!server=bob/")) is None
    assert server_of(model("tfdist-gpu-admin", "access:servers!server=alice/", kind="service")) is None
    assert server_of(model("boss", "access:servers", "admin:users")) is None
    assert server_of(None) is None and server_of({"kind": "user"}) is None
    assert server_of({"kind": "user", "name": "a", "scopes": "access:servers!server=a/"}) is None


def test_the_service_cannot_reach_servers() -> None:
    """Its token never leaves the hub; even so it holds no scope that would open a user's server."""
    assert not any(s.startswith("access:servers") for s in SERVICE_SCOPES)
    assert "admin:users" not in SERVICE_SCOPES and "tokens" not in SERVICE_SCOPES


def test_made_up_tokens_do_not_push_a_servers_identity_out_of_the_cache() -> None:
    """Anyone can post reports with made-up tokens: refused ones are kept apart, so a real server's cached
    identity stays and its next report costs the hub nothing (before: 10,000 made-up tokens evicted it)."""
    from tfdist.hubadmin.identity import IdentityCache

    asked: list[str] = []

    async def ask_hub(token: str) -> dict | None:
        asked.append(token)
        return model("alice", "access:servers!server=alice/") if token == "alices-server" else None

    async def scenario() -> None:
        cache = IdentityCache(ask_hub)
        assert await cache.server_for("alices-server") == ServerId("alice", "")
        for i in range(cache.max_entries + 10):
            assert await cache.server_for(f"made-up-{i}") is None
        asked.clear()
        assert await cache.server_for("alices-server") == ServerId("alice", "")
        assert asked == [], "the real server's identity was pushed out by made-up tokens"
        # a recent refusal is still answered from the cache; the refusals' own table stays bounded
        assert await cache.server_for(f"made-up-{cache.max_entries + 9}") is None and asked == []
        assert len(cache._refused) <= cache.max_refused

    asyncio.run(scenario())
