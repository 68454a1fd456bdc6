"""The live monitor in the cell: job state, start-up and epoch progress, loss curves, per-task CPU and
memory, per-GPU utilization and memory, and a log tail; plus a static PNG when the run ends, so a saved
or exported notebook still shows what happened.

Built from ipywidgets + bqplot. `refresh(view)` is called about once a second by the waiting cell with
the job's whole state (a JobView); it sends one batch of widget updates per call (hold_sync).
"""

from __future__ import annotations

import html
import io
import time
from typing import Any

from ..jobview import JobView

STATE_COLORS = {"succeeded": "#2e7d32", "failed": "#c62828", "stopped": "#6d4c41", "running": "#1565c0"}


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


def _gpu_series(view: JobView, key: str) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    t0 = view.created
    for m in view.metrics:
        for task, rec in m["tasks"].items():
            for g in rec.get("gpus", []):
                v = g.get(key)
                if v is None:
                    continue
                xs, ys = out.setdefault(f"{task} gpu{g['index']}", ([], []))
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


def header_html(view: JobView) -> str:
    color = STATE_COLORS.get(view.state, "#555")
    took = (view.ended or time.time()) - view.created
    return (
        f"<b>tfdist job {html.escape(view.name)}</b> &nbsp; "
        f"<span style='color:{color};font-weight:bold'>{html.escape(view.state)}</span>"
        f" &nbsp; {html.escape(view.message or '')} &nbsp; <small>{took:.0f}s</small>"
    )


def tasks_html(view: JobView) -> str:
    last = view.metrics[-1]["tasks"] if view.metrics else {}
    rows = []
    for name, t in sorted(view.tasks.items()):
        m = last.get(name, {})
        cpu = m.get("cpu (%)")
        rss = m.get("rss (MiB)")
        gpus = ", ".join(
            f"gpu{g['index']} {g['util (%)']:.0f}% {g['mem_used (MiB)']:.0f}MiB"
            for g in m.get("gpus", [])
            if g.get("util (%)") is not None
        ) or html.escape(",".join(t.get("gpus") or []) or "-")
        rows.append(
            "<tr>"
            + "".join(
                f"<td style='padding:0 8px'>{c}</td>"
                for c in (
                    html.escape(name),
                    html.escape(str(t.get("state", ""))),
                    str(t.get("restarts", 0)),
                    "-" if cpu is None else f"{cpu:.0f}%",
                    "-" if rss is None else f"{rss:.0f} MiB",
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
        self.figs["curves"] = self._figure("loss and metrics", "epoch")
        self.figs["cpu"] = self._figure("CPU per task (%)", "s")
        self.figs["rss"] = self._figure("memory per task (MiB)", "s")
        self.figs["gpu"] = self._figure("GPU utilization (%)", "s")
        self.figs["gpumem"] = self._figure("GPU memory (MiB)", "s")
        self.gpu_box = w.HBox([self.figs["gpu"], self.figs["gpumem"]])
        self.gpu_box.layout.display = "none"
        self.widget = w.VBox(
            [
                self.header,
                w.HBox([self.startup, self.startup_label]),
                w.HBox([self.epochs, self.epochs_label]),
                w.HBox([self.figs["curves"], self.figs["cpu"], self.figs["rss"]]),
                self.gpu_box,
                self.table,
                w.Accordion(children=[self.logs], titles=("logs (all tasks; full logs: %tfdist logs NAME)",)),
            ]
        )
        self.widget.add_class("tfdist-monitor")

    def _figure(self, title: str, xlabel: str) -> Any:
        bq = self._bq
        xs, ys = bq.LinearScale(), bq.LinearScale()
        line = bq.Lines(x=[], y=[], scales={"x": xs, "y": ys}, display_legend=True, labels=[])
        fig = bq.Figure(
            marks=[line],
            axes=[bq.Axis(scale=xs, label=xlabel), bq.Axis(scale=ys, orientation="vertical")],
            title=title,
            legend_location="top-right",
            layout={"width": "330px", "height": "240px"},
            fig_margin={"top": 40, "bottom": 40, "left": 50, "right": 10},
        )
        return fig

    def _set_lines(self, fig: Any, series: dict[str, tuple[list[float], list[float]]]) -> None:
        line = fig.marks[0]
        names = sorted(series)
        if not names:
            return
        # at least 2 points per line: bqplot squeezes arrays, and a (k, 1) array would lose its meaning
        n = max(2, max(len(series[k][0]) for k in names))
        xs = [series[k][0] + [series[k][0][-1]] * (n - len(series[k][0])) for k in names]
        ys = [series[k][1] + [series[k][1][-1]] * (n - len(series[k][1])) for k in names]
        with line.hold_sync():
            line.x, line.y, line.labels = xs, ys, names

    def refresh(self, view: JobView) -> None:
        self.header.value = header_html(view)
        servers = max(1, view.total_tasks - 1)
        started = sum(
            1
            for n, t in view.tasks.items()
            if n != "chief-0" and t.get("state") in ("running", "exited", "restarting")
        )
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
        self._set_lines(self.figs["curves"], _epoch_series(view))
        self._set_lines(self.figs["cpu"], _series(view, "cpu (%)"))
        self._set_lines(self.figs["rss"], _series(view, "rss (MiB)"))
        gpu = _gpu_series(view, "util (%)")
        if gpu:
            self.gpu_box.layout.display = "flex"
            self._set_lines(self.figs["gpu"], gpu)
            self._set_lines(self.figs["gpumem"], _gpu_series(view, "mem_used (MiB)"))
        self.table.value = tasks_html(view)
        self.logs.value = log_text(view)
        if view.finished:
            self.startup.bar_style = "success" if view.state == "succeeded" else "danger"


def static_png(view: JobView) -> bytes:
    """The run as one PNG (matplotlib, Agg): what a saved or exported notebook shows."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    panels = [
        ("loss and metrics", "epoch", _epoch_series(view)),
        ("CPU per task (%)", "s", _series(view, "cpu (%)")),
        ("memory per task (MiB)", "s", _series(view, "rss (MiB)")),
    ]
    gpu = _gpu_series(view, "util (%)")
    if gpu:
        panels += [
            ("GPU utilization (%)", "s", gpu),
            ("GPU memory (MiB)", "s", _gpu_series(view, "mem_used (MiB)")),
        ]
    fig = Figure(figsize=(4 * len(panels), 3.2), dpi=80)
    for i, (title, xlabel, series) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for name in sorted(series):
            xs, ys = series[name]
            ax.plot(xs, ys, label=name, marker="o" if xlabel == "epoch" else None, markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        if series:
            ax.legend(fontsize=7)
    fig.suptitle(f"tfdist job {view.name}: {view.state} ({view.message})", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


class TextMonitor:
    """Without ipywidgets: one line per change of state or epoch."""

    def __init__(self, view: JobView):
        self._last = ""

    def refresh(self, view: JobView) -> None:
        line = f"{view.name}: {view.state} {view.phase} epoch {view.epoch}/{view.epochs or '?'}"
        if line != self._last:
            print(line, flush=True)
            self._last = line


def make_monitor(view: JobView) -> WidgetMonitor | TextMonitor:
    try:
        return WidgetMonitor(view)
    except ImportError:
        return TextMonitor(view)
