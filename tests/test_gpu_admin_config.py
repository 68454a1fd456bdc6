"""The profiles file's gpu_admin section (GPU-idle culling) and the culler's decision, without a hub.

Bad admin config must stop the hub with file, key and reason; `tfdist-local-hub` is started for real once
to prove it does.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tfdist.hubadmin.config import CullingRule
from tfdist.hubadmin.culler import decide
from tfdist.spawner.profiles import ProfilesFileError, load_profiles

BASE = """
gpu_models:
  h100: {display_name: "H100", nvml_name: "NVIDIA H100.*"}
profiles:
  - slug: cpu
    display_name: CPU
    groups: ["*"]
    cpu: {min: 1, max: 2, default: 1}
    memory_gib: {min: 1, max: 4, default: 1}
    images: [local]
  - slug: gpu
    display_name: GPU
    groups: ["*"]
    cpu: {min: 1, max: 2, default: 1}
    memory_gib: {min: 1, max: 4, default: 1}
    gpus: {min: 0, max: 2, default: 1}
    gpu_models: [h100]
    images: [local]
"""


def load(tmp_path: Path, section: str):
    p = tmp_path / "profiles.yaml"
    p.write_text(BASE + textwrap.dedent(section))
    return p, load_profiles(p)


def test_a_good_section_gives_per_profile_rules(tmp_path: Path) -> None:
    _, cfg = load(
        tmp_path,
        """
        gpu_admin:
          culling:
            check_interval_s: 30
            default: {idle_below_percent: 5, idle_minutes: 60, warn_minutes: 10}
            profiles:
              gpu: {idle_minutes: 20, cull_during_jobs: true}
        """,
    )
    c = cfg.gpu_admin.culling
    assert c is not None and c.check_interval_s == 30
    assert c.rule("gpu") == CullingRule(
        idle_below_percent=5, idle_minutes=20, warn_minutes=10, cull_during_jobs=True
    )
    assert c.rule("cpu") == c.default and c.rule(None) == c.default


def test_no_section_means_no_culling(tmp_path: Path) -> None:
    assert load(tmp_path, "")[1].gpu_admin.culling is None


BAD = [
    (
        "negative-idle",
        "default: {idle_minutes: -5}",
        "gpu_admin.culling.default.idle_minutes",
        "greater than 0",
    ),
    (
        "negative-warn",
        "default: {warn_minutes: -1}",
        "gpu_admin.culling.default.warn_minutes",
        "greater than or equal to 0",
    ),
    (
        "percent-over-100",
        "default: {idle_below_percent: 150}",
        "gpu_admin.culling.default.idle_below_percent",
        "less than or equal to 100",
    ),
    (
        "percent-zero",
        "default: {idle_below_percent: 0}",
        "gpu_admin.culling.default.idle_below_percent",
        "greater than 0",
    ),
    (
        "warn-not-below-idle",
        "default: {idle_minutes: 10, warn_minutes: 10}",
        "gpu_admin.culling.default",
        "warn_minutes (10) must be below idle_minutes (10)",
    ),
    (
        "beyond-tracked-history",
        "default: {idle_minutes: 1000}",
        "gpu_admin.culling.default.idle_minutes",
        "less than or equal to 360",
    ),
    ("nan", "default: {idle_minutes: .nan}", "gpu_admin.culling.default.idle_minutes", ""),
    ("unknown-key", "default: {idle_minute: 10}", "gpu_admin.culling.default.idle_minute", "unknown key"),
    (
        "unknown-profile",
        "profiles: {gpux: {idle_minutes: 50}}",
        "(top level)",
        "'gpux', which is not a profile",
    ),
    (
        "override-breaks-rule",
        "profiles: {gpu: {warn_minutes: 90}}",
        "gpu_admin.culling",
        "profiles.gpu: warn_minutes (90) must be below idle_minutes (60)",
    ),
    ("negative-interval", "check_interval_s: -1", "gpu_admin.culling.check_interval_s", "greater than 0"),
    (
        "threshold-as-text",
        "default: {idle_minutes: soon}",
        "gpu_admin.culling.default.idle_minutes",
        "valid number",
    ),
]


@pytest.mark.parametrize(("section", "key", "reason"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_admin_config_names_file_key_and_reason(
    tmp_path: Path, section: str, key: str, reason: str
) -> None:
    with pytest.raises(ProfilesFileError) as e:
        load(tmp_path, "gpu_admin:\n  culling:\n    " + section + "\n")
    text = str(e.value)
    assert f"{tmp_path / 'profiles.yaml'}: {key}" in text, text
    assert reason in text, text


def test_local_hub_refuses_to_start_with_a_negative_threshold(tmp_path: Path) -> None:
    p = tmp_path / "profiles.yaml"
    p.write_text(BASE + "gpu_admin:\n  culling:\n    default: {idle_minutes: -1}\n")
    exe = Path(sys.executable).parent / "tfdist-local-hub"
    r = subprocess.run(
        [str(exe), "--profiles", str(p), "--state-dir", str(tmp_path / "s"), "--password", "long-enough-pw"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert f"{p}: gpu_admin.culling.default.idle_minutes: Input should be greater than 0" in r.stderr, (
        r.stderr
    )


RULE = CullingRule(idle_below_percent=10, idle_minutes=30, warn_minutes=5)
GPU1 = [{"index": 0, "name": "H100", "uuid": "GPU-1"}]


def rep(idle: float | None, jobs: int = 0, gpus=GPU1) -> dict:
    return {"gpus": gpus, "idle_s": idle, "jobs_running": [{"name": "j"}] * jobs}


def test_decisions() -> None:
    now = 1000.0
    assert decide(RULE, rep(None, gpus=[]), None, now).action == "cpu-only"
    assert decide(None, rep(5000), None, now).action == "disabled"
    assert decide(RULE.model_copy(update={"enabled": False}), rep(5000), None, now).action == "disabled"
    assert decide(RULE, rep(None), None, now).action == "unknown"
    assert decide(RULE, rep(24 * 60), None, now).action == "active"  # 24 min < 30 - 5
    w = decide(RULE, rep(25 * 60), None, now)
    assert (w.action, w.cull_at) == ("warn", now + 5 * 60)
    # first seen long idle: still the whole warning time
    w = decide(RULE, rep(300 * 60), None, now)
    assert (w.action, w.cull_at) == ("warn", now + 5 * 60)
    assert decide(RULE, rep(29 * 60), now + 60, now).action == "warned"
    assert decide(RULE, rep(30 * 60), now, now).action == "cull"
    # warned, then the GPU was used: active again (the service withdraws the notice)
    assert decide(RULE, rep(10), now, now + 1).action == "active"
    # a running job protects the server unless the admin allows it
    assert decide(RULE, rep(300 * 60, jobs=1), now - 1, now).action == "job-running"
    allow = RULE.model_copy(update={"cull_during_jobs": True})
    assert decide(allow, rep(300 * 60, jobs=1), now - 1, now).action == "cull"
    # no warning time: stop at once
    assert decide(CullingRule(idle_minutes=1, warn_minutes=0), rep(60), None, now).action == "cull"


@pytest.mark.parametrize("flag", [None, "--no-gpu-admin"])
def test_local_hub_runs_the_gpu_admin_service_unless_told_not_to(tmp_path: Path, flag: str | None) -> None:
    import requests

    from tests.hub_fixtures import start_local_hub_command

    hub = start_local_hub_command(tmp_path, *([flag] if flag else []))
    try:
        url = f"{hub.url}/services/tfdist-gpu-admin/"
        deadline = time.monotonic() + 30
        r = requests.get(url, allow_redirects=False, timeout=10)
        while flag is None and r.status_code != 302 and time.monotonic() < deadline:
            time.sleep(0.5)  # the proxy route is added once the service answers
            r = requests.get(url, allow_redirects=False, timeout=10)
        if flag is None:
            # the admin page asks for a hub login (OAuth), metrics too: nothing is open to anonymous callers
            assert r.status_code == 302 and "oauth2/authorize" in r.headers["Location"], (
                r.status_code,
                r.text,
            )
            m = requests.get(url + "metrics", allow_redirects=False, timeout=10)
            assert m.status_code in (302, 403) and "DCGM" not in m.text
        else:
            # no such service: the hub answers for the path itself, and no OAuth client of the service exists
            assert "client_id=service-tfdist-gpu-admin" not in r.headers.get("Location", ""), r.headers
        # what the hub itself lists (its services are configured at its start: no timing in this)
        services = hub_services(hub)
        assert ("tfdist-gpu-admin" in services) == (flag is None), services
    finally:
        hub.stop()


def hub_services(hub) -> set[str]:
    """The services the hub knows, as its admin sees them in the REST API."""
    import re

    import requests

    password = re.search(r"admin panel: user 'admin', password\s+([^\s)]+)", hub.output())
    assert password, hub.output()[-2000:]
    s = requests.Session()
    s.get(f"{hub.url}/hub/login", timeout=30)
    r = s.post(
        f"{hub.url}/hub/login",
        data={
            "username": "admin",
            "password": password.group(1),
            "_xsrf": s.cookies.get("_xsrf", path="/hub/"),
        },
        timeout=30,
        allow_redirects=False,
    )
    assert r.status_code == 302, r.text[:300]
    r = s.get(f"{hub.url}/hub/api/services", timeout=30)
    assert r.status_code == 200, r.text[:300]
    return set(r.json())


MIG_BASE = """
gpu_models:
  slice: {display_name: "A100 1g.10gb", resource: "RESOURCE"}
profiles:
  - slug: mig
    display_name: MIG
    groups: ["*"]
    cpu: {min: 1, max: 2, default: 1}
    memory_gib: {min: 1, max: 4, default: 1}
    gpus: {min: 0, max: 1, default: 1}
    gpu_models: [slice]
    images: [local]
"""


@pytest.mark.parametrize(
    ("resource", "reason"),
    [
        ("nvidia.com/mig-1g.10g", "'1g.10g' is not a MIG profile name (like 1g.10gb)"),
        ("nvidia.com/mig-9g.99gb", "'9g.99gb' is not a MIG profile name"),
        ("nvidia.com/mig-2g.11gb", "'2g.11gb' is an unknown MIG profile; known MIG profiles: A30:"),
    ],
)
def test_unknown_mig_profile_names_file_key_and_reason(tmp_path: Path, resource: str, reason: str) -> None:
    p = tmp_path / "profiles.yaml"
    p.write_text(MIG_BASE.replace("RESOURCE", resource))
    with pytest.raises(ProfilesFileError) as e:
        load_profiles(p)
    assert f"{p}: gpu_models.slice.resource: {reason}" in str(e.value), str(e.value)


@pytest.mark.parametrize("profile", ["1g.10gb", "1g.5gb", "3g.71gb", "7g.80gb"])
def test_known_mig_profiles_are_gpu_models(tmp_path: Path, profile: str) -> None:
    p = tmp_path / "profiles.yaml"
    p.write_text(MIG_BASE.replace("RESOURCE", f"nvidia.com/mig-{profile}"))
    assert load_profiles(p).gpu_models["slice"].resource == f"nvidia.com/mig-{profile}"


def test_the_service_ends_with_a_hub_killed_outright(tmp_path: Path) -> None:
    import psutil

    from tests.hub_fixtures import start_local_hub_command

    hub = start_local_hub_command(tmp_path)
    family = psutil.Process(hub.proc.pid).children(recursive=True)
    try:
        service = [p for p in family if "tfdist.hubadmin" in " ".join(p.cmdline())]
        assert len(service) == 1
        hub.proc.kill()  # no clean-up by the hub
        hub.proc.wait(10)
        assert psutil.wait_procs(service, timeout=15)[1] == [], "the GPU admin service outlived its hub"
    finally:
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_the_service_stops_at_once_for_a_hub_started_with_sigint_ignored(tmp_path: Path) -> None:
    """The hub stops its services with SIGINT first and waits 30 s before SIGTERM. A hub started from a
    script as `tfdist-local-hub &` has SIGINT ignored, and the service inherited that, so every hub
    shutdown took 30 s more."""
    import psutil

    from tests.hub_fixtures import start_local_hub_command

    hub = start_local_hub_command(tmp_path, ignore_sigint=True)
    family = psutil.Process(hub.proc.pid).children(recursive=True)
    try:
        service = [p for p in family if "tfdist.hubadmin" in " ".join(p.cmdline())]
        assert len(service) == 1
        t0 = time.monotonic()
        hub.proc.terminate()
        hub.proc.wait(60)
        took = time.monotonic() - t0
        assert psutil.wait_procs(service, timeout=5)[1] == [], "the GPU admin service outlived its hub"
        assert took < 20, f"the hub took {took:.0f} s to stop: its service ignored the hub's SIGINT"
    finally:
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()
