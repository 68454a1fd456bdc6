"""A kernel's first %%tfdist run with tasks forked from one TensorFlow import (runtime.forkserver) against
the same job with every task a fresh process (TFDIST_FORK_TASKS=0), interleaved in the same run.

Each run is a new kernel (TensorFlow imported in it, the warm pool off, so both sides are a first job):
1 PS + 2 workers, 2 epochs of 20 steps. Reported per side (median over repeats): the cell's wall time, the
CPU seconds of the kernel and of the job's processes (the supervisor and everything below it: tasks, fork
server; each one's CPU time as last sampled before it ended, so other work on the machine is not counted),
and each task's largest RSS, PSS and USS while it ran (sampled every 0.2 s from the PIDs the job's
state.json names): a forked task shares the fork server's pages, which RSS counts in full and PSS
splits. Ratios are forked / fresh. Run: python benchmarks/bench_fork.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_launch import KERNEL_SETUP  # noqa: E402

EPOCHS, STEPS = 2, 20
CELL = (
    "%%tfdist run --workers 2 --ps 1 --name {name}\n"
    f"hist = model.fit(ds, epochs={EPOCHS}, steps_per_epoch={STEPS}, verbose=0)\n"
)
MIB = 2**20
SIDES = {"forked": "1", "fresh": "0"}


def _task_pids(state: str, name: str) -> dict[str, int]:
    try:
        with open(os.path.join(state, name, "state.json")) as f:
            tasks = json.load(f).get("tasks", {})
    except (OSError, ValueError):
        return {}
    return {t: int(v["pid"]) for t, v in tasks.items() if v.get("pid")}


def _job_cpu(state: str, name: str, cpu: dict[tuple[int, float], float]) -> None:
    """The CPU seconds so far of the job's supervisor and every process below it, by (pid, start time)."""
    try:
        with open(os.path.join(state, name, "supervisor.pid")) as f:
            sup = psutil.Process(json.load(f)["pid"])
        procs = [sup, *sup.children(recursive=True)]
    except (OSError, ValueError, KeyError, psutil.Error):
        return
    for p in procs:
        try:
            t = p.cpu_times()
            cpu[(p.pid, p.create_time())] = t.user + t.system
        except psutil.Error:
            continue


def _sample(
    state: str,
    name: str,
    stop: threading.Event,
    peaks: dict[str, dict[str, float]],
    cpu: dict[tuple[int, float], float],
) -> None:
    """Each task's largest RSS/PSS/USS (MiB), and the job's processes' CPU, until `stop`."""
    while not stop.is_set():
        _job_cpu(state, name, cpu)
        for task, pid in _task_pids(state, name).items():
            try:
                m = psutil.Process(pid).memory_full_info()
            except psutil.Error:
                continue
            peak = peaks.setdefault(task, {"rss_mib": 0.0, "pss_mib": 0.0, "uss_mib": 0.0})
            for key, v in (("rss_mib", m.rss), ("pss_mib", m.pss), ("uss_mib", m.uss)):
                peak[key] = max(peak[key], round(v / MIB, 1))
        stop.wait(0.2)


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def one_run(side: str, i: int) -> dict[str, Any]:
    from tests.kernels import Kernel, kernel_env

    state = tempfile.mkdtemp(prefix=f"tfdist-bench-fork-{side}-")
    env = kernel_env(state, TFDIST_POOL_SIZE="0", TFDIST_FORK_TASKS=SIDES[side])
    k = Kernel(env, cwd=state)
    name = f"{side}-{i}"
    try:
        r = k.execute(KERNEL_SETUP, timeout=300)
        assert r.error is None, r.error_text
        peaks: dict[str, dict[str, float]] = {}
        job_cpu: dict[tuple[int, float], float] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=_sample, args=(state, name, stop, peaks, job_cpu), daemon=True)
        cpu0, t0 = _cpu(k.pid), time.perf_counter()
        sampler.start()
        try:
            r = k.execute(CELL.format(name=name), timeout=900)
        finally:
            stop.set()
            sampler.join()
        wall = time.perf_counter() - t0
        kernel_cpu = _cpu(k.pid) - cpu0
        cpu = kernel_cpu + sum(job_cpu.values())
        assert r.error is None, r.error_text
        with open(os.path.join(state, name, "supervisor.log")) as f:
            forked = f.read().count(" is forked process ")
    finally:
        k.shutdown()
    assert (forked > 0) == (side == "forked"), f"{side}: {forked} tasks were forked"
    return {
        "cell_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "kernel_cpu_s": round(kernel_cpu, 3),
        "job_processes": len(job_cpu),
        "forked_tasks": forked,
        "tasks": peaks,
        "tasks_rss_mib": round(sum(p["rss_mib"] for p in peaks.values()), 1),
        "tasks_pss_mib": round(sum(p["pss_mib"] for p in peaks.values()), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "fork.json"))
    a = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for i in range(a.repeats):
        for side in SIDES:  # interleaved: the machine's load changes by the minute
            runs[side].append(one_run(side, i))
            print(f"{side} {i}: {runs[side][-1]['cell_s']} s", file=sys.stderr)

    def med(side: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[side]), 3)

    def per_task(side: str, key: str) -> float:
        return round(statistics.median(p[key] for r in runs[side] for p in r["tasks"].values()), 1)

    report: dict[str, Any] = {
        "job": f"1 PS + 2 workers, {EPOCHS} epochs of {STEPS} steps, the kernel's first job, pool off",
        "medians": {
            side: {
                "cell_s": med(side, "cell_s"),
                "cpu_s": med(side, "cpu_s"),
                "per_task_rss_mib": per_task(side, "rss_mib"),
                "per_task_pss_mib": per_task(side, "pss_mib"),
                "per_task_uss_mib": per_task(side, "uss_mib"),
            }
            for side in SIDES
        },
        "runs": runs,
    }
    f, s = report["medians"]["forked"], report["medians"]["fresh"]
    report["ratios_forked_over_fresh"] = {k: round(f[k] / s[k], 3) for k in f if s[k]}
    report["machine"] = machine()
    text = json.dumps(report, indent=2)
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
