"""The live monitor in the cell: job state, start-up and epoch progress, loss curves, per-task CPU and
memory, per-GPU utilization and memory, and a log tail; plus a static PNG when the run ends, so a saved
or exported notebook still shows what happened.

Built from ipywidgets + bqplot. `refresh(view)` is called about once a second by the waiting cell with
the job's whole state (a JobView); it sends one batch of widget updates per call (hold_sync).
"""

from __future__ import annotations

import html
import io
import math
import re
import time
from typing import Any

from ..job.vocab import STARTED_TASK_STATES, JobState, TaskState
from ..jobview import LIVE_TASK_STATES, JobView

SERVING = STARTED_TASK_STATES - {TaskState.EXITED_OK}  # a server task that came up (the start-up bar)

STATE_COLORS = {
    "succeeded": "#2e7d32",
    "failed": "#c62828",
    "stopped": "#6d4c41",
    "running": "#1565c0",
    "queued": "#6a1b9a",
}
# One colour per series, in the live charts and their legends alike (matplotlib's tab10)
PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
]  # fmt: skip


def job_css_class(name: str) -> str:
    """`tfdist-job-<name>` on the monitor's outer widget: how the lab extension finds a monitor's job."""
    return "tfdist-job-" + re.sub(r"[^A-Za-z0-9_-]", "-", name)


def _num(v: Any, unit: str = "") -> str:
    """A job-supplied number as text; anything that is not a finite number shows as "-"."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return "-"
    return f"{v:.0f}{unit}"


def _series(view: JobView, key: str) -> dict[str, tuple[list[float], list[float]]]:
    """Per-task time series of one metric, x = seconds since the job started."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    t0 = view.created
    for m in view.metrics:
        for task, rec in m["tasks"].items():
            v = rec.get(key)
            if v is None:
                continue
            xs, ys = out.setdefault(task, ([], []))
            xs.append(m["t"] - t0)
            ys.append(v)
    return out


def _gpu_name(g: dict[str, Any]) -> str:
    """gpu0, or gpu0 MIG 1g.10gb for a MIG instance (two instances of one GPU share its index)."""
    mig = g.get("mig_profile")
    return f"gpu{g.get('index', '?')}" + (f" MIG {mig}" if isinstance(mig, str) and mig else "")


def _util_text(g: dict[str, Any]) -> str:
    """A GPU's utilization as text; "n/a (MIG)" where NVML cannot measure it (never a 0 it did not read)."""
    return "n/a (MIG)" if g.get("util_missing") == "mig" else _num(g.get("util (%)"), "%")


def _gpu_series(view: JobView, key: str) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    t0 = view.created
    for m in view.metrics:
        for task, rec in m["tasks"].items():
            for g in rec.get("gpus", []):
                v = g.get(key)
                if v is None:
                    continue
                xs, ys = out.setdefault(f"{task} {_gpu_name(g)}", ([], []))
                xs.append(m["t"] - t0)
                ys.append(v)
    return out


def _epoch_series(view: JobView) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    for i, rec in enumerate(view.epoch_logs):
        for k, v in rec.items():
            if k in ("epoch", "t") or v is None:
                continue
            xs, ys = out.setdefault(k, ([], []))
            xs.append(float(rec.get("epoch") or i + 1))
            ys.append(float(v))
    return out


def header_html(view: JobView, note: str = "") -> str:
    color = STATE_COLORS.get(view.state_word, "#555")
    took = (view.ended or time.time()) - view.created
    warn = (
        f"<div class='tfdist-stall' style='color:#b26a00;font-weight:bold'>{html.escape(note)}</div>"
        if note and not view.finished
        else ""
    )
    return (
        f"<b>tfdist job {html.escape(view.name)}</b> &nbsp; "
        f"<span style='color:{color};font-weight:bold'>{html.escape(view.state_word)}</span>"
        f" &nbsp; {html.escape(view.message or '')} &nbsp; <small>{took:.0f}s</small>{warn}"
    )


def tasks_html(view: JobView) -> str:
    last = view.metrics[-1]["tasks"] if view.metrics else {}
    rows = []
    for name, t in sorted(view.tasks.items()):
        state = str(t.get("state", ""))
        # a process that has ended has no CPU or memory now (its last sample would say 0 MiB "running")
        m = last.get(name, {}) if state in LIVE_TASK_STATES and not view.finished else {}
        gpus = (
            ", ".join(
                f"{_gpu_name(g)} {_util_text(g)} {_num(g.get('mem_used (MiB)'), 'MiB')}"
                for g in m.get("gpus") or []
                if isinstance(g, dict)
                and (g.get("util (%)") is not None or g.get("mem_used (MiB)") is not None)
            )
            or ",".join(str(g) for g in t.get("gpus") or [])
            or "-"
        )
        rows.append(
            "<tr>"
            + "".join(
                f"<td style='padding:0 8px'>{html.escape(c)}</td>"
                for c in (
                    str(name),
                    state,
                    str(t.get("restarts", 0)),
                    _num(m.get("cpu (%)"), "%"),
                    _num(m.get("rss (MiB)"), " MiB"),
                    gpus,
                )
            )
            + "</tr>"
        )
    head = "".join(
        f"<th style='padding:0 8px;text-align:left'>{h}</th>"
        for h in ("task", "state", "restarts", "CPU", "memory", "GPUs")
    )
    return f"<table style='font-size:12px'><tr>{head}</tr>{''.join(rows)}</table>"


def log_text(view: JobView, lines: int = 40) -> str:
    return "\n".join(f"[{t}] {line}" for t, line in list(view.logs)[-lines:])


class WidgetMonitor:
    """ipywidgets + bqplot monitor. Created once per run; refreshed with the whole view each tick."""

    def __init__(self, view: JobView):
        import bqplot as bq
        import ipywidgets as w

        self._bq = bq
        self._w = w
        self.note = ""  # a warning shown under the header while the job runs (the stall watchdog's)
        self.header = w.HTML(header_html(view))
        self.startup = w.IntProgress(
            value=0, min=0, max=max(1, view.total_tasks - 1), description="tasks", bar_style="info"
        )
        self.startup_label = w.Label("")
        self.epochs = w.IntProgress(value=0, min=0, max=1, description="epochs")
        self.epochs_label = w.Label("")
        self.table = w.HTML("")
        self.logs = w.Textarea(value="", layout=w.Layout(width="100%", height="160px"), disabled=True)
        self.figs: dict[str, Any] = {}
        self.legends: dict[str, Any] = {}
        for key, title, xlabel in (
            ("curves", "loss and metrics", "epoch"),
            ("cpu", "CPU per task (%)", "s"),
            ("rss", "memory per task (MiB)", "s"),
            ("gpu", "GPU utilization (%)", "s"),
            ("gpumem", "GPU memory (MiB)", "s"),
        ):
            self.figs[key] = self._figure(title, xlabel)
            self.legends[key] = w.HTML("", layout=w.Layout(width="330px"))
        chart = {k: w.VBox([self.figs[k], self.legends[k]]) for k in self.figs}
        self.gpu_box = w.HBox([chart["gpu"], chart["gpumem"]])
        self.gpu_box.layout.display = "none"
        self.widget = w.VBox(
            [
                self.header,
                w.HBox([self.startup, self.startup_label]),
                w.HBox([self.epochs, self.epochs_label]),
                w.HBox([chart["curves"], chart["cpu"], chart["rss"]]),
                self.gpu_box,
                self.table,
                w.Accordion(children=[self.logs], titles=("logs (all tasks; full logs: %tfdist logs NAME)",)),
            ]
        )
        self.widget.add_class("tfdist-monitor")
        self.widget.add_class(job_css_class(view.name))

    def _figure(self, title: str, xlabel: str) -> Any:
        """A chart without bqplot's legend (it sits on the lines): the legend is HTML under it."""
        bq = self._bq
        xs, ys = bq.LinearScale(), bq.LinearScale()
        line = bq.Lines(
            x=[], y=[], scales={"x": xs, "y": ys}, display_legend=False, labels=[], colors=PALETTE
        )
        fig = bq.Figure(
            marks=[line],
            axes=[bq.Axis(scale=xs, label=xlabel), bq.Axis(scale=ys, orientation="vertical")],
            title=title,
            layout={"width": "330px", "height": "220px"},
            fig_margin={"top": 40, "bottom": 40, "left": 50, "right": 10},
        )
        return fig

    def close(self) -> None:
        """Close every widget of the monitor (layouts, scales and marks included) once its output shows
        the picture instead: nothing of it stays in the kernel or in the notebook's widget state."""
        seen: dict[int, Any] = {}
        stack: list[Any] = [self.widget]
        while stack:
            wid = stack.pop()
            if id(wid) in seen or not isinstance(wid, self._w.Widget):
                continue
            seen[id(wid)] = wid
            for key in wid.keys:
                val = getattr(wid, key, None)
                vals = (
                    val.values()
                    if isinstance(val, dict)
                    else val
                    if isinstance(val, (list, tuple))
                    else [val]
                )
                stack.extend(v for v in vals if isinstance(v, self._w.Widget))
        for wid in seen.values():
            wid.close()

    def _set_lines(self, key: str, series: dict[str, tuple[list[float], list[float]]]) -> None:
        line = self.figs[key].marks[0]
        names = sorted(series)
        if not names:
            return
        legend = legend_html(names)
        if self.legends[key].value != legend:
            self.legends[key].value = legend
        # at least 2 points per line: bqplot squeezes arrays, and a (k, 1) array would lose its meaning
        n = max(2, max(len(series[k][0]) for k in names))
        xs = [series[k][0] + [series[k][0][-1]] * (n - len(series[k][0])) for k in names]
        ys = [series[k][1] + [series[k][1][-1]] * (n - len(series[k][1])) for k in names]
        with line.hold_sync():
            line.x, line.y, line.labels = xs, ys, names

    def refresh(self, view: JobView) -> None:
        self.header.value = header_html(view, self.note)
        servers = max(1, view.total_tasks - 1)
        started = sum(1 for n, t in view.tasks.items() if n != "chief-0" and t.get("state") in SERVING)
        self.startup.max, self.startup.value = servers, min(started, servers)
        self.startup_label.value = f"{started}/{servers} servers started"
        if view.epochs:
            self.epochs.max = view.epochs
            self.epochs.value = min(view.epoch, view.epochs)
        last = view.epoch_logs[-1] if view.epoch_logs else {}
        metrics = ", ".join(
            f"{k}={v:.4g}" for k, v in last.items() if k not in ("epoch", "t") and v is not None
        )
        self.epochs_label.value = f"{view.epoch}/{view.epochs or '?'} {view.phase} {metrics}"
        self._set_lines("curves", _epoch_series(view))
        self._set_lines("cpu", _series(view, "cpu (%)"))
        self._set_lines("rss", _series(view, "rss (MiB)"))
        gpu = _gpu_series(view, "util (%)")
        if gpu or _gpu_series(view, "mem_used (MiB)"):  # a MIG instance has memory, no utilization
            self.gpu_box.layout.display = "flex"
            self._set_lines("gpu", gpu)
            self._set_lines("gpumem", _gpu_series(view, "mem_used (MiB)"))
        self.table.value = tasks_html(view)
        self.logs.value = log_text(view)
        if view.finished:
            self.startup.bar_style = "success" if view.state == JobState.SUCCEEDED else "danger"


def legend_html(names: list[str]) -> str:
    """The legend of a live chart, under it: one swatch per series in the colour bqplot draws it."""
    return (
        "<div style='font-size:11px;line-height:1.3'>"
        + " &nbsp; ".join(
            f"<span style='white-space:nowrap'>"
            f"<span style='color:{PALETTE[i % len(PALETTE)]}'>&#9644;</span> "
            f"{html.escape(str(n))}</span>"
            for i, n in enumerate(names)
        )
        + "</div>"
    )


def static_png(view: JobView) -> bytes:
    """The run as one PNG (matplotlib, Agg): what a saved or exported notebook shows."""
    buf = io.BytesIO()
    static_figure(view).savefig(buf, format="png")
    return buf.getvalue()


def static_figure(view: JobView) -> Any:
    """The charts of the run, legends under the axes (never on the lines), and the final states."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    panels = [
        ("loss and metrics", "epoch", _epoch_series(view)),
        ("CPU per task (%)", "s", _series(view, "cpu (%)")),
        ("memory per task (MiB)", "s", _series(view, "rss (MiB)")),
    ]
    gpu = _gpu_series(view, "util (%)")
    if gpu or _gpu_series(view, "mem_used (MiB)"):
        panels += [
            ("GPU utilization (%)", "s", gpu),
            ("GPU memory (MiB)", "s", _gpu_series(view, "mem_used (MiB)")),
        ]
    fig = Figure(figsize=(4 * len(panels), 3.8), dpi=80, layout="constrained")
    for i, (title, xlabel, series) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for j, name in enumerate(sorted(series)):
            xs, ys = series[name]
            color = PALETTE[j % len(PALETTE)]
            ax.plot(xs, ys, label=name, color=color, marker="o" if xlabel == "epoch" else None, markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        if series:  # under the axes, outside the plotted area
            ax.legend(
                fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=min(3, len(series)),
                frameon=False,
            )  # fmt: skip
    tasks = ", ".join(f"{t} {r.get('state', '')}" for t, r in sorted(view.tasks.items()))
    title = f"tfdist job {view.name}: {view.state} ({view.message})" + (f"\ntasks: {tasks}" if tasks else "")
    fig.suptitle(title, fontsize=10)
    return fig


class TextMonitor:
    """Without ipywidgets: one line per change of state or epoch."""

    def __init__(self, view: JobView):
        self._last = ""

    def refresh(self, view: JobView) -> None:
        line = f"{view.name}: {view.state} {view.phase} epoch {view.epoch}/{view.epochs or '?'}"
        if view.queue is not None:  # waiting to be admitted: where, and for about how long
            line = f"{view.name}: {view.message}"
        if line != self._last:
            print(line, flush=True)
            self._last = line


def make_monitor(view: JobView) -> WidgetMonitor | TextMonitor:
    """The live chart, or text lines where it cannot be drawn: the job is running by now, and a broken
    widget install (bqplot and ipywidgets that do not match) must not leave it unfollowed."""
    try:
        return WidgetMonitor(view)
    except ImportError:
        return TextMonitor(view)
    except Exception as exc:
        print(f"tfdist: the live chart cannot be drawn ({type(exc).__name__}: {exc}); following in text")
        return TextMonitor(view)
