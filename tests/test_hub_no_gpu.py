"""A new user on a machine without GPUs (issue 15): the login page says where the password is, the form says
plainly that there are no GPUs and offers no GPU profile, and the hub refuses one sent anyway.

The form and validation rules are checked as functions first, then through a real `jupyterhub` process
(the embedded hub as `tfdist-local-hub` configures it) whose NVML is the test double with no GPU at all.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hub_fixtures import RunningHub, error_text, start_hub
from tfdist.spawner.allocator import ModelAvailability
from tfdist.spawner.form import render_form
from tfdist.spawner.profiles import load_profiles
from tfdist.spawner.validation import OptionsError, UserContext, validate_options

PACKAGED = Path(__file__).resolve().parent.parent / "spawner" / "data" / "profiles-local.yaml"
CFG = load_profiles(str(PACKAGED))
NONE = {"gpu": ModelAvailability(free=0, total=0)}
GPU_CHOICE = {"profile": "gpu", "cpu": "1", "memory": "2", "gpus": "1", "gpu_model": "gpu", "image": "local"}
GPU_ZERO = {**GPU_CHOICE, "gpus": "0", "gpu_model": ""}
NO_GPU_CTX = UserContext(gpus_total={"gpu": 0}, place="This machine")


def _radios(html: str) -> list[str]:
    return re.findall(r'name="profile" value="([^"]+)"', html)


def test_form_without_gpus_says_so_and_offers_cpu_only() -> None:
    html = render_form(CFG, UserContext(place="This machine"), NONE)
    assert "This machine has no GPUs: CPU profiles only." in html
    assert "0 of 0 free" not in html and "GPU model" not in html
    assert _radios(html) == ["cpu"]
    assert re.search(r'value="cpu"\s+checked', html)
    cpu = CFG.profile("cpu")
    assert cpu is not None and cpu.description.strip()
    # every offered profile's description is shown (what the example needs is written there)
    assert "tfdist-description" in html and cpu.description.strip().split("\n")[0] in html


def test_form_forgets_a_remembered_gpu_choice_when_the_machine_has_none() -> None:
    html = render_form(CFG, UserContext(place="This machine"), NONE, remembered=(GPU_CHOICE,))
    assert _radios(html) == ["cpu"] and re.search(r'value="cpu"\s+checked', html)
    html = render_form(CFG, UserContext(), NONE, submitted=GPU_CHOICE)  # a refused POST comes back
    assert _radios(html) == ["cpu"] and re.search(r'value="cpu"\s+checked', html)


def test_form_with_gpus_or_unknown_availability_still_offers_the_gpu_profile() -> None:
    html = render_form(CFG, UserContext(), {"gpu": ModelAvailability(free=1, total=2)})
    assert _radios(html) == ["cpu", "gpu"] and "no GPUs" not in html and "1 of 2 free" in html
    html = render_form(CFG, UserContext(), None)  # unknown (e.g. the cluster view is not loaded yet)
    assert _radios(html) == ["cpu", "gpu"] and "no GPUs" not in html


@pytest.mark.parametrize("opts", [GPU_CHOICE, GPU_ZERO], ids=["one-gpu", "zero-gpus"])
def test_validation_refuses_a_gpu_profile_on_a_machine_without_gpus(opts: dict[str, str]) -> None:
    with pytest.raises(OptionsError) as e:
        validate_options(opts, CFG, NO_GPU_CTX)
    assert e.value.message == (
        "This machine has no GPUs, so profile 'GPU' cannot start here. "
        "Choose a profile without GPUs: 'CPU only'."
    )
    assert e.value.field == "profile"
    # unknown availability: the scheduler decides, nothing is refused for it
    assert validate_options(GPU_ZERO, CFG, UserContext()).profile == "gpu"
    # a cluster names itself
    with pytest.raises(OptionsError, match=r"^The cluster has no GPUs"):
        validate_options(opts, CFG, UserContext(gpus_total={"gpu": 0}, place="The cluster"))


def test_empty_options_skip_a_gpu_profile_listed_first_when_there_are_no_gpus() -> None:
    flipped = CFG.model_copy(update={"profiles": list(reversed(CFG.profiles))})
    assert flipped.profiles[0].slug == "gpu"
    assert validate_options({}, flipped, NO_GPU_CTX).profile == "cpu"
    assert validate_options({}, flipped, UserContext()).profile == "gpu"
    only_gpu = CFG.model_copy(update={"profiles": [CFG.profile("gpu")]})
    with pytest.raises(OptionsError, match="Ask a hub admin for a profile without GPUs"):
        validate_options({}, only_gpu, NO_GPU_CTX)


# ---- a real hub with no GPU -------------------------------------------------------------------------


# slowpoke's start takes 25 s (test_a_slow_start_still_reaches_the_spawn_page); everyone else's is as ever
SLOW_START = (
    "import asyncio\n"
    "async def _slow(spawner):\n"
    "    if spawner.user.name == 'slowpoke':\n"
    "        await asyncio.sleep(25)\n"
    "c.Spawner.pre_spawn_hook = _slow\n"
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    h = start_hub(
        tmp_path_factory.mktemp("nogpuhub"),
        profiles_yaml=PACKAGED.read_text(),
        fake_gpus=[],
        extra=SLOW_START,
    )
    try:
        yield h
    finally:
        h.stop()


def test_login_page_says_where_the_password_is(hub: RunningHub) -> None:
    import requests

    page = requests.get(f"{hub.url}/hub/login", timeout=30).text
    assert 'id="tfdist-login-hint"' in page
    text = re.sub(r"<[^>]+>", "", page)
    text = re.sub(r"\s+", " ", text)
    assert "any user name" in text
    assert "password printed in the terminal where this hub was started" in text
    assert "scripts/run-hub" in text and "tfdist-local-hub" in text
    # still JupyterHub's own login form (not a hand-rolled one)
    assert 'id="username_input"' in page and 'id="password_input"' in page and 'name="_xsrf"' in page


def test_real_hub_form_and_refusals_without_gpus(hub: RunningHub) -> None:
    form = hub.spawn_form("nina").text
    assert "This machine has no GPUs: CPU profiles only." in form
    assert _radios(form) == ["cpu"] and "0 of 0 free" not in form
    refusal = "This machine has no GPUs, so profile 'GPU' cannot start here."
    expected = f"{refusal} Choose a profile without GPUs: 'CPU only'."
    for opts in (GPU_CHOICE, GPU_ZERO):
        r = hub.post_form("nina", opts)
        assert r.status_code == 400 and error_text(r).removeprefix("Error: ") == expected
        assert "This machine has no GPUs: CPU profiles only." in r.text  # the form comes back, CPU only
        rest = hub.api(
            "POST", "/users/nina/server", json={"user_options": {**opts, "gpus": int(opts["gpus"])}}
        )
        assert rest.status_code == 400 and error_text(rest) == expected
    assert hub.servers("nina") == {}


def test_a_slow_start_still_reaches_the_spawn_page(hub: RunningHub) -> None:
    """The spawn page follows the start through the proxy's progress stream; a start over 20 s (a busy
    machine) used to cut it (the Python proxy's default timeout), leaving the page waiting for good."""
    import time

    import requests

    t0 = time.monotonic()
    r = hub.post_form("slowpoke", {"profile": "cpu", "cpu": "1", "memory": "1", "image": "local"})
    assert r.status_code == 302, error_text(r)
    s: requests.Session = hub.session("slowpoke")
    prog = s.get(
        f"{hub.url}/hub/api/users/slowpoke/server/progress",
        params={"_xsrf": s.cookies.get("_xsrf")},
        headers={"Accept": "text/event-stream"},
        timeout=300,
    )
    took = time.monotonic() - t0
    assert prog.status_code == 200, (prog.status_code, prog.text[:500])
    assert '"ready": true' in prog.text, prog.text[-1000:]
    assert took > 25
    hub.stop_server("slowpoke")
