"""tfdist.settings is the only reader of TFDIST_* variables, its groups parse them as documented, and
docs/configuration.md is what `python -m tfdist.settings --reference` generates."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tfdist import settings
from tfdist.settings import (
    AdminSettings,
    HubSettings,
    KernelSettings,
    KubeHubSettings,
    LabSettings,
    SettingsError,
    TaskSettings,
    names,
)
from tfdist.settings.reference import render

ROOT = Path(__file__).resolve().parents[1]
# the product's packages and the hub config files JupyterHub loads (hub_config/*.py). Outside them only the
# development tools read variables of their own (TFDIST_CACHE, TFDIST_REALNODE, ...: docs/contributing.md).
PACKAGES = ("core", "spawner", "kernel_magics", "labserver", "hubadmin", "hub_config")
SETTINGS_DIR = ROOT / "core" / "settings"


# ---- nobody else reads os.environ for a TFDIST_* name ---------------------------------------------------


def _known_names(trees: list[ast.Module]) -> set[str]:
    """Identifiers bound to a TFDIST_* name: settings.names' constants, and module-level aliases of them
    or of literal strings anywhere in the packages (ENV_EVERY = "TFDIST_CHECKPOINT_EVERY", SIZE_ENV = ...)."""
    known = {k for k, v in vars(names).items() if isinstance(v, str) and v.startswith("TFDIST_")}
    changed = True
    while changed:
        changed = False
        for tree in trees:
            for node in tree.body:
                if not isinstance(node, ast.Assign):
                    continue
                for target in node.targets:
                    pairs = (
                        zip(target.elts, node.value.elts, strict=False)
                        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                        else [(target, node.value)]
                    )
                    for t, v in pairs:
                        if isinstance(t, ast.Name) and t.id not in known and _is_name(v, known):
                            known.add(t.id)
                            changed = True
    return known


def _is_name(node: ast.AST, known: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith("TFDIST_")
    if isinstance(node, ast.Name):
        return node.id in known
    if isinstance(node, ast.Attribute):
        return node.attr in known
    return False


def _mentions_environ(node: ast.AST) -> bool:
    """os.environ, environ (from os import environ), or `os.environ if x else y`: not a copy."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    if isinstance(node, ast.Name):
        return node.id == "environ"
    if isinstance(node, ast.IfExp):
        return _mentions_environ(node.body) or _mentions_environ(node.orelse)
    return False


def environ_reads(tree: ast.Module, known: set[str]) -> list[int]:
    """Lines that read a TFDIST_* variable from the process's environment."""
    aliases: set[str] = set()  # `env = os.environ if environ is None else environ`
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _mentions_environ(node.value):
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def is_env(node: ast.AST) -> bool:
        return _mentions_environ(node) or (isinstance(node, ast.Name) and node.id in aliases)

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and _is_name(node.args[0], known):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get" and is_env(f.value):
                lines.append(node.lineno)  # os.environ.get("TFDIST_X")
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv") or (
                isinstance(f, ast.Name) and f.id == "getenv"
            ):
                lines.append(node.lineno)  # os.getenv("TFDIST_X")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if is_env(node.value) and _is_name(node.slice, known):
                lines.append(node.lineno)  # os.environ["TFDIST_X"]
        elif isinstance(node, ast.Compare) and _is_name(node.left, known):
            if any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) and any(
                is_env(c) for c in node.comparators
            ):
                lines.append(node.lineno)  # "TFDIST_X" in os.environ
    return lines


def _sources() -> list[Path]:
    return sorted(
        p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if SETTINGS_DIR not in p.parents and "node_modules" not in p.parts
    )


def test_no_module_but_the_settings_package_reads_a_tfdist_variable():
    files = _sources()
    trees = [ast.parse(p.read_text(), str(p)) for p in files]
    known = _known_names(trees)
    found = [
        f"{p.relative_to(ROOT)}:{line}"
        for p, tree in zip(files, trees, strict=True)
        for line in environ_reads(tree, known)
    ]
    assert not found, "read these through tfdist.settings (a group's field) instead: " + ", ".join(found)


def test_the_walk_finds_every_form_of_a_read():
    src = """
import os
from os import environ, getenv
X = "TFDIST_X"
Y = X
a = os.environ.get("TFDIST_A")
b = os.environ["TFDIST_B"]
c = os.getenv(Y)
d = getenv("TFDIST_D", "1")
e = environ.get(X)
f = "TFDIST_F" in os.environ
def g(environ_=None):
    env = os.environ if environ_ is None else environ_
    return env.get(settings.ENV_TASK)
os.environ["TFDIST_W"] = "written, not read"
h = os.environ.get("HOME")
"""
    tree = ast.parse(src)
    assert environ_reads(tree, _known_names([tree])) == [6, 7, 8, 9, 10, 11, 14]


def test_the_hub_config_files_are_walked():
    walked = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert {"hub_config/jupyterhub_config.py", "hub_config/local_hub_config.py"} <= walked


# ---- the hub config files, loaded as JupyterHub loads them -------------------------------------------------

HUB_VARS = {v.name for g in (HubSettings, KubeHubSettings) for v in g.variables()}


def _load_config(name: str, monkeypatch: pytest.MonkeyPatch, **env: str) -> Any:
    from traitlets.config.loader import PyFileConfigLoader

    for var in HUB_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return PyFileConfigLoader(name, path=str(ROOT / "hub_config")).load_config()


def test_the_kubernetes_hub_config_takes_its_defaults(monkeypatch):
    c = _load_config("jupyterhub_config.py", monkeypatch)
    spawner = c.TfdistKubeSpawner
    assert spawner.profiles_file == str(ROOT / "hub_config" / "profiles.yaml")
    assert (spawner.worker_image, spawner.egress_api_server) == ("", [])
    [service] = c.JupyterHub.services
    assert service["url"] == "http://hub:10101"
    assert c.GpuFormMixin.gpu_admin_report_url == "http://proxy-public/services/tfdist-gpu-admin/api/report"


def test_the_kubernetes_hub_config_reads_the_environment_through_the_settings(monkeypatch, tmp_path):
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text((ROOT / "hub_config" / "profiles.yaml").read_text())
    c = _load_config(
        "jupyterhub_config.py",
        monkeypatch,
        TFDIST_PROFILES=str(profiles),
        TFDIST_WORKER_IMAGE="registry.example.org/job:1",
        TFDIST_EGRESS_API_SERVER="10.0.0.10:6443  10.0.0.11:6443",
        TFDIST_EGRESS_DENY="203.0.113.7 198.18.0.0/15",
        TFDIST_GPU_ADMIN_HOST="hub.jhub.svc",
        TFDIST_GPU_ADMIN_REPORT_URL="http://proxy.example/services/tfdist-gpu-admin/api/report",
    )
    spawner = c.TfdistKubeSpawner
    assert (spawner.profiles_file, spawner.worker_image) == (str(profiles), "registry.example.org/job:1")
    assert spawner.egress_api_server == ["10.0.0.10:6443", "10.0.0.11:6443"]
    assert spawner.egress_deny == ["203.0.113.7", "198.18.0.0/15"]
    assert c.JupyterHub.services[0]["url"] == "http://hub.jhub.svc:10101"
    assert c.GpuFormMixin.gpu_admin_report_url == "http://proxy.example/services/tfdist-gpu-admin/api/report"
    assert (
        "services" not in _load_config("jupyterhub_config.py", monkeypatch, TFDIST_GPU_ADMIN="0").JupyterHub
    )


def test_the_local_hub_config_reads_the_environment_through_the_settings(monkeypatch, tmp_path):
    c = _load_config(
        "local_hub_config.py",
        monkeypatch,
        TFDIST_HUB_PASSWORD="a long password",
        TFDIST_HUB_STATE_DIR=str(tmp_path / "hub"),
        TFDIST_HUB_PORT="8123",
    )
    assert (c.JupyterHub.port, c.SharedPasswordAuthenticator.user_password) == (8123, "a long password")
    assert c.JupyterHub.db_url == f"sqlite:///{tmp_path / 'hub' / 'jupyterhub.sqlite'}"
    assert c.TfdistLocalSpawner.profiles_file.endswith("profiles-local.yaml")  # the packaged profiles


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({}, "set TFDIST_HUB_PASSWORD"),
        ({"TFDIST_HUB_PASSWORD": "a long password", "TFDIST_HUB_PORT": "eighty"}, "TFDIST_HUB_PORT='eighty'"),
    ],
)
def test_the_local_hub_config_stops_with_a_sentence(monkeypatch, tmp_path, env, said):
    with pytest.raises(SystemExit) as e:
        _load_config("local_hub_config.py", monkeypatch, TFDIST_HUB_STATE_DIR=str(tmp_path / "hub"), **env)
    assert said in str(e.value)
    assert not (tmp_path / "hub").exists()  # it stopped before writing anything


# ---- the groups --------------------------------------------------------------------------------------


def test_defaults_are_today_s():
    k, t, lab, hub, admin = (
        g({}) for g in (KernelSettings, TaskSettings, LabSettings, HubSettings, AdminSettings)
    )
    assert (k.result_retention_s, k.isolation, k.pool_size, k.pool_memory) == (86400.0, "netns", 4, 3 * 2**30)
    assert (k.fork_tasks, k.probe_seconds, k.plan_nodes, k.plan_gpus_per_node) == (True, 4.0, 2, 0)
    assert k.plan_bandwidth is None and k.agent_port == t.agent_port == 8470
    assert (t.task, t.strategy, t.cluster, t.events_fd, t.heartbeat_s, t.netns) == (
        None,
        "ps",
        None,
        None,
        2.0,
        False,
    )
    assert (t.checkpoint_every, t.checkpoint_dir, t.token, t.agent_url) == (None, None, None, "")
    assert (t.payload_wait_s, t.result_wait_s, t.server_pid) == (600.0, 600.0, None)
    assert (lab.activity_interval_s, lab.gpu_admin_url) == (10.0, None)
    assert (hub.port, hub.state_dir, hub.password) == (8000, None, None)
    assert hub.state_base().endswith(".local/share/tfdist-hub")
    assert (admin.bind, admin.period_s, admin.local_gpus) == (None, None, False)
    kube = KubeHubSettings({})
    assert (kube.profiles, kube.worker_image, kube.egress_api_server, kube.gpu_admin) == (None, "", (), True)
    assert (kube.gpu_admin_public_url, kube.gpu_admin_host, kube.gpu_admin_report_url) == (
        "http://proxy-public",
        "hub",
        None,
    )
    assert hub.profiles is None


def test_values_are_parsed():
    t = TaskSettings(
        {
            names.ENV_CLUSTER: '{"ps": ["h:1"]}',
            names.ENV_EVENTS_FD: "7",
            names.ENV_NETNS: "1",
            names.ENV_CHECKPOINT_EVERY: "25",
            names.ENV_HEARTBEAT_S: "0.5",
            names.ENV_TASK: "",  # "" is unset
        }
    )
    assert (t.cluster, t.events_fd, t.netns, t.checkpoint_every, t.heartbeat_s) == (
        {"ps": ["h:1"]},
        7,
        True,
        25,
        0.5,
    )
    assert t.task is None
    k = KernelSettings(
        {names.ENV_POOL_MEMORY: "1500Mi", names.ENV_FORK_TASKS: "no", names.ENV_POOL_SIZE: "0"}
    )
    assert (k.pool_memory, k.fork_tasks, k.pool_size) == (1500 * 2**20, True, 0)  # only "0" stops forking
    assert not KernelSettings({names.ENV_FORK_TASKS: "0"}).fork_tasks
    assert not TaskSettings({names.ENV_NETNS: "yes"}).netns  # only "1" is on, as the supervisor read it
    assert KubeHubSettings(
        {names.ENV_EGRESS_API_SERVER: " 10.0.0.10:6443\t10.0.0.11:443 "}
    ).egress_api_server == (
        "10.0.0.10:6443",
        "10.0.0.11:443",
    )
    assert not KubeHubSettings({names.ENV_GPU_ADMIN: "0"}).gpu_admin
    assert KubeHubSettings(
        {names.ENV_GPU_ADMIN: "no"}
    ).gpu_admin  # only "0" turns it off, as the config read it


@pytest.mark.parametrize(
    ("group", "attr", "var", "value"),
    [
        (TaskSettings, "heartbeat_s", names.ENV_HEARTBEAT_S, "fast"),
        (TaskSettings, "heartbeat_s", names.ENV_HEARTBEAT_S, "0"),
        (TaskSettings, "payload_wait_s", names.ENV_PAYLOAD_WAIT_S, "nan"),
        (TaskSettings, "agent_port", names.ENV_AGENT_PORT, "70000"),
        (TaskSettings, "cluster", names.ENV_CLUSTER, "[1, 2]"),
        (TaskSettings, "cluster", names.ENV_CLUSTER, "{not json"),
        (TaskSettings, "events_fd", names.ENV_EVENTS_FD, "-1"),
        (TaskSettings, "checkpoint_every", names.ENV_CHECKPOINT_EVERY, "0"),
        (KernelSettings, "agent_port", names.ENV_AGENT_PORT, "http"),
        (KernelSettings, "plan_nodes", names.ENV_PLAN_NODES, "0"),
        (KernelSettings, "probe_seconds", names.ENV_PROBE_SECONDS, "-4"),
        (HubSettings, "port", names.ENV_HUB_PORT, "eighty"),
        (AdminSettings, "period_s", names.ENV_GPU_ADMIN_PERIOD, "0"),
    ],
)
def test_a_bad_value_is_an_error_that_names_the_variable(group, attr, var, value):
    with pytest.raises(SettingsError) as e:
        getattr(group({var: value}), attr)
    assert var in str(e.value) and repr(value) in str(e.value)


def test_a_bad_value_fails_only_its_own_field():
    t = TaskSettings({names.ENV_HEARTBEAT_S: "fast", names.ENV_STRATEGY: "allreduce"})
    assert t.strategy == "allreduce"  # a job whose heartbeat is broken still knows its strategy


@pytest.mark.parametrize(
    ("group", "attr", "var", "value"),
    [
        (KernelSettings, "result_retention_s", names.ENV_RESULT_RETENTION_S, "a day"),
        (KernelSettings, "result_retention_s", names.ENV_RESULT_RETENTION_S, "0"),
        (KernelSettings, "result_retention_s", names.ENV_RESULT_RETENTION_S, "inf"),
        (KernelSettings, "pool_size", names.ENV_POOL_SIZE, "-1"),
        (KernelSettings, "pool_size", names.ENV_POOL_SIZE, "2.5"),
        (KernelSettings, "pool_memory", names.ENV_POOL_MEMORY, "lots"),
        (KernelSettings, "pool_memory", names.ENV_POOL_MEMORY, "-1Gi"),
        (LabSettings, "activity_interval_s", names.ENV_GPU_ACTIVITY_INTERVAL, "0.001"),
        (LabSettings, "activity_interval_s", names.ENV_GPU_ACTIVITY_INTERVAL, "often"),
    ],
)
def test_the_deliberate_fallbacks_stay(group, attr, var, value):
    assert getattr(group({var: value}), attr) == getattr(group({}), attr)


def test_a_required_variable_that_is_missing_is_named():
    with pytest.raises(SettingsError, match=names.ENV_PROFILES):
        _ = AdminSettings({}).profiles
    assert AdminSettings({names.ENV_PROFILES: "/etc/p.yaml"}).profiles == "/etc/p.yaml"


def test_no_mapping_reads_this_process_at_each_access(monkeypatch):
    t = TaskSettings()
    monkeypatch.setenv(names.ENV_TASK, "worker-3")
    assert t.task == "worker-3"  # as the os.environ reads it replaced: the environment as it is now
    assert TaskSettings({}).task is None


@pytest.mark.not_unit("a fresh interpreter, as a job process starts")
def test_job_processes_import_it_without_pydantic():
    code = "import sys, tfdist.settings as s; s.TaskSettings().heartbeat_s; print('pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_package_keeps_the_old_module_s_names():
    for name in ("ENV_BACKEND", "ENV_LIFELINE_GRACE_S", "LIFELINE_GRACE_S", "LIFELINE_GRACE_MIN_S"):
        assert hasattr(settings, name)
    assert settings.from_environ({}).backend == "local" and settings.Settings is settings.server.Settings
    assert settings._MappingSettings and settings._describe


def test_every_field_is_documented():
    for group in settings.GROUPS:
        for v in group.variables():
            assert v.name.startswith("TFDIST_") and v.description.endswith("."), (group, v.name)
    for f in settings.Settings.model_fields.values():
        assert f.exclude or (f.description or "").endswith("."), f


def test_names_are_each_read_by_some_group():
    read = {v.name for g in settings.GROUPS for v in g.variables()}
    read |= {
        a if isinstance(a, str) else c
        for f in settings.Settings.model_fields.values()
        for a in [f.validation_alias]
        for c in (getattr(a, "choices", None) or [a])[:1]
    }
    declared = {v for k, v in vars(names).items() if k.startswith("ENV_")}
    assert declared - read == {names.ENV_GPU_MODEL}  # for the user's own code: tfdist reads none


# ---- the generated reference ----------------------------------------------------------------------------


def test_docs_configuration_is_the_generated_reference():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), (
        "docs/configuration.md is stale: regenerate it with "
        "`python -m tfdist.settings --reference > docs/configuration.md`"
    )


def test_the_reference_lists_every_variable_and_trait():
    text = render()
    for group in settings.GROUPS:
        assert f"`{group.__name__}`" in text
        for v in group.variables():
            assert f"`{v.name}`" in text
    assert "`TFDIST_LIFELINE_GRACE_S`" in text and "`c.TfdistLocalSpawner`" in text
    assert "`c.TfdistKubeSpawner`" in text and "`profiles_file`" in text


def test_the_z2jh_values_config_reads_no_tfdist_variable_itself():
    """hub_config/values.yaml's hub.extraConfig is Python the hub runs too: its TFDIST_* come through
    KubeHubSettings like the config files' (it read three itself, unchecked)."""
    import yaml

    values = yaml.safe_load((ROOT / "hub_config" / "values.yaml").read_text())
    snippets = values["hub"]["extraConfig"]
    trees = {key: ast.parse(code, f"values.yaml:hub.extraConfig.{key}") for key, code in snippets.items()}
    known = _known_names([ast.parse(p.read_text()) for p in _sources()] + list(trees.values()))
    found = [
        f"hub.extraConfig.{key}:{line}" for key, tree in trees.items() for line in environ_reads(tree, known)
    ]
    assert not found, "read these through tfdist.settings.KubeHubSettings instead: " + ", ".join(found)
    assert any("KubeHubSettings()" in code for code in snippets.values())
