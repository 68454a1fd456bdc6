"""The suite's own results file: `artifacts/test-run.json`, written by the pytest controller at the end of a
run (scripts/test, .ci/run): when and where it ran (benchmarks.machine: CPU, load, commit), its wall time,
the outcome counts, the workers, and the summed time of each xdist group and of the slowest modules.

Why: the figures about the suite itself (how long CI takes, how many tests) were typed into the docs by
hand; now they are copied from this file (benchmarks/results/ci-*.json) like every other figure.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest

RECORD = Path(
    os.environ.get("TFDIST_TEST_RECORD")
    or Path(__file__).resolve().parents[1] / "artifacts" / "test-run.json"
)
_t0: list[float] = []
_cpu0: list[dict[str, float]] = []
_loop_samples: list[float] = []
_outcomes: collections.Counter[str] = collections.Counter()
_module_s: collections.Counter[str] = collections.Counter()
_group_s: collections.Counter[str] = collections.Counter()


def _cpu_seconds() -> dict[str, float]:
    """The machine's CPU time so far by kind (/proc/stat, all CPUs): what the run's own processes had
    (busy), what no one used (idle), and what the hypervisor gave other guests (steal)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return {}
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return {
        "busy": (user + nice + system + irq + softirq) / tick,
        "idle": (idle + iowait) / tick,
        "steal": steal / tick,
    }


def _sample_speed(every_s: float = 60.0) -> None:
    """The fixed loop's CPU seconds once a minute through the run (0.4 % of a core): how fast the host let
    this machine run, whatever the tests' own load."""
    from benchmarks.machine import python_loop_s

    while True:
        _loop_samples.append(python_loop_s())
        time.sleep(every_s)


def _loop_summary(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"samples": 0}
    return {
        "samples": len(samples),
        "min": min(samples),
        "median": statistics.median(samples),
        "max": max(samples),
    }


def pytest_sessionstart(session: pytest.Session) -> None:
    _t0.append(time.time())
    if not hasattr(session.config, "workerinput"):
        _cpu0.append(_cpu_seconds())
        threading.Thread(target=_sample_speed, name="runrecord-speed", daemon=True).start()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Counted as pytest's summary counts them: a call's outcome, a setup or teardown failure as an
    error, a skip."""
    m = re.search(r"@([\w.]+)$", report.nodeid)  # xdist's loadgroup adds "@<group>"
    module = report.nodeid.split("::")[0]
    _module_s[module] += report.duration
    _group_s[m.group(1) if m and m.group(1) in ("realnode", "kwok") else "other"] += report.duration
    if report.when == "call":
        _outcomes["xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome] += 1
    elif report.failed:
        _outcomes["error"] += 1
    elif report.skipped:
        _outcomes["skipped"] += 1


def write(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput") or not _t0:  # the controller (or a serial run) writes it
        return
    with contextlib.suppress(Exception):  # a record that cannot be written never fails the run
        from benchmarks.machine import machine

        workers = getattr(session.config.option, "numprocesses", None)
        record_machine = machine()  # its python_loop_s: the loop's at the end
        record: dict[str, Any] = {
            "machine": record_machine,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_t0[0])),
            "wall_s": round(time.time() - _t0[0], 1),
            "exitstatus": int(exitstatus),
            "workers": workers,
            "args": session.config.invocation_params.args,
            "outcomes": dict(_outcomes),
            "tests_run": sum(v for k, v in _outcomes.items() if k in ("passed", "failed")),
            "summed_test_s": round(sum(_module_s.values()), 1),
            "group_s": {k: round(v, 1) for k, v in _group_s.items()},
            "slowest_modules_s": {k: round(v, 1) for k, v in _module_s.most_common(20)},
            # the machine over the run: its CPU seconds by kind, and the fixed loop's CPU seconds each minute
            "cpu_s": {k: round(v - _cpu0[0].get(k, 0.0), 1) for k, v in _cpu_seconds().items()}
            if _cpu0 and _cpu0[0]
            else {},
            "python_loop_s": _loop_summary([*_loop_samples, record_machine["python_loop_s"]]),
            "how": "tests/runrecord.py: pytest's own report of each test (setup + call + teardown), summed",
        }
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        tmp = RECORD.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        tmp.replace(RECORD)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """As a plugin of its own (`-p tests.runrecord`); tests/conftest.py calls `write` itself."""
    write(session, exitstatus)
