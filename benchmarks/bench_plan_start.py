"""How long `%%tfdist plan` takes, its helpers forked from one TensorFlow import against every helper fresh.

`%%tfdist plan --workers 2` over the advisor benchmark's cell (benchmarks/bench_advisor.py; default the
tiny dense model: its trials are short, so the helpers' start-up is most of the plan) in one kernel, the
two ways interleaved in each repeat: `forked` (the product's default: the probe's fork server imports
TensorFlow beside the probe and every helper is forked from it) and `fresh` (TFDIST_FORK_TASKS=0 in the
kernel: each of the nine helpers imports TensorFlow itself, as every plan did before). Measured per plan:
the cell's wall time and the CPU seconds of the probe and everything it started (the kernel's reaped
children). Reported: medians and forked/fresh ratios.
Run:  nice python benchmarks/bench_plan_start.py [--repeats 3] [--model tiny]
   -> benchmarks/results/plan_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from bench_advisor import FIT, MODELS, SETUP
from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MODES = {"forked": "1", "fresh": "0"}
CHILD_CPU = "import resource as _r; _u = _r.getrusage(_r.RUSAGE_CHILDREN); print(_u.ru_utime + _u.ru_stime)"


def plan_once(k, cell: str, fork: str) -> dict[str, float]:
    r = k.execute(f"os.environ['TFDIST_FORK_TASKS'] = {fork!r}\n{CHILD_CPU}", timeout=30)
    cpu0 = float(r.text.strip())
    t0 = time.time()
    r = k.execute(f"%%tfdist plan --workers 2\n{cell}", timeout=600)
    wall = time.time() - t0
    assert r.error is None, r.error_text
    assert "recommended: " in r.text and "tried here: " in r.text, r.text
    cpu = float(k.execute(CHILD_CPU, timeout=30).text.strip()) - cpu0
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "plan_start.json"))
    args = ap.parse_args()
    from tests.kernels import Kernel, kernel_env

    kind, steps, epochs = MODELS[args.model]
    cell = FIT.format(model=args.model, kind=kind, epochs=epochs, steps=steps)
    k = Kernel(kernel_env(tempfile.mkdtemp(prefix="tfdist-bench-")), cwd=tempfile.mkdtemp())
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    try:
        r = k.execute(SETUP, timeout=300)
        assert r.error is None, r.error_text
        for i in range(args.repeats):
            order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
            for mode in order:
                runs[mode].append(plan_once(k, cell, MODES[mode]))
                print(mode, runs[mode][-1], flush=True)
    finally:
        k.shutdown()
    median = {m: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for m, rs in runs.items()}
    out = {
        "how": __doc__.split("\n\n")[1].replace("\n", " "),
        "model": args.model,
        "repeats": args.repeats,
        "median": median,
        "ratios": {
            "wall_forked_over_fresh": round(median["forked"]["wall_s"] / median["fresh"]["wall_s"], 2),
            "cpu_forked_over_fresh": round(median["forked"]["cpu_s"] / median["fresh"]["cpu_s"], 2),
        },
        "runs": runs,
        "machine": machine(),
    }
    print(json.dumps(out["median"]), json.dumps(out["ratios"]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
