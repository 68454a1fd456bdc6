"""On a machine with an NVIDIA GPU: does tfdist's sampler read what nvidia-smi reads?

Loads GPU 0 with PyTorch matmuls (the load), samples it with tfdist.sampler.GpuReader and with
`nvidia-smi --query-gpu=utilization.gpu,memory.used` once a second, and prints both series and their
differences. Needs only nvidia-ml-py, psutil and PyTorch. Exits 2 when there is no GPU.

    python benchmarks/gpu_sampler_check.py [--seconds 20] [--gpu 0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time


def smi(index: int) -> tuple[float, float]:
    out = subprocess.run(
        [
            "nvidia-smi",
            f"--id={index}",
            "--query-gpu=utilization.gpu,memory.used",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout.strip()
    util, mem = (float(v) for v in out.split(","))
    return util, mem


def load(index: int, stop: threading.Event, phase: list[str]) -> None:
    import torch

    dev = torch.device(f"cuda:{index}")
    a = torch.randn(8192, 8192, device=dev)
    hold = torch.empty(int(4 * 2**30 / 4), device=dev)  # 4 GiB held, so memory is not ~0
    while not stop.is_set():
        if phase[0] == "busy":
            b = a @ a
            torch.cuda.synchronize(dev)
            del b
        else:
            time.sleep(0.05)
    del hold


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--gpu", type=int, default=0)
    a = ap.parse_args()
    if shutil.which("nvidia-smi") is None:
        print("no nvidia-smi: this check needs an NVIDIA GPU", file=sys.stderr)
        return 2
    from tfdist.sampler import GpuReader

    reader = GpuReader()
    if not reader.available:
        print("NVML sees no GPU", file=sys.stderr)
        return 2
    stop, phase = threading.Event(), ["idle"]
    th = threading.Thread(target=load, args=(a.gpu, stop, phase), daemon=True)
    th.start()
    rows = []
    t0 = time.time()
    try:
        for i in range(a.seconds):
            phase[0] = "busy" if a.seconds // 4 <= i < 3 * a.seconds // 4 else "idle"
            time.sleep(1.0)
            t = time.perf_counter()
            ours = reader.read(a.gpu)
            cost_ms = 1000 * (time.perf_counter() - t)
            su, sm = smi(a.gpu)
            rows.append(
                {
                    "t": round(time.time() - t0, 1),
                    "phase": phase[0],
                    "ours_util": ours["util (%)"],
                    "smi_util": su,
                    "ours_mem_mib": round(ours["mem_used (MiB)"], 1),
                    "smi_mem_mib": sm,
                    "read_ms": round(cost_ms, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop.set()
        th.join(10)
    du = [abs(r["ours_util"] - r["smi_util"]) for r in rows]
    dm = [abs(r["ours_mem_mib"] - r["smi_mem_mib"]) for r in rows]
    busy = [r["ours_util"] for r in rows if r["phase"] == "busy"]
    idle = [r["ours_util"] for r in rows if r["phase"] == "idle"]
    summary = {
        "util_abs_diff_median_pct": statistics.median(du),
        "util_abs_diff_max_pct": max(du),
        "mem_abs_diff_median_mib": statistics.median(dm),
        "mem_abs_diff_max_mib": max(dm),
        "ours_util_busy_median": statistics.median(busy) if busy else None,
        "ours_util_idle_median": statistics.median(idle) if idle else None,
        "read_ms_median": statistics.median(r["read_ms"] for r in rows),
    }
    print(json.dumps({"summary": summary}, indent=2))
    ok = summary["util_abs_diff_median_pct"] <= 10 and summary["mem_abs_diff_median_mib"] <= 64
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
