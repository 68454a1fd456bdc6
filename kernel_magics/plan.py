"""`%tfdist plan MODEL DATASET` and `%%tfdist plan`: predict how fast each way of distributing this model
would train, before any GPU hour is spent, and recommend one `%%tfdist run` line.

The model and dataset are measured in a short-lived subprocess (`tfdist.runtime.probe`), never in the
kernel and never against a cluster; the prediction is `tfdist.advisor`'s (pure). Hardware comes from the
flags, else the server's settings (`TFDIST_PLAN_NODES`, `TFDIST_PLAN_GPUS_PER_NODE`,
`TFDIST_PLAN_BANDWIDTH`, set by the admin through the spawner), else a default per backend.
"""

from __future__ import annotations

import argparse
import ast
import html
import io
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError
from IPython.display import HTML, Image, display

from .. import advisor, payload
from ..errors import TfdistError
from ..runtime.deathsig import die_with_parent
from ..runtime.netns import IsolationUnavailable, isolation_prefix
from ..runtime.probe import ProbeResult
from ..settings import ENV_NETNS, KernelSettings
from ..taskenv import thread_env, usable_cores
from . import args as margs
from .fitcheck import check_compiled, check_fits

PROBE_TIMEOUT_S = 360.0  # the model's timing, the fixed costs and up to four layouts' trials (extra rounds
# only where the first two took at most probetrials.EXTRA_AFTER_S)
MAX_TRIED_WORKERS = 4  # beyond this a local CPU plan is not tried layout by layout: too many processes


@dataclass
class FitCall:
    model: str  # the fit's receiver as written (`model`, `models["a"]`): for the summary
    source: str  # what the probe runs: the cell (as `%%tfdist run` would), or `MODEL.fit(DATA)`
    reads: list[str]  # the notebook names it reads, shipped as the job ships them
    line_offset: int  # lines above the source in the cell (the magic's line)


def plan_parser() -> argparse.ArgumentParser:
    p = margs._Parser(
        prog="%tfdist plan",
        description="Predict steps/s for 1 worker, N workers with k PS and all-reduce; recommend a run line.",
    )
    p.add_argument("model", nargs="?", help="line magic: the model's name (the cell form finds it)")
    p.add_argument("data", nargs="?", help="line magic: the dataset's name")
    p.add_argument("--workers", type=int, default=None, help="workers to plan for (default: the devices)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (Kubernetes; local: 1)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node")
    p.add_argument("--bandwidth", default=None, help="network bandwidth per node, e.g. 10Gbps, 25gbit")
    p.add_argument("--backend", default=None, help="local or kubernetes (default: this server's)")
    p.add_argument("--steps-per-epoch", type=int, default=None, help="for the epoch time")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="local CPU: predict from the measured fixed costs alone, without trying each layout's fit "
        "(faster; Kubernetes and GPU plans always do)",
    )
    return p


def find_fit(source: str) -> str:
    """The receiver of the cell's first `X.fit(...)` (as written): the cell runs in the probe up to it."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise TfdistError(f"SyntaxError in the cell, line {(exc.lineno or 0) + 1}: {exc.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fit":
            return ast.unparse(node.func.value)
    raise TfdistError(
        "%%tfdist plan found no model.fit(...) call in the cell: it measures the model and dataset "
        "of a fit (e.g. history = model.fit(train_ds, epochs=5, steps_per_epoch=100)); nothing was started"
    )


def cell_fit(shell: Any, cell: str) -> FitCall:
    """The cell as `%%tfdist run` takes it: the same checks, the same names shipped."""
    from .magics import SHELL_NAMES

    source = shell.transform_cell(cell)
    if "get_ipython()" in source:
        raise UsageError(
            "IPython magics and shell escapes (%, !) cannot run where the fit is measured (nor on the "
            "job's coordinator): move them to another cell"
        )
    model = find_fit(source)
    names = payload.cell_names(source)
    undefined = payload.undefined_names(names, shell.user_ns)
    if undefined:
        raise TfdistError(
            f"name {undefined[0]!r} is used in the cell but not defined in the notebook: run the cell "
            "that defines it first; nothing was started"
        )
    check_fits(source, shell.user_ns, names.binds)
    reads = [n for n in names.reads if n in shell.user_ns and n not in SHELL_NAMES]
    return FitCall(model, source, reads, line_offset=1)


def line_fit(shell: Any, model: str, data: str) -> FitCall:
    """`%tfdist plan MODEL DATASET`: the two names, checked here for a clear sentence."""
    ns = shell.user_ns
    for name, what in ((model, "model"), (data, "dataset")):
        if name not in ns:
            raise TfdistError(f"name {name!r} ({what}) is not defined in the notebook; nothing was started")
    if not payload._is_keras_model(ns[model]):
        raise TfdistError(
            f"{model!r} is not a tf.keras (tf_keras) model ({type(ns[model]).__name__}): plan measures the "
            "model of a fit; nothing was started"
        )
    if not payload._is_dataset(ns[data]):
        raise TfdistError(
            f"{data!r} is not a tf.data dataset ({type(ns[data]).__name__}): plan measures a batched "
            "tf.data pipeline; nothing was started"
        )
    check_compiled(model, ns)
    return FitCall(model, f"{model}.fit({data})", [model, data], line_offset=0)


def hardware(opts: argparse.Namespace, settings: Any) -> tuple[advisor.Hardware, int]:
    """The hardware to plan for, and the workers: flags, else the admin's settings, else defaults."""
    backend = opts.backend or settings.backend
    if backend not in ("local", "kubernetes"):
        raise UsageError(f"%tfdist plan: --backend {backend!r} is unknown: choose local or kubernetes")
    env = KernelSettings()
    try:
        bw_text = opts.bandwidth or env.plan_bandwidth
        bandwidth = advisor.parse_bandwidth(bw_text) if bw_text else advisor.DEFAULT_BANDWIDTH[backend]
    except ValueError as exc:
        raise UsageError(f"%tfdist plan: {exc}") from None
    for flag, value in (("--nodes", opts.nodes), ("--gpus-per-node", opts.gpus_per_node)):
        if value is not None and value < 1:
            raise UsageError(f"%tfdist plan: {flag} must be at least 1 (got {value})")
    if opts.workers is not None and opts.workers < 1:
        raise UsageError(f"%tfdist plan: --workers must be at least 1 (got {opts.workers})")
    gpus = opts.gpus_per_node or env.plan_gpus_per_node or (settings.gpus or 0)
    if backend == "local":
        cores = usable_cores()
        hw = advisor.Hardware(
            nodes=1,
            devices_per_node=max(1, gpus),
            bandwidth=bandwidth,
            local_bandwidth=bandwidth,
            shared_cpu_cores=None if gpus else cores,
        )
        return hw, opts.workers or max(2, gpus)
    nodes = opts.nodes or env.plan_nodes
    hw = advisor.Hardware(nodes=nodes, devices_per_node=max(1, gpus), bandwidth=bandwidth)
    return hw, opts.workers or hw.devices


def trial_layouts(hw: advisor.Hardware, workers: int, estimate: bool) -> list[str]:
    """The layouts a local CPU plan tries (`tfdist.runtime.probetrials`): on shared cores a layout's pace
    is what its processes leave each other, which no sum of fixed costs predicts. None on GPUs or a
    cluster (the probe runs here, not there), nor with --estimate."""
    if estimate or hw.shared_cpu_cores is None or hw.nodes != 1 or workers > MAX_TRIED_WORKERS:
        return []
    return ["1x1", *(f"{workers}x{k}" for k in advisor.ps_counts(workers, workers)), f"ar{workers}"]


def probe_prefix(server_backend: str) -> list[str]:
    """The probe starts TensorFlow servers (its fixed costs, its trials) that listen on every interface and
    run any graph sent to them, as a local job's do: where this server runs local jobs, the probe gets a
    network namespace of its own as they do. A notebook pod's namespace admits nobody to those ports (its
    default-deny ingress, which its user cannot delete)."""
    if server_backend != "local":
        return []
    try:
        return isolation_prefix(KernelSettings().isolation, "the plan's measurement")
    except (ValueError, IsolationUnavailable) as exc:
        raise TfdistError(str(exc)) from None


def measure(
    shell: Any, fit: FitCall, split: int, trials: list[str] | None = None, prefix: list[str] | None = None
) -> ProbeResult:
    """The probe's measurement of the fit, in a subprocess with this server's thread pools (under
    `prefix`: `probe_prefix`)."""
    try:
        blob = payload.pack(fit.source, fit.reads, shell.user_ns, line_offset=fit.line_offset)
    except payload.ShippingError as exc:
        raise TfdistError(f"{exc}; nothing was started") from None
    with tempfile.TemporaryDirectory(prefix="tfdist-plan-") as d:
        bundle, out = os.path.join(d, "bundle.bin"), os.path.join(d, "probe.json")
        with open(bundle, "wb") as f:
            f.write(blob)
        env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3")
        env.pop("TF_CONFIG", None)
        env |= thread_env(None, usable_cores())
        env[ENV_NETNS] = "1" if prefix else "0"
        try:
            proc = subprocess.run(
                [
                    *(prefix or []),
                    sys.executable,
                    "-m",
                    "tfdist.runtime.probe",
                    bundle,
                    out,
                    str(split),
                    ",".join(trials or []),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                # a kernel SIGKILLed mid-plan takes its probe along (its helpers die with the probe), which
                # ran on, maybe on a GPU, with the notebook's model and data
                preexec_fn=die_with_parent(),
            )
        except subprocess.TimeoutExpired:
            raise TfdistError(
                f"measuring {fit.model!r} took over {PROBE_TIMEOUT_S:g}s; nothing was started"
            ) from None
        try:
            with open(out) as f:
                result = json.load(f)
        except (OSError, ValueError):
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            raise TfdistError(f"the model could not be measured: {' / '.join(tail)}") from None
    if "error" in result:
        raise TfdistError(f"the model could not be measured: {result['error']}; nothing was started")
    got = ProbeResult(**result)
    got.split_step_s = [(int(b), float(t)) for b, t in got.split_step_s]
    return got


def trials_text(got: ProbeResult) -> str:
    """What the layouts' trials took here, and which had none (why)."""
    from tfdist.runtime.probetrials import CONTEND

    if not (got.trials or got.trial_errors):
        return ""
    out = "tried here: "
    if got.trials:
        steps = next(iter(got.trials.values())).get("steps")
        out += f"each layout's fit timed over {2 * got.trial_round_epochs} epochs of {steps} steps, in two"
        out += " rounds of the layouts in mirrored order"
        close = got.trial_extra
        if close:
            names = ", ".join(close[:-1]) + " and " + close[-1]
            out += f", then {names} (within {CONTEND * 100:.0f} % of the best pace) in two more"
        out += (
            " ("
            + ", ".join(f"{k} {t['pace_s'] * 1000:.1f} ms/step" for k, t in got.trials.items())
            + "); the table's numbers for those layouts are their pace here"
        )
    if got.trial_errors:
        out += "; no trial, so from the costs: " + "; ".join(f"{k}: {e}" for k, e in got.trial_errors.items())
    return out + "\n"


def costs_text(hw: advisor.Hardware, error: str) -> str:
    """What was measured here for the fixed costs, and what was assumed."""
    names = {
        "ps_overhead_s": ("PS step round trip", "ms"),
        "ps_per_variable_s": ("per further variable", "ms"),
        "ps_dispatch_s": ("coordinator dispatch", "ms"),
        "ps_dispatch_per_ps_s": ("dispatch per extra PS", "ms"),
        "allreduce_overhead_s": ("all-reduce step (fit loop, collective)", "ms"),
        "allreduce_bandwidth": ("all-reduce rate", "GB/s"),
        "link_bandwidth": ("PS link rate", "GB/s"),
    }

    def show(key: str) -> str:
        label, unit = names[key]
        value = hw.bandwidth if key == "link_bandwidth" else getattr(hw, key)
        if value is None:
            return f"{label} as the links"
        return f"{label} {value * 1000:.2f} ms" if unit == "ms" else f"{label} {value / 1e9:.2f} GB/s"

    measured = [show(k) for k in advisor.COSTS if k in hw.measured]
    assumed = [show(k) for k in advisor.COSTS if k not in hw.measured]
    out = "measured here: model step" + (", " + ", ".join(measured) if measured else "")
    out += "\nassumed: " + (", ".join(assumed) or "nothing")
    if error:
        out += f" (the fixed costs could not be measured here: {error})"
    return out


def _epochs_head(epochs: int | None) -> str:
    return f"{epochs} epoch{'s' if epochs != 1 else ''}" if epochs else "epoch"


def _cells(p: advisor.Prediction, epochs: int | None) -> tuple[str, ...]:
    t = p.train_s(epochs) if epochs else p.epoch_s
    batch = f"{p.replica_batch}" + (f" x {p.workers}" if p.strategy != "single" else "")
    return (p.label, batch, f"{p.examples_per_s:.0f}", f"{t:.1f} s" if t is not None else "-", p.bound)


def table_text(preds: list[advisor.Prediction], epochs: int | None = None) -> str:
    rows = [("layout", "batch", "examples/s", _epochs_head(epochs), "bound")]
    rows += [_cells(p, epochs) for p in preds]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def table_html(preds: list[advisor.Prediction], best: advisor.Prediction, epochs: int | None = None) -> str:
    heads = ("layout", "batch", "examples/s", _epochs_head(epochs), "bound")
    head = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    body = []
    for p in preds:
        style = " style='font-weight:bold'" if p is best else ""
        cells = _cells(p, epochs)
        body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<table class='tfdist-plan'><tr>{head}</tr>{''.join(body)}</table>"


def chart_png(preds: list[advisor.Prediction]) -> bytes:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 0.4 * len(preds) + 1))
    ax = fig.add_subplot()
    ax.barh([p.label for p in preds][::-1], [p.examples_per_s for p in preds][::-1], color="#4a7ab0")
    ax.set_xlabel("predicted examples/s")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plan(magics: Any, argv: list[str], cell: str | None) -> None:
    opts = plan_parser().parse_args(argv)
    if cell is not None:
        if opts.model or opts.data:
            raise UsageError("%%tfdist plan takes no names: it finds the fit in the cell")
        if not cell.strip():
            raise UsageError("the %%tfdist plan cell is empty: put the fit you want planned in it")
        fit = cell_fit(magics.shell, cell)
    else:
        if not (opts.model and opts.data):
            raise UsageError(
                "%tfdist plan MODEL DATASET (names in the notebook), or %%tfdist plan over a cell with "
                "model.fit(...)"
            )
        fit = line_fit(magics.shell, opts.model, opts.data)
    hw, workers = hardware(opts, magics.settings)
    prefix = probe_prefix(magics.settings.backend)
    got = measure(magics.shell, fit, workers, trial_layouts(hw, workers, opts.estimate), prefix)
    hw = advisor.with_costs(hw, got.costs, local=(opts.backend or magics.settings.backend) == "local")
    m = advisor.Measured(
        step_s=got.step_s,
        batch=got.batch,
        var_bytes=tuple(got.var_bytes),
        grad_bytes=got.grad_bytes,
        steps_per_epoch=opts.steps_per_epoch or got.steps_per_epoch,
        cores_used=got.cores_used,
        split_step_s=tuple(got.split_step_s),
        epochs=got.epochs,
        step_bytes=tuple(got.step_bytes),
    )
    preds = advisor.plan(m, hw, workers, split=True)  # the cell runs as written: all-reduce splits its batch
    preds = [advisor.tried(p, m, got.trials[p.key]["pace_s"]) if p.key in got.trials else p for p in preds]
    best, why = advisor.recommend(preds)
    shards = advisor.shard(m.var_bytes, max(p.ps for p in preds))
    summary = (
        f"{fit.model}: {got.params:,} parameters ({advisor.size(m.param_bytes)} in {len(m.var_bytes)} "
        f"variables, the largest {advisor.size(max(m.var_bytes))}), batch {m.batch}, one step "
        f"{m.step_s * 1000:.1f} ms on one device here; over {len(shards)} PS: "
        + ", ".join(advisor.size(s) for s in shards)
    )
    moved = sum(m.moved_bytes)
    if moved < m.param_bytes:  # sparse gradients (an embedding's): a step moves the rows it touches
        summary += f"; a step moves {advisor.size(moved)} each way (sparse gradients: the rows it touches)"

    where = f"{hw.nodes} node(s) x {hw.devices_per_node} device(s)"
    semantics = (
        "batch: PS workers each take the cell's batch; all-reduce splits it over the workers "
        "(the dataset's batch is the global one)"
    )
    text = f"{summary}\nplanned for {workers} workers on {where}\n{trials_text(got)}"
    text += f"{costs_text(hw, got.costs_error)}\n"
    text += f"{semantics}\n\n{table_text(preds, m.epochs)}\n\n"
    text += f"recommended: {best.run_line()}\nwhy: {why}"
    print(text)
    display(HTML(table_html(preds, best, m.epochs)))
    display(Image(chart_png(preds)))
