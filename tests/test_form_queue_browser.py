"""A queued GPU profile's form in a real browser: the GPU count is capped where validation would refuse.

A server that waits in a Kueue queue is not capped by the GPUs free now (it waits for them), but by what the
queue can ever hold (its quota plus what it may borrow) and by the largest node; the form's script says
which, so a user never submits a count the hub then refuses. Debian's chromium, driven by playwright, loads
the form as `render_form` writes it (no hub: the hub's side is tests/test_hub_browser.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tfdist.spawner.allocator import ModelAvailability
from tfdist.spawner.form import render_form
from tfdist.spawner.profiles import parse_profiles
from tfdist.spawner.validation import OptionsError, UserContext, validate_options

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"

CFG = parse_profiles(
    {
        "gpu_models": {"h100": {"display_name": "H100", "node_selector": {"gpu": "h100"}}},
        "kueue": {
            "cohort": "pool",
            "queues": {
                "team-a": {"gpus": {"h100": 4}, "borrowing_limit_gpus": 1},
                "team-b": {"gpus": {"h100": 2}},
            },
        },
        "profiles": [
            {
                "slug": "queued",
                "display_name": "Queued GPU",
                "groups": ["ml"],
                "cpu": {"min": 1, "max": 8, "default": 1},
                "memory_gib": {"min": 1, "max": 8, "default": 1},
                "gpus": {"min": 1, "max": 8, "default": 1},
                "gpu_models": ["h100"],
                "kueue_queue": "team-a",
                "images": ["img"],
            }
        ],
    }
)
NONE_FREE = {"h100": ModelAvailability(free=0, total=8, max_on_node=0)}


def _ctx(largest_node: int | None) -> UserContext:
    return UserContext(
        groups=frozenset({"ml"}),
        free_gpus={"h100": 0},
        max_free_on_node={"h100": 0},
        gpus_total={"h100": 8},
        place="The cluster",
        queues_gpu_servers=True,
        largest_node_gpus={"h100": largest_node} if largest_node is not None else None,
    )


@pytest.fixture(scope="module")
def page() -> Iterator:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/test does this)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield browser.new_page()
        finally:
            browser.close()


def _load(page, ctx: UserContext) -> None:
    html = render_form(CFG, ctx, NONE_FREE)
    page.set_content(f'<html><body><form id="spawn_form">{html}</form></body></html>')


@pytest.mark.parametrize(
    ("largest_node", "most", "why"),
    [
        (None, 5, "queue team-a"),  # 4 of its own + 1 it may borrow; none free now is no cap
        (8, 5, "queue team-a"),
        (3, 3, "queue team-a"),  # no node has more than 3: more could never be placed
    ],
)
def test_the_gpu_count_is_capped_by_what_the_queue_can_ever_hold(page, largest_node, most, why) -> None:
    from playwright.sync_api import expect

    ctx = _ctx(largest_node)
    _load(page, ctx)
    gpus = page.locator("#tfdist-queued-gpus")
    expect(gpus).to_have_attribute("max", str(most))
    hint = page.locator("#tfdist-fields-queued .tfdist-gpu-hint")
    expect(hint).to_contain_text(f"1 to {most} (the most a server of this model can ever get in {why})")
    # the browser's cap is the server's: one more is refused there, the cap itself is accepted
    assert validate_options(_opts(most), CFG, ctx).gpus == most
    with pytest.raises(OptionsError):
        validate_options(_opts(most + 1), CFG, ctx)


def _opts(gpus: int) -> dict:
    return {"profile": "queued", "cpu": 1, "memory": 1, "gpus": gpus, "gpu_model": "h100", "image": "img"}
