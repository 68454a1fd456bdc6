"""TensorFlow's import-time log lines held to TF_CPP_MIN_LOG_LEVEL (tfdist.tfquiet): the rules, and a
real kernel of the installed package (its IPython startup file) importing a TensorFlow double that writes
what TensorFlow 2.21 writes on an AVX-512/AMX CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels import Kernel, kernel_env
from tfdist import tfquiet

FAKE_TF = str(Path(__file__).parent / "doubles" / "fake_tensorflow")
PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
INFO = "I0000 00:00:1796149594.761801    5449 port.cc:153] oneDNN custom operations are on.\n"
WARN = "W0000 00:00:1796149594.761801    5449 x.cc:1] a warning\n"
ERROR = "E0000 00:00:1796149594.761801    5449 x.cc:2] an error\n"
TSL_INFO = (
    "2026-01-30 22:44:42.456316: I tensorflow/core/platform/cpu_feature_guard.cc:210] This TensorFlow "
    "binary is optimized\nTo enable the following instructions: AVX2 FMA, rebuild TensorFlow.\n"
)


@pytest.mark.parametrize(
    ("level", "kept"),
    [
        (1, [WARN, ERROR, "plain output\n"]),
        (2, [ERROR, "plain output\n"]),
        (3, []),
    ],
)
def test_lines_below_the_level_and_their_continuations_go_the_rest_stays(level, kept):
    text = PREAMBLE + INFO + TSL_INFO + WARN + ERROR + "plain output\n"
    # "plain output" continues the error before it: kept with it, gone with it at level 3
    assert tfquiet.below_level(text, level) == "".join(kept)


def test_level_zero_keeps_everything_and_unset_or_odd_levels_install_nothing():
    text = PREAMBLE + INFO + TSL_INFO
    assert tfquiet.below_level(text, 0) == text
    assert tfquiet.min_level({}) is None
    for raw in ("", "x", "4", "-1", "2.0"):
        assert tfquiet.min_level({"TF_CPP_MIN_LOG_LEVEL": raw}) is None
    assert tfquiet.min_level({"TF_CPP_MIN_LOG_LEVEL": " 2 "}) == 2
    assert tfquiet.install({"TF_CPP_MIN_LOG_LEVEL": "0"}) is False


def _import_in_subprocess(level: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"} | {"PYTHONPATH": FAKE_TF}
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    code = (
        "import os, sys\nfrom tfdist import tfquiet\nprint(tfquiet.install())\n"
        "import tensorflow\nos.write(2, b'after the import\\n')\n"
        "loader = tensorflow.__spec__.loader\n"
        "print(type(loader).__name__, 'exec_module' in vars(loader))\n"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_the_import_is_held_and_written_back_filtered_and_nothing_else_is():
    out = _import_in_subprocess("2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "SourceFileLoader", "False"]  # the module keeps its own loader
    assert out.stderr == (
        "E0000 00:00:1796149594.861801    5449 fake_tensorflow.cc:7] an error TensorFlow reports\n"
        "after the import\n"
    )
    out = _import_in_subprocess(None)  # not asked for: TensorFlow's lines as they are
    assert out.stdout.split()[0] == "False" and "oneDNN custom operations are on" in out.stderr


def _first_cell(level: str | None, tmp_path: Path):
    env = kernel_env(str(tmp_path / "state")) | {"PYTHONPATH": FAKE_TF}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env.pop("PYTEST_CURRENT_TEST", None)  # ipykernel forwards fd 2 to the cell only outside pytest
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    k = Kernel(env, cwd=str(tmp_path))
    try:
        # ipykernel forwards what reaches fd 2 from a thread: a cell that ended right after the write-back
        # would get it after its idle status (a notebook still shows it in the cell; this test would not)
        r = k.execute("import tensorflow, time\nprint(tensorflow.__version__)\ntime.sleep(1)", timeout=60)
        assert r.error is None, r.error_text
        return {o["content"]["name"]: o["content"]["text"] for o in r.outputs if o["msg_type"] == "stream"}
    finally:
        k.shutdown()


def test_a_kernel_of_the_installed_package_shows_only_what_the_level_asks_for(tmp_path):
    streams = _first_cell("2", tmp_path)
    assert streams.get("stdout") == "0.0-test-double\n"
    assert streams.get("stderr", "").strip() == (
        "E0000 00:00:1796149594.861801    5449 fake_tensorflow.cc:7] an error TensorFlow reports"
    ), streams
    streams = _first_cell(None, tmp_path)
    assert "oneDNN custom operations are on" in streams.get("stderr", ""), streams


def test_without_a_stderr_the_import_runs_unheld():
    env = dict(os.environ, PYTHONPATH=FAKE_TF, TF_CPP_MIN_LOG_LEVEL="2")
    code = "import os\nos.close(2)\nfrom tfdist import tfquiet\ntfquiet.install()\nimport tensorflow\n"
    code += "print('ok')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "ok\n", out
