"""The spawner -> kernel contract (tfdist.settings): parsed with pydantic-settings, and a broken value is a
sentence naming the variable, never a silent default."""

from __future__ import annotations

import json

import pydantic
import pytest

from tests.kernels import Kernel, kernel_env
from tfdist import settings
from tfdist.settings import SettingsError, from_environ


def test_an_empty_environment_is_the_local_default(tmp_path):
    s = from_environ({"XDG_RUNTIME_DIR": str(tmp_path)})
    assert s.backend == "local" and s.namespace is None and s.gpus is None
    assert s.state_dir == str(tmp_path / "tfdist" / "jobs")
    assert s.user == "user"


def test_spawner_values_are_parsed(tmp_path):
    sel = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    tol = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    s = from_environ(
        {
            settings.ENV_BACKEND: "kubernetes",
            settings.ENV_NAMESPACE: "user-ann",
            settings.ENV_GPUS: "2",
            settings.ENV_GPU_NODE_SELECTOR: json.dumps(sel),
            settings.ENV_GPU_TOLERATIONS: json.dumps(tol),
            settings.ENV_GPU_RESOURCE: "nvidia.com/mig-1g.10gb",
            settings.ENV_KUEUE_QUEUE: "",  # "not given" as the spawner writes it
            settings.ENV_STATE_DIR: str(tmp_path),
            settings.ENV_LIFELINE_GRACE_S: "20",
            "JUPYTERHUB_USER": "ann",
            "USER": "jovyan",
        }
    )
    assert (s.backend, s.namespace, s.gpus) == ("kubernetes", "user-ann", 2)
    assert s.gpu_node_selector == sel and s.gpu_tolerations == tol and s.kueue_queue is None
    assert s.gpu_resource == "nvidia.com/mig-1g.10gb"
    assert from_environ({settings.ENV_GPU_RESOURCE: ""}).gpu_resource is None  # not given: whole GPUs
    assert s.state_dir == str(tmp_path)
    assert s.lifeline_grace_s == 20 and from_environ({}).lifeline_grace_s == 60
    assert s.user == "ann"  # the hub's name wins over the Unix account
    assert from_environ({settings.ENV_USER: "bob", "JUPYTERHUB_USER": "ann"}).user == "bob"


def test_an_explicit_mapping_ignores_this_process_and_none_reads_it(monkeypatch):
    monkeypatch.setenv(settings.ENV_NAMESPACE, "leaked")
    monkeypatch.setenv(settings.ENV_GPUS, "3")
    assert from_environ({}).namespace is None
    s = from_environ()
    assert s.namespace == "leaked" and s.gpus == 3


@pytest.mark.parametrize(
    ("var", "value"),
    [
        (settings.ENV_BACKEND, "docker"),
        (settings.ENV_GPUS, "two"),
        (settings.ENV_GPUS, "-1"),
        (settings.ENV_GPU_NODE_SELECTOR, "{not json"),
        (settings.ENV_GPU_NODE_SELECTOR, '["a list"]'),
        (settings.ENV_GPU_TOLERATIONS, '{"key": "not a list"}'),
        (settings.ENV_LIFELINE_GRACE_S, "5"),  # under two renewals' worth of API server trouble
        (settings.ENV_LIFELINE_GRACE_S, "86400"),  # a dead kernel's jobs would hold their GPUs for a day
        (settings.ENV_LIFELINE_GRACE_S, "soon"),
    ],
)
def test_a_broken_value_is_an_error_that_names_the_variable(var, value):
    with pytest.raises(SettingsError) as e:
        from_environ({var: value})
    msg = str(e.value)
    assert var in msg and repr(value) in msg and "hub admin" in msg


def test_settings_are_read_only():
    s = from_environ({})
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        s.backend = "kubernetes"  # type: ignore[misc]


def test_the_magic_says_so_in_one_line_when_its_settings_are_broken(tmp_path):
    k = Kernel(kernel_env(str(tmp_path / "state"), TFDIST_GPUS="lots"), cwd=str(tmp_path))
    try:
        r = k.execute("%load_ext tfdist", timeout=120)
        text = r.error_text if r.error is not None else r.text
        assert "TFDIST_GPUS='lots' is not valid" in text, text
        assert "Traceback" not in text and "ValidationError" not in text, text
    finally:
        k.shutdown()
