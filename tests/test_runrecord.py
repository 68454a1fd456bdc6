"""The suite's results file (tests/runrecord.py) counts what pytest counts: a pytest run of a small module
with a pass, a failure, a skip and a fixture error writes those counts, its wall time and the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULE = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup fails")

def test_passes():
    pass

def test_fails():
    assert 1 == 2

def test_skips():
    pytest.skip("not here")

def test_errors(broken):
    pass
"""


def test_a_run_writes_what_pytest_counted(tmp_path):
    (tmp_path / "test_small.py").write_text(MODULE)
    record = tmp_path / "record.json"
    env = dict(os.environ, TFDIST_TEST_RECORD=str(record))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.runrecord",
            "-p",
            "no:cacheprovider",
            "-q",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 failed, 1 passed, 1 skipped, 1 error" in r.stdout, r.stdout[-2000:]
    got = json.loads(record.read_text())
    assert got["outcomes"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    assert got["tests_run"] == 2 and got["exitstatus"] == 1
    assert 0 < got["wall_s"] < 120 and got["machine"]["cpus"] == os.cpu_count()
    assert list(got["slowest_modules_s"]) == ["test_small.py"]
