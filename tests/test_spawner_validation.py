"""validate_options and the form renderer, without a hub: the rules the real-hub tests rely on."""

from __future__ import annotations

import copy
import re

import pytest

from tfdist.spawner.allocator import ModelAvailability
from tfdist.spawner.form import CUSTOM_IMAGE, form_to_raw, render_form
from tfdist.spawner.profiles import ProfilesFileError, parse_profiles
from tfdist.spawner.validation import OptionsError, UserContext, validate_options

RAW: dict = {
    "gpu_models": {"h100": {"display_name": "H100 <i>80GB</i>", "nvml_name": "NVIDIA H100.*"}},
    "profiles": [
        {
            "slug": "cpu",
            "display_name": "CPU",
            "groups": ["*"],
            "cpu": {"min": 0.5, "max": 4, "default": 1},
            "memory_gib": {"min": 0.5, "max": 8, "default": 1},
            "images": ["a:1"],
        },
        {
            "slug": "gpu",
            "display_name": "GPU",
            "description": "<script>x()</script>",
            "groups": ["ml"],
            "cpu": {"min": 1, "max": 8, "default": 2},
            "memory_gib": {"min": 1, "max": 64, "default": 4},
            "gpus": {"min": 1, "max": 4, "default": 1},
            "gpu_models": ["h100"],
            "max_gpus_per_user": 3,
            "images": ["a:1"],
            "custom_image": {"regex": r"reg\.io/[a-z]+:[0-9.]+"},
        },
    ],
}
CFG = parse_profiles(RAW)
ML = UserContext(groups=frozenset({"ml"}))


def test_empty_options_mean_first_allowed_profile_defaults() -> None:
    assert validate_options({}, CFG, UserContext()).as_user_options() == {
        "profile": "cpu",
        "cpu": 1.0,
        "memory": 1.0,
        "gpus": 0,
        "image": "a:1",
    }


def test_choice_round_trips() -> None:
    c = validate_options(
        {
            "profile": "gpu",
            "cpu": "2.5",
            "memory": 3,
            "gpus": "2",
            "gpu_model": "h100",
            "image": "reg.io/tf:2.21",
        },
        CFG,
        ML,
    )
    assert (c.cpu, c.memory_bytes, c.gpus, c.image) == (2.5, 3 * 2**30, 2, "reg.io/tf:2.21")
    assert validate_options(c.as_user_options(), CFG, ML) == c


@pytest.mark.parametrize(
    ("image", "ok"),
    [
        ("reg.io/tf:2.21", True),
        ("reg.io/tf:2.21x", False),
        ("xreg.io/tf:2.21", False),
        ("reg.io/tf:2.21\n", False),
        ("reg.io/tf:2.21\nreg.io/b:1", False),
        ("reg.io/TF:1", False),
        ("a:1", True),
    ],
)
def test_custom_image_is_a_full_match(image: str, ok: bool) -> None:
    opts = {"profile": "gpu", "cpu": 2, "memory": 4, "gpus": 1, "gpu_model": "h100", "image": image}
    if ok:
        assert validate_options(opts, CFG, ML).image == image
    else:
        with pytest.raises(OptionsError, match="does not fully match"):
            validate_options(opts, CFG, ML)


def test_cap_and_availability() -> None:
    opts = {"profile": "gpu", "cpu": 2, "memory": 4, "gpus": 2, "gpu_model": "h100", "image": "a:1"}
    with pytest.raises(OptionsError, match="your other servers hold 2, so you can ask for at most 1"):
        validate_options(opts, CFG, UserContext(groups=frozenset({"ml"}), gpus_held_elsewhere=2))
    with pytest.raises(OptionsError, match="only 1 free right now"):
        validate_options(opts, CFG, UserContext(groups=frozenset({"ml"}), free_gpus={"h100": 1}))
    # unknown availability (None) leaves it to the scheduler
    assert validate_options(opts, CFG, UserContext(groups=frozenset({"ml"}), free_gpus=None)).gpus == 2


def test_gpus_must_fit_on_one_node() -> None:
    """Kubernetes: 11 free across nodes but at most 2 on one; one server's GPUs are all on one node."""
    opts = {"profile": "gpu", "cpu": 2, "memory": 4, "gpus": 3, "gpu_model": "h100", "image": "a:1"}
    split = UserContext(groups=frozenset({"ml"}), free_gpus={"h100": 11}, max_free_on_node={"h100": 2})
    with pytest.raises(OptionsError) as e:
        validate_options(opts, CFG, split)
    assert e.value.field == "gpus"
    assert "at most 2 H100 <i>80GB</i> GPUs are free on one node now (11 free in total across nodes)" in str(
        e.value
    )
    assert validate_options({**opts, "gpus": 2}, CFG, split).gpus == 2
    one = UserContext(groups=frozenset({"ml"}), free_gpus={"h100": 3}, max_free_on_node={"h100": 1})
    with pytest.raises(
        OptionsError, match=r"at most 1 H100 .* GPU is free on one node now \(3 free in total"
    ):
        validate_options(opts, CFG, one)
    # fewer free in total than asked: the plain "only N free" message comes first
    short = UserContext(groups=frozenset({"ml"}), free_gpus={"h100": 2}, max_free_on_node={"h100": 1})
    with pytest.raises(OptionsError, match="only 2 free right now"):
        validate_options(opts, CFG, short)
    # the embedded single-machine hub knows no per-node number: only the total counts
    local = UserContext(groups=frozenset({"ml"}), free_gpus={"h100": 3})
    assert validate_options(opts, CFG, local).gpus == 3
    with pytest.raises(OptionsError, match="only 2 free right now"):
        validate_options(opts, CFG, UserContext(groups=frozenset({"ml"}), free_gpus={"h100": 2}))


def test_a_gpu_server_asks_for_at_most_its_gpus_share_of_a_node() -> None:
    """A model's cpu_per_gpu / memory_gib_per_gpu: one GPU with a whole node's CPUs would strand the rest."""
    raw = copy.deepcopy(RAW)
    raw["gpu_models"]["h100"] |= {"cpu_per_gpu": 3, "memory_gib_per_gpu": 10}
    shared = parse_profiles(raw)
    opts = {"profile": "gpu", "cpu": 4, "memory": 4, "gpus": 1, "gpu_model": "h100", "image": "a:1"}
    with pytest.raises(OptionsError) as e:
        validate_options(opts, shared, ML)
    assert e.value.field == "cpu"
    assert "at most 3 cores per GPU of H100 <i>80GB</i>" in str(e.value) and "you asked for 4" in str(e.value)
    with pytest.raises(OptionsError, match="Memory: at most 10 GiB per GPU") as e:
        validate_options({**opts, "cpu": 3, "memory": 11}, shared, ML)
    assert e.value.field == "memory"
    # two GPUs, two shares; the same options without the shares pass as before
    assert validate_options({**opts, "gpus": 2, "memory": 20}, shared, ML).cpu == 4
    assert validate_options(opts, CFG, ML).cpu == 4


def test_form_to_raw() -> None:
    raw = form_to_raw(
        {
            "_xsrf": ["t"],
            "profile": ["gpu"],
            "image": [CUSTOM_IMAGE],
            "image_custom": ["reg.io/a:1"],
            "gpus": ["1", "2"],
        }
    )
    assert raw == {"profile": "gpu", "image": "reg.io/a:1", "gpus": ["1", "2"]}
    assert form_to_raw({"image": ["a:1"], "image_custom": [""]}) == {"image": "a:1"}


def test_form_escapes_and_explains() -> None:
    html = render_form(CFG, ML, {"h100": ModelAvailability(free=0, total=2)}, remembered=())
    assert "<script>x()</script>" not in html and "&lt;script&gt;x()&lt;/script&gt;" in html
    assert "H100 &lt;i&gt;80GB&lt;/i&gt;: 0 of 2 free" in html
    # the GPU profile needs at least 1 GPU and none is free: disabled with the reason, CPU pre-selected
    assert re.search(r'value="gpu"[^>]*disabled', html) and "are not free for you right now" in html
    assert re.search(r'value="cpu"\s+checked', html)


def test_form_remembers_last_valid_and_shows_cap() -> None:
    last = {"profile": "gpu", "cpu": 3, "memory": 5, "gpus": 1, "gpu_model": "h100", "image": "reg.io/tf:1.0"}
    ctx = UserContext(groups=frozenset({"ml"}), gpus_held_elsewhere=1)
    html = render_form(
        CFG, ctx, {"h100": ModelAvailability(free=4, total=4)}, remembered=({"profile": "gone"}, last)
    )
    assert re.search(r'value="gpu"\s+checked', html)
    assert re.search(r'id="tfdist-gpu-cpu"[^>]*value="3"', html)
    assert f'<option value="{CUSTOM_IMAGE}" selected' in html and 'value="reg.io/tf:1.0"' in html
    assert "your other servers hold 1, so up to 2 here" in html
    assert 'data-cap-left="2"' in html


def test_form_shows_and_bounds_most_free_on_one_node() -> None:
    av = {"h100": ModelAvailability(free=11, total=16, max_on_node=3)}
    html = render_form(CFG, ML, av, remembered=())
    assert "H100 &lt;i&gt;80GB&lt;/i&gt;: 11 of 16 free (at most 3 on one node)" in html
    assert "H100 &lt;i&gt;80GB&lt;/i&gt; (11 of 16 free, at most 3 on one node)" in html
    assert 'data-free="11"' in html and 'data-node-max="3"' in html
    assert "<i>" not in html
    # all free GPUs on one node (or the embedded hub): nothing extra said
    for one in (ModelAvailability(free=3, total=8, max_on_node=3), ModelAvailability(free=3, total=8)):
        html = render_form(CFG, ML, {"h100": one}, remembered=())
        assert "on one node" not in html.split("<script>")[0] and 'data-node-max=""' in html
    # free GPUs but none on a usable node (e.g. 0 fit): the model and the GPU-only profile are disabled
    html = render_form(CFG, ML, {"h100": ModelAvailability(free=0, total=8, max_on_node=0)}, remembered=())
    assert re.search(r'value="gpu"[^>]*disabled', html)


@pytest.mark.parametrize(
    "regex",
    [
        r"reg\.io/(?!evil)[a-z]+:1",  # lookaround
        r"(reg)\.io/\1:1",  # a backreference
        r"reg\.io/[a-z]++:1",  # possessive
        r"reg\.io/x\Z",
        r"(?x) reg\.io/ [a-z]+ :1",  # a Python-only flag
        r"reg\.io/[a-z]{,3}:1",  # a repeat in Python, text in RE2
        r"reg\.io/[[:alnum:]]+:1",  # a set and a "]" in Python, a class in RE2: they would admit differently
        r"reg\.io/[a-z]{2000}:1",  # beyond RE2's repeat count
    ],
)
def test_a_custom_image_pattern_the_admission_policy_cannot_read_stops_the_hub(regex: str) -> None:
    """The user namespace's admission policy checks job pods' images against the same pattern with RE2
    (CEL's `matches`): a Python-only construct would refuse every custom image there, or read differently."""
    raw = copy.deepcopy(RAW)
    raw["profiles"][1]["custom_image"] = {"regex": regex}
    with pytest.raises(ProfilesFileError, match=r"custom_image\.regex: (uses .*, which RE2|repeats .*: RE2)"):
        parse_profiles(raw)
