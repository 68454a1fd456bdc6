"""scripts/gpu-check on a machine without a GPU: it says "no GPU", writes that, installs nothing, exits 0.

The checks themselves need an NVIDIA GPU (they are run on one with the `device` tool); here the script must
stay runnable, whether nvidia-smi is missing or present without a working driver.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check"


def run(tmp_path: Path, path: str) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    out, work = tmp_path / "results.json", tmp_path / "work"
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--workdir", str(work)],
        env={"PATH": path, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return p, out, work


def test_without_nvidia_smi_it_says_no_gpu_and_exits_0(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    p, out, work = run(tmp_path, str(empty))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("no GPU"), p.stdout
    got = json.loads(out.read_text())
    assert got["gpu"] is False and got["checks"] == []
    assert not work.exists()  # no venv, no install


def test_with_nvidia_smi_but_no_driver_it_says_no_gpu_and_exits_0(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    # what nvidia-smi prints where the driver is not loaded
    smi.write_text(
        "#!/bin/sh\n"
        "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
        "exit 9\n"
    )
    smi.chmod(0o755)
    p, out, work = run(tmp_path, str(bin_dir))
    assert p.returncode == 0 and "no GPU" in p.stdout, (p.stdout, p.stderr)
    assert json.loads(out.read_text())["gpu"] is False and not work.exists()
