"""The embedded hub, end to end: a real `jupyterhub` process with TfdistLocalSpawner and a fake NVML.

Everything goes through JupyterHub's own HTTP surface: login with the shared password, the spawn form
(GET and POST with xsrf), and the REST API with a service token. One hub serves the whole module.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hub_fixtures import RunningHub, error_text, hub_env, start_hub, write_config

PROFILES = r"""
gpu_models:
  h100:
    display_name: "NVIDIA H100 80GB"
    nvml_name: "NVIDIA H100.*"
  a100:
    display_name: "NVIDIA A100 40GB"
    nvml_name: "NVIDIA A100.*"
profiles:
  - slug: cpu
    display_name: "CPU only"
    description: "Small <b>CPU</b> server"
    groups: ["*"]
    cpu: {min: 0.5, max: 4, default: 1}
    memory_gib: {min: 0.5, max: 8, default: 1}
    images:
      - local
      - {image: "quay.io/jupyter/minimal-notebook:2026-01-01", display_name: "Minimal"}
  - slug: gpu
    display_name: "GPU"
    groups: [gpu-users]
    cpu: {min: 1, max: 8, default: 2}
    memory_gib: {min: 1, max: 64, default: 4}
    gpus: {min: 0, max: 4, default: 1}
    gpu_models: [h100, a100]
    max_gpus_per_user: 3
    images: [local]
    custom_image:
      regex: 'registry\.example\.org/team/[a-z0-9-]+:[a-z0-9.-]+'
      help: "images from registry.example.org/team/"
"""
FAKE_GPUS = ["NVIDIA H100 80GB HBM3"] * 3
GROUPS = {"gpu-users": ["alice", "bob", "dave"], "platform": ["erin"]}

GPU = {"profile": "gpu", "cpu": "2", "memory": "4", "gpus": "1", "gpu_model": "h100", "image": "local"}
CPU = {"profile": "cpu", "cpu": "1", "memory": "1", "image": "local"}
DROP = object()


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = dict(base)
    for k, v in changes.items():
        if v is DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


# (id, user, options as form strings, expected text in the message)
BAD_INPUT = [
    ("gpus-negative", "alice", _with(GPU, gpus="-1"), "GPUs cannot be negative"),
    ("gpus-fractional", "alice", _with(GPU, gpus="1.5"), "GPUs must be a whole number"),
    ("gpus-above-range", "alice", _with(GPU, gpus="5"), "GPUs must be between 0 and 4"),
    ("gpus-above-user-cap", "alice", _with(GPU, gpus="4"), "at most 3 GPUs across all your servers"),
    ("gpus-for-cpu-profile", "alice", _with(CPU, gpus="1"), "offers no GPUs"),
    ("gpus-not-a-number", "alice", _with(GPU, gpus="two"), "GPUs must be a whole number"),
    ("cpu-zero", "alice", _with(GPU, cpu="0"), "CPU must be between 1 and 8"),
    ("cpu-negative", "alice", _with(GPU, cpu="-2"), "CPU must be between 1 and 8"),
    ("cpu-not-a-number", "alice", _with(GPU, cpu="lots"), "CPU must be a number"),
    ("cpu-1e3", "alice", _with(GPU, cpu="1e3"), "CPU must be a number"),
    ("cpu-non-ascii-digit", "alice", _with(GPU, cpu="\u0662"), "CPU must be a number"),
    ("cpu-huge", "alice", _with(GPU, cpu="99999999999999999999999"), "CPU must be between 1 and 8"),
    ("cpu-inf", "alice", _with(GPU, cpu="inf"), "CPU must be a number"),
    ("cpu-percent", "alice", _with(GPU, cpu="50%"), "got '50%'"),
    ("memory-zero", "alice", _with(GPU, memory="0"), "Memory must be between 1 and 64"),
    ("memory-negative", "alice", _with(GPU, memory="-4"), "Memory must be between 1 and 64"),
    ("memory-Gi-unit", "alice", _with(GPU, memory="4Gi"), "Write the number only"),
    ("memory-GB-unit", "alice", _with(GPU, memory="4GB"), "Write the number only"),
    ("memory-spaced-unit", "alice", _with(GPU, memory="4 G"), "Write the number only"),
    ("memory-1e3", "alice", _with(GPU, memory="1e3"), "Memory must be a number"),
    ("memory-fullwidth-digit", "alice", _with(GPU, memory="\uff14"), "Memory must be a number"),
    ("memory-huge", "alice", _with(GPU, memory="1000000"), "Memory must be between 1 and 64"),
    ("profile-not-in-my-groups", "carol", GPU, "is not available to you"),
    ("profile-unknown", "alice", _with(GPU, profile="nope"), "No such profile: 'nope'"),
    ("gpu-model-unknown", "alice", _with(GPU, gpu_model="v100"), "No GPU model 'v100'"),
    ("gpu-model-none-free", "alice", _with(GPU, gpu_model="a100"), "only 0 free"),
    ("image-off-list", "alice", _with(GPU, image="docker.io/library/python:3"), "does not fully match"),
    (
        "image-prefix-match",
        "alice",
        _with(GPU, image="registry.example.org/team/tf:2.21/../../evil"),
        "does not fully match",
    ),
    (
        "image-newline-trick",
        "alice",
        _with(GPU, image="registry.example.org/team/tf:2.21\nevil.example.com/x:1"),
        "does not fully match",
    ),
    (
        "image-trailing-newline",
        "alice",
        _with(GPU, image="registry.example.org/team/tf:2.21\n"),
        "does not fully",
    ),
    (
        "image-custom-not-allowed",
        "alice",
        _with(CPU, image="registry.example.org/team/tf:1"),
        "allows no other",
    ),
    ("html-in-profile", "alice", _with(GPU, profile="<script>alert(1)</script>"), "No such profile"),
    ("html-in-image", "alice", _with(GPU, image="<img src=x onerror=alert(1)>"), "does not fully match"),
    ("html-in-cpu", "alice", _with(GPU, cpu="<b>2</b>"), "CPU must be a number"),
    ("unknown-key", "alice", _with(GPU, extra="1"), "Unknown option(s): 'extra'"),
    ("missing-memory", "alice", _with(GPU, memory=DROP), "Missing option(s): memory"),
    ("missing-gpu-model", "alice", _with(GPU, gpu_model=DROP), "Missing option: gpu_model"),
    ("missing-profile", "alice", _with(GPU, profile=DROP), "Missing option: profile"),
    ("field-sent-twice", "alice", _with(GPU, gpus=["1", "2"]), "got a list"),
]

# REST bodies that only JSON can express; (id, user_options, expected)
BAD_JSON_TYPES = [
    ("cpu-bool", _with(GPU, cpu=True), "got true"),
    ("memory-null", _with(GPU, memory=None), "got null"),
    ("gpus-float", _with(GPU, gpus=1.0), "GPUs must be a whole number"),
    ("image-number", _with(GPU, image=5), "image must be a string, got 5"),
    ("profile-object", _with(GPU, profile={"a": 1}), "profile must be a string, got an object"),
    ("memory-list", _with(GPU, memory=[4]), "got a list"),
    ("cpu-nan", _with(GPU, cpu=float("nan")), "finite number"),
    ("gpu-model-number", _with(GPU, gpu_model=1), "gpu_model must be a string"),
    ("cpu-huge-int", _with(GPU, cpu=10**400), "is out of range"),  # float() overflows: a 400, not a 500
]

_NUM = re.compile(r"-?[0-9]+(\.[0-9]+)?")


def as_json(options: dict[str, Any]) -> dict[str, Any]:
    """The REST form of a form case: numeric strings become JSON numbers, lists of them lists of numbers."""

    def conv(v: Any) -> Any:
        if isinstance(v, str) and _NUM.fullmatch(v):
            return json.loads(v)
        if isinstance(v, list):
            return [conv(x) for x in v]
        return v

    return {k: conv(v) for k, v in options.items()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHub]:
    h = start_hub(
        tmp_path_factory.mktemp("hub"),
        profiles_yaml=PROFILES,
        fake_gpus=FAKE_GPUS,
        groups=GROUPS,
        examples=Path(__file__).resolve().parent.parent / "examples",
    )
    try:
        yield h
    finally:
        h.stop()


def _env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def _free_text(html: str) -> str:
    m = re.search(r'id="tfdist-free-gpus">(.*?)</p>', html, re.S)
    assert m, "no free-GPU display in the form"
    return " ".join(re.sub(r"<[^>]+>", " ", m.group(1)).split())


def test_form_lists_only_allowed_profiles_and_free_gpus(hub: RunningHub) -> None:
    r = hub.spawn_form("alice")
    assert r.status_code == 200
    assert 'value="gpu"' in r.text and 'value="cpu"' in r.text
    assert "NVIDIA H100 80GB: 3 of 3 free" in _free_text(r.text)
    # the A100 has no GPU on this machine: shown, but its option is disabled
    assert re.search(r'<option value="a100"[^>]*disabled', r.text)
    # admin-written HTML is escaped
    assert "Small &lt;b&gt;CPU&lt;/b&gt; server" in r.text
    carol = hub.spawn_form("carol")
    assert 'value="gpu"' not in carol.text and 'value="cpu"' in carol.text


@pytest.mark.parametrize(("case", "user", "options", "expected"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_by_form(
    hub: RunningHub, case: str, user: str, options: dict[str, Any], expected: str
) -> None:
    r = hub.post_form(user, options)
    assert r.status_code == 400, (case, r.status_code, r.text[:300])
    assert expected in error_text(r), error_text(r)
    assert hub.servers(user) == {}
    # whatever was typed comes back escaped, never as markup
    assert "<script>alert(1)</script>" not in r.text
    assert "<img src=x" not in r.text and "<b>2</b>" not in r.text


@pytest.mark.parametrize(("case", "user", "options", "expected"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_by_rest(
    hub: RunningHub, case: str, user: str, options: dict[str, Any], expected: str
) -> None:
    r = hub.api("POST", f"/users/{user}/server", json={"user_options": as_json(options)})
    assert r.status_code == 400, (case, r.status_code, r.text[:300])
    assert expected in r.json()["message"]
    assert hub.servers(user) == {}


@pytest.mark.parametrize(("case", "options", "expected"), BAD_JSON_TYPES, ids=[c[0] for c in BAD_JSON_TYPES])
def test_bad_json_types_by_rest(hub: RunningHub, case: str, options: dict[str, Any], expected: str) -> None:
    # json.dumps, not requests' json=: Python's JSON (like tornado's parser) writes and reads NaN
    body = json.dumps({"user_options": as_json(options)})
    r = hub.api("POST", "/users/alice/server", data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (case, r.status_code, r.text[:300])
    assert expected in r.json()["message"]
    assert hub.servers("alice") == {}


@pytest.mark.parametrize(
    "body", [[1, 2], "gpu", {"user_options": ["profile"]}], ids=["list", "string", "opts-list"]
)
def test_malformed_rest_body_is_400(hub: RunningHub, body: Any) -> None:
    r = hub.api("POST", "/users/alice/server", data=json.dumps(body))
    assert r.status_code == 400
    assert hub.servers("alice") == {}


def test_start_reach_and_remember(hub: RunningHub) -> None:
    """1 CPU / 1 GiB / 0 GPUs through the form; the server answers; the choice is remembered."""
    r = hub.post_form("dave", {"profile": "cpu", "cpu": "1.5", "memory": "1", "image": "local"})
    assert r.status_code == 302, error_text(r)
    hub.wait_ready("dave")
    s = hub.session("dave")
    lab = s.get(f"{hub.url}/user/dave/lab", timeout=60)
    assert lab.status_code == 200 and "JupyterLab" in lab.text
    status = s.get(
        f"{hub.url}/user/dave/api/status", headers={"Authorization": f"token {hub.token}"}, timeout=30
    )
    assert status.status_code == 200
    pid = hub.server_pid("dave")
    env = _env_of(pid)
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU server sees no GPU
    assert env["TFDIST_GPUS"] == "0" and env["TFDIST_BACKEND"] == "local" and env["TFDIST_USER"] == "dave"
    assert env["MEM_LIMIT"] == str(2**30)
    assert env["TFDIST_STATE_DIR"] == str(Path(hub.state_dir, "users", "dave", ".tfdist", "jobs"))
    assert len(os.sched_getaffinity(pid)) == min(2, len(os.sched_getaffinity(0)))  # 1.5 cores -> 2
    examples = Path(hub.state_dir, "users", "dave", "examples")
    if Path(__file__).resolve().parent.parent.joinpath("examples").is_dir():
        assert examples.is_dir()
    hub.stop_server("dave")
    # a bad REST request later overwrites the hub's saved user_options; the form still offers the last good
    bad = hub.api("POST", "/users/dave/server", json={"user_options": _with(as_json(CPU), cpu=99)})
    assert bad.status_code == 400
    form = hub.spawn_form("dave").text
    assert re.search(r'<input[^>]*value="cpu"[^>]*checked', form)
    assert re.search(r'id="tfdist-cpu-cpu"[^>]*value="1.5"', form)


def test_gpus_are_exclusive(hub: RunningHub) -> None:
    """3 fake GPUs: alice takes 2; bob asking for 2 gets 'only 1 free' (REST and form); bob gets the third."""
    ok = hub.api("POST", "/users/alice/servers/a", json={"user_options": as_json(_with(GPU, gpus="2"))})
    assert ok.status_code in (201, 202), ok.text
    hub.wait_ready("alice", "a")
    assert _env_of(hub.server_pid("alice", "a"))["CUDA_VISIBLE_DEVICES"] == "0,1"

    two = as_json(_with(GPU, gpus="2"))
    r = hub.api("POST", "/users/bob/server", json={"user_options": two})
    assert r.status_code == 400 and "only 1 free" in r.json()["message"]
    f = hub.post_form("bob", _with(GPU, gpus="2"))
    assert f.status_code == 400 and "only 1 free" in error_text(f)
    assert hub.servers("bob") == {}
    assert "NVIDIA H100 80GB: 1 of 3 free" in _free_text(hub.spawn_form("bob").text)

    # the per-user cap counts alice's other server: 2 held + 2 asked > 3
    cap = hub.api("POST", "/users/alice/servers/b", json={"user_options": two})
    assert cap.status_code == 400 and "your other servers hold 2" in cap.json()["message"]

    one = hub.post_form("bob", GPU)
    assert one.status_code == 302, error_text(one)
    hub.wait_ready("bob")
    assert _env_of(hub.server_pid("bob"))["CUDA_VISIBLE_DEVICES"] == "2"
    assert "NVIDIA H100 80GB: 0 of 3 free" in _free_text(hub.spawn_form("alice").text)
    hub.stop_server("alice", "a")
    hub.stop_server("bob")
    assert "NVIDIA H100 80GB: 3 of 3 free" in _free_text(hub.spawn_form("bob").text)


def test_bad_input_never_restarts_the_hub(hub: RunningHub) -> None:
    """consecutive_failure_limit is 3 here: a rejected spawn must not count as a failed one, or the hub
    would exit after the third. Its own 6 in a row (on top of the module's ~90), then a good one."""
    pid = hub.proc.pid
    for case, user, options, expected in BAD_INPUT[:6]:
        r = hub.api("POST", f"/users/{user}/server", json={"user_options": as_json(options)})
        assert r.status_code == 400 and expected in r.json()["message"], (case, r.status_code, r.text[:300])
    assert hub.proc.poll() is None and hub.proc.pid == pid
    assert hub.api("GET", "/").status_code == 200
    ok = hub.post_form("bob", CPU)
    assert ok.status_code == 302, error_text(ok)
    hub.wait_ready("bob")
    hub.stop_server("bob")
    assert hub.proc.poll() is None


def test_broken_profiles_file_stops_the_hub(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text(
        "profiles:\n  - slug: gpu\n    display_name: GPU\n    groups: ['*']\n"
        "    cpu: {min: 4, max: 2, default: 3}\n"
        "    memory_gib: {min: 1, max: 2, default: 1}\n    images: [x]\n"
    )
    cfg = write_config(
        tmp_path, port=0, password="p" * 12, token="t" * 32, profiles=profiles, fake_gpus=None, groups={}
    )
    res = subprocess.run(
        [sys.executable, "-m", "jupyterhub", "-f", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        env=hub_env(),
        cwd=tmp_path,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"{profiles}: profiles[0] (gpu).cpu: min (4) is above max (2)" in res.stderr


def test_bad_input_by_spawn_url_query(hub: RunningHub) -> None:
    """``/hub/spawn?opt-...``: a GET has no XSRF check, so a link (from any site) must not start a server."""
    s = hub.session("alice")
    r = s.get(
        f"{hub.url}/hub/spawn/alice",
        params={
            "opt-profile": "gpu",
            "opt-cpu": "2",
            "opt-memory": "4Gi",
            "opt-gpus": "1",
            "opt-gpu_model": "h100",
            "opt-image": "local",
        },
        timeout=30,
    )
    assert r.status_code == 400
    assert "not from a link" in error_text(r)
    assert hub.servers("alice") == {}


def test_hub_cuda_visible_devices_reserves_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub started with CUDA_VISIBLE_DEVICES=0,2 on a 3-GPU machine hands out only GPUs 0 and 2."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    h = start_hub(tmp_path, profiles_yaml=PROFILES, fake_gpus=FAKE_GPUS, groups=GROUPS)
    try:
        assert "NVIDIA H100 80GB: 2 of 2 free" in _free_text(h.spawn_form("alice").text)
        ok = h.api("POST", "/users/alice/server", json={"user_options": as_json(_with(GPU, gpus="2"))})
        assert ok.status_code in (201, 202), ok.text
        h.wait_ready("alice")
        env = _env_of(h.server_pid("alice"))
        assert env["CUDA_VISIBLE_DEVICES"] == "0,2" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        r = h.api("POST", "/users/bob/server", json={"user_options": as_json(GPU)})
        assert r.status_code == 400 and "only 0 free" in r.json()["message"]
        h.stop_server("alice")
        assert "NVIDIA H100 80GB: 2 of 2 free" in _free_text(h.spawn_form("bob").text)
    finally:
        h.stop()
