"""The profiles file: good files load; a broken one is reported as "file: key: reason" for every problem."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from tfdist.spawner.localhub import default_profiles_path
from tfdist.spawner.profiles import ProfilesFileError, ProfilesSource, load_profiles

REPO = Path(__file__).resolve().parent.parent
GOOD = """
gpu_models:
  h100: {display_name: H100, node_selector: {nvidia.com/gpu.product: H100}}
profiles:
  - slug: gpu
    display_name: GPU
    groups: [ml]
    cpu: {min: 1, max: 8, default: 2}
    memory_gib: {min: 1, max: 64, default: 4}
    gpus: {min: 0, max: 4, default: 1}
    gpu_models: [h100]
    images: [img:1]
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "profiles.yaml"
    p.write_text(textwrap.dedent(text))
    return p


@pytest.mark.parametrize("path", [REPO / "hub_config" / "profiles.yaml", Path(default_profiles_path())])
def test_shipped_profiles_load(path: Path) -> None:
    cfg = load_profiles(path)
    assert cfg.profiles and all(p.images for p in cfg.profiles)


@pytest.mark.parametrize(
    ("change", "key", "reason"),
    [
        (("max: 8", "max: 0.5"), "profiles[0] (gpu).cpu", "min (1) is above max (0.5)"),
        (("default: 4}", "default: 99}"), "profiles[0] (gpu).memory_gib", "default (99) is outside min..max"),
        (("gpu_models: [h100]", "gpu_models: [v100]"), "(top level)", "which gpu_models does not define"),
        (("groups: [ml]", "groups: []"), "profiles[0] (gpu).groups", "at least 1 item"),
        (
            ("images: [img:1]", "images: [img:1]\n    max_gpu_per_user: 2"),
            "profiles[0] (gpu).max_gpu_per_user",
            "unknown key",
        ),
        (("slug: gpu", "slug: GPU Large"), "profiles[0] (GPU Large).slug", "should match pattern"),
        (
            ("display_name: H100,", "display_name: H100, nvml_name: '(',"),
            "gpu_models.h100.nvml_name",
            "not a valid regular expression",
        ),
        (
            ("min: 0, max: 4, default: 1", "min: 0, max: 4.5, default: 1"),
            "profiles[0] (gpu).gpus.max",
            "valid integer",
        ),
        (("slug: gpu", "slug: gpu\n    slug: cpu"), "line 6, column 5", "the key 'slug' is written twice"),
        (("groups: [ml]", "groups: [ml"), "line", "not valid YAML"),
        (
            ("{nvidia.com/gpu.product: H100}", "{" + ", ".join(f"l{i}: v" for i in range(9)) + "}"),
            "gpu_models.h100.node_selector",
            "at most 8 items",
        ),
    ],
    ids=[
        "range",
        "default",
        "undefined-model",
        "no-groups",
        "typo-key",
        "slug",
        "bad-regex",
        "float-gpus",
        "duplicate-key",
        "yaml-syntax",
        "node-selector-over-the-policys-8",
    ],
)
def test_broken_file_names_file_key_reason(
    tmp_path: Path, change: tuple[str, str], key: str, reason: str
) -> None:
    text = textwrap.dedent(GOOD)
    assert change[0] in text
    p = write(tmp_path, text.replace(change[0], change[1], 1))
    with pytest.raises(ProfilesFileError) as e:
        load_profiles(p)
    msg = str(e.value)
    line = next((ln for ln in msg.splitlines() if reason in ln), msg)
    assert line.startswith(f"{p}: {key}"), msg
    assert reason in line


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfilesFileError, match=r"nope.yaml: \(file\): cannot be read"):
        load_profiles(tmp_path / "nope.yaml")


def test_running_hub_keeps_last_good_profiles(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD)
    src = ProfilesSource(str(p))
    first = src.get()
    p.write_text(textwrap.dedent(GOOD).replace("max: 8", "max: 0.5"))
    os.utime(p, (time.time() + 5, time.time() + 5))
    assert src.get() is first and src.last_error is not None
    p.write_text(textwrap.dedent(GOOD).replace("max: 8", "max: 16"))
    os.utime(p, (time.time() + 10, time.time() + 10))
    assert src.get().profiles[0].cpu.max == 16 and src.last_error is None
