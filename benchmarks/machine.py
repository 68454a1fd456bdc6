"""The machine a benchmark ran on, read from the machine itself: every results file carries it.

Why: results files used to carry a hand-typed "machine" string (or only a core count), so a figure could
not be traced to the CPU, memory, load and commit it was measured with. `machine()` is what each benchmark
writes under ``"machine"``; nothing in it is typed by hand.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform()


def _gpus() -> list[str]:
    """`nvidia-smi -L`'s GPU lines; none without nvidia-smi or a driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [ln.strip() for ln in out.splitlines() if ln.startswith("GPU ")]


def python_loop_s() -> float:
    """CPU seconds of one fixed pure-Python loop (~0.25 s here). This machine is a VM on a shared host and
    its speed varied 20-40 % over a day; its own load does not change this figure (the loop's own CPU
    time, not the wall clock's), a slower host does (the guest's clock runs on while its CPU waits)."""
    t = time.thread_time()
    sum(i * i for i in range(3_000_000))
    return round(time.thread_time() - t, 3)


def _commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return head.stdout.strip() or None


def machine() -> dict[str, Any]:
    """CPU model, logical and usable CPUs, memory, load, the fixed loop's time, OS, kernel, Python, GPUs, the
    date and commit."""
    import psutil

    load = os.getloadavg()
    return {
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_avg_1m_5m": [round(load[0], 2), round(load[1], 2)],
        "python_loop_s": python_loop_s(),
        "os": _os_name(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "gpus": _gpus(),
        "measured_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _commit(),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(machine(), indent=1))
