"""A GPU profile whose servers wait in a Kueue queue: validation and the form, without a hub or a cluster.

A shortage now is a wait (accepted); what the queue can never hold, or the profile forbids, is refused with
the numbers; profiles without a queue, or a spawner that does not queue, keep the "only N free" refusal.
"""

from __future__ import annotations

import re

import pytest

from tfdist.kube.queueing import cluster_queues
from tfdist.kube.queueline import pending_workloads
from tfdist.spawner.allocator import ModelAvailability
from tfdist.spawner.availability import largest_node, node_info
from tfdist.spawner.form import render_form
from tfdist.spawner.profiles import parse_profiles
from tfdist.spawner.validation import OptionsError, UserContext, validate_options


def _gpu_profile(slug: str, queue: str | None, models: list[str]) -> dict:
    p = {
        "slug": slug,
        "display_name": slug.upper(),
        "groups": ["ml"],
        "cpu": {"min": 1, "max": 8, "default": 1},
        "memory_gib": {"min": 1, "max": 8, "default": 1},
        "gpus": {"min": 1, "max": 8, "default": 1},
        "gpu_models": models,
        "images": ["img"],
    }
    if queue:
        p["kueue_queue"] = queue
    return p


CFG = parse_profiles(
    {
        "gpu_models": {
            "h100": {"display_name": "H100", "node_selector": {"gpu": "h100"}},
            "a100": {"display_name": "A100", "node_selector": {"gpu": "a100"}},
        },
        "kueue": {
            "cohort": "pool",
            "queues": {
                "team-a": {"gpus": {"h100": 4}, "borrowing_limit_gpus": 1},
                "team-b": {"gpus": {"h100": 2}},
            },
        },
        "profiles": [
            _gpu_profile("queued", "team-a", ["h100", "a100"]),
            _gpu_profile("plain", None, ["h100"]),
        ],
    }
)
NONE_FREE = {
    "h100": ModelAvailability(free=0, total=8, max_on_node=0),
    "a100": ModelAvailability(free=0, total=8, max_on_node=0),
}
QUEUED = UserContext(
    groups=frozenset({"ml"}),
    free_gpus={k: a.free for k, a in NONE_FREE.items()},
    max_free_on_node={k: 0 for k in NONE_FREE},
    gpus_total={k: a.total for k, a in NONE_FREE.items()},
    place="The cluster",
    queues_gpu_servers=True,
)


def opts(profile: str, gpus: int, model: str = "h100") -> dict:
    return {"profile": profile, "cpu": 1, "memory": 1, "gpus": gpus, "gpu_model": model, "image": "img"}


def test_a_shortage_is_a_wait_in_the_queue_not_a_refusal() -> None:
    c = validate_options(opts("queued", 5), CFG, QUEUED)  # 4 of its own + 1 it may borrow, none free now
    assert (c.gpus, c.gpu_model) == (5, "h100")


def test_without_a_queue_the_shortage_is_refused_as_before() -> None:
    with pytest.raises(OptionsError, match=r"^H100: you asked for 2 GPUs but only 0 free right now\.$"):
        validate_options(opts("plain", 2), CFG, QUEUED)
    not_queuing = UserContext(**{**QUEUED.__dict__, "queues_gpu_servers": False})
    with pytest.raises(OptionsError, match="only 0 free right now"):
        validate_options(opts("queued", 2), CFG, not_queuing)


def test_more_than_the_queue_can_ever_hold_is_refused_with_the_numbers() -> None:
    with pytest.raises(OptionsError) as e:
        validate_options(opts("queued", 6), CFG, QUEUED)
    assert e.value.field == "gpus"
    assert str(e.value) == (
        "H100: you asked for 6 GPUs, but queue team-a can never hold more than 5 (its quota 4 + 1 it may "
        "borrow), so this server could never start. Ask for at most 5."
    )
    with pytest.raises(OptionsError, match="queue team-a has no quota for A100 GPUs"):
        validate_options(opts("queued", 1, "a100"), CFG, QUEUED)
    with pytest.raises(OptionsError, match=r"GPUs must be between 1 and 8 in profile 'QUEUED', got 9"):
        validate_options(opts("queued", 9), CFG, QUEUED)


def test_pending_workloads_are_kueues_own_count() -> None:
    cqs = [dict(cq) for cq in cluster_queues(CFG)]
    cqs[0]["status"] = {"pendingWorkloads": 2, "admittedWorkloads": 1}
    assert pending_workloads(cqs) == {"team-a": 2, "team-b": 0}


def _option(html: str, slug: str, model: str) -> str:
    box = html.split(f'data-profile="{slug}"', 1)[1].split('<div class="tfdist-profile', 1)[0]
    m = re.search(rf'<option value="{model}"[^>]*>[^<]*</option>', box)
    assert m, box
    return re.sub(r"\s+", " ", m.group(0))


def test_the_form_shows_free_gpus_and_the_line_and_lets_the_user_queue() -> None:
    ctx = UserContext(**{**QUEUED.__dict__, "queue_waiting": {"team-a": 2}})
    html = render_form(CFG, ctx, NONE_FREE)
    h100 = _option(html, "queued", "h100")
    assert "(0 free · 2 waiting in team-a: your server will start when a GPU frees)" in h100
    assert "disabled" not in h100 and 'data-free=""' in h100  # the browser does not cap it to 0
    a100 = _option(html, "queued", "a100")
    assert "no quota for it" in a100 and "disabled" in a100
    plain = _option(html, "plain", "h100")  # no queue: unchanged
    assert "(0 of 8 free)" in plain and "disabled" in plain
    queued_box = html.split('data-profile="queued"', 1)[1].split('<div class="tfdist-profile', 1)[0]
    assert "are not free for you right now" not in queued_box

    unknown = render_form(CFG, QUEUED, {"h100": ModelAvailability(free=3, total=8, max_on_node=3)})
    assert "(3 free · waits in queue team-a)" in _option(unknown, "queued", "h100")


def _node(name: str, gpu: str, n: int, ready: bool = True) -> dict:
    return {
        "metadata": {"name": name, "labels": {"gpu": gpu}},
        "spec": {},
        "status": {
            "allocatable": {"nvidia.com/gpu": str(n)},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_more_than_any_node_has_is_refused_even_in_a_queue() -> None:
    nodes = [
        node_info(n) for n in (_node("a", "h100", 4), _node("b", "h100", 2), _node("c", "h100", 8, False))
    ]
    assert largest_node(nodes, CFG.gpu_models) == {"h100": 4, "a100": 0}
    ctx = UserContext(**{**QUEUED.__dict__, "largest_node_gpus": {"h100": 4}})
    assert validate_options(opts("queued", 4), CFG, ctx).gpus == 4
    with pytest.raises(OptionsError) as e:
        validate_options(opts("queued", 5), CFG, ctx)  # the queue could hold 5, no node can
    assert str(e.value) == (
        "H100: you asked for 5 GPUs, but no node has more than 4 H100 GPUs in all, and a server's GPUs must "
        "all be on one node, so this server could never start. Ask for at most 4."
    )
