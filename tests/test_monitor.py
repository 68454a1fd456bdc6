"""The monitor's pure parts: the event reducer, the widget refresh and the static picture."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tfdist.jobview import JobView
from tfdist.kernel_magics.monitor import WidgetMonitor, log_text, static_figure, static_png, tasks_html
from tfdist.sampler import GpuReader, TaskProcess, TaskSampler


def events(t0: float) -> list[dict]:
    evs: list[dict] = [{"type": "state", "state": "starting", "message": "starting tasks"}]
    for task in ("chief-0", "worker-0", "worker-1", "ps-0"):
        evs.append(
            {"type": "task", "task": task, "state": "running", "gpus": ["1"] if task == "worker-1" else []}
        )
    for i in range(1, 4):
        evs.append(
            {
                "type": "progress",
                "phase": "fit",
                "epoch": i,
                "epochs": 3,
                "logs": {"loss": 2.0 / i},
                "t": t0 + i,
            }
        )
        evs.append(
            {
                "type": "metrics",
                "t": t0 + i,
                "tasks": {
                    "worker-0": {"cpu (%)": 50.0 + i, "rss (MiB)": 300.0, "gpus": []},
                    "worker-1": {
                        "cpu (%)": 40.0,
                        "rss (MiB)": 310.0,
                        "gpus": [
                            {
                                "index": 1,
                                "util (%)": 90.0,
                                "mem_used (MiB)": 1000.0,
                                "mem_total (MiB)": 80000.0,
                            }
                        ],
                    },
                },
            }
        )
    evs.append({"type": "log", "lines": [["worker-0", "<img src=x onerror=alert(1)>"]]})
    evs.append({"type": "state", "state": "succeeded", "message": "finished", "t": t0 + 5})
    return evs


def test_reducer_folds_a_run():
    t0 = time.time()
    v = JobView(name="j", created=t0, total_tasks=4)
    for ev in events(t0):
        v.apply(ev)
    assert v.finished and v.state == "succeeded" and v.ended == t0 + 5
    assert v.epoch == 3 and [e["loss"] for e in v.epoch_logs] == [2.0, 1.0, 2.0 / 3]
    s = v.summary()
    assert s["gpu_util"] == [90.0] and s["tasks_total"] == 4
    again = JobView.from_dict(v.to_dict())  # what a late subscriber's snapshot rebuilds
    assert again.summary() == s and list(again.logs) == list(v.logs)


def test_widget_shows_curves_gpus_and_escapes_text():
    t0 = time.time()
    v = JobView(name="<b>j</b>", created=t0, total_tasks=4)
    m = WidgetMonitor(v)
    for ev in events(t0):
        v.apply(ev)
    m.refresh(v)
    assert m.epochs.value == 3 and m.epochs.max == 3
    assert m.startup.value == 3 and m.startup_label.value == "3/3 servers started"
    assert list(m.figs["curves"].marks[0].labels) == ["loss"]
    assert set(m.figs["cpu"].marks[0].labels) == {"worker-0", "worker-1"}
    assert list(m.figs["gpu"].marks[0].labels) == ["worker-1 gpu1"]
    assert m.gpu_box.layout.display == "flex"
    assert "&lt;b&gt;j&lt;/b&gt;" in m.header.value and "<b>j</b>" not in m.header.value.replace(
        "<b>tfdist", ""
    )
    assert "<img" not in tasks_html(v)
    assert "[worker-0] <img src=x onerror=alert(1)>" in log_text(v)  # a Textarea: shown as text
    assert m.logs.value == log_text(v)


def test_widget_survives_the_first_sample_of_every_series():
    """One point per line (the first epoch, the first tick) must render, not raise."""
    t0 = time.time()
    v = JobView(name="j", created=t0, total_tasks=4)
    m = WidgetMonitor(v)
    v.apply({"type": "progress", "phase": "fit", "epoch": 1, "epochs": 4, "logs": {"loss": 1.0}, "t": t0})
    v.apply(
        {
            "type": "metrics",
            "t": t0 + 1,
            "tasks": {"worker-0": {"cpu (%)": 5.0, "rss (MiB)": 1.0, "gpus": []}},
        }
    )
    m.refresh(v)
    assert list(m.figs["curves"].marks[0].labels) == ["loss"]
    v.apply({"type": "progress", "phase": "fit", "epoch": 2, "epochs": 4, "logs": {"loss": 0.5}, "t": t0 + 2})
    m.refresh(v)
    assert m.figs["curves"].marks[0].y.tolist() == [1.0, 0.5]


def test_static_png_is_a_picture():
    t0 = time.time()
    v = JobView(name="j", created=t0)
    for ev in events(t0):
        v.apply(ev)
    png = static_png(v)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_sampler_measures_each_task():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<5: pass"])
    try:
        s = TaskSampler(gpus=GpuReader())
        s.track(TaskProcess("worker-0", busy.pid))
        s.track(TaskProcess("ps-0", os.getpid()))
        time.sleep(1.0)
        rec = s.sample()
        assert rec["type"] == "metrics" and set(rec["tasks"]) == {"worker-0", "ps-0"}
        assert rec["tasks"]["worker-0"]["cpu (%)"] > 30  # a spinning process
        assert rec["tasks"]["ps-0"]["rss (MiB)"] > 10
    finally:
        busy.kill()
        busy.wait()
    s.forget("worker-0")
    assert set(s.sample()["tasks"]) == {"ps-0"}


def test_gpu_reader_without_a_driver_reports_none_not_errors():
    r = GpuReader()
    got = r.read(0)
    if r.available:  # a GPU machine: NVML's reading of the first GPU, not a skip
        assert isinstance(got["mem_total (MiB)"], (int, float)) and got["mem_total (MiB)"] > 0, got
        return
    assert got["util (%)"] is None


def test_monitor_names_its_job_in_a_css_class_and_legends_sit_under_the_charts():
    t0 = time.time()
    v = JobView(name="my-job", created=t0, total_tasks=4)
    m = WidgetMonitor(v)
    assert {"tfdist-monitor", "tfdist-job-my-job"} <= set(m.widget._dom_classes)
    for ev in events(t0):
        v.apply(ev)
    v.tasks["<i>worker-9</i>"] = {"state": "running", "restarts": 0, "gpus": []}
    v.metrics.append({"t": t0 + 4, "tasks": {"<i>worker-9</i>": {"cpu (%)": 1.0, "rss (MiB)": 1.0}}})
    m.refresh(v)
    for fig in m.figs.values():  # bqplot's own legend is drawn over the lines: never shown
        assert all(mark.display_legend is False for mark in fig.marks)
    cpu_legend = m.legends["cpu"].value
    assert "&lt;i&gt;worker-9&lt;/i&gt;" in cpu_legend and "<i>" not in cpu_legend
    # each name in the colour its line is drawn in
    names = list(m.figs["cpu"].marks[0].labels)
    colors = list(m.figs["cpu"].marks[0].colors)
    for i, n in enumerate(names):
        assert (
            f"color:{colors[i % len(colors)]}"
            in cpu_legend.split(n.replace("<", "&lt;").replace(">", "&gt;"))[0]
        )


def test_job_supplied_values_are_escaped_in_the_task_table():
    v = JobView(name="j", total_tasks=2)
    v.apply({"type": "task", "task": "worker-0", "state": "<b>odd</b>"})
    v.apply({"type": "task", "task": "ps-0", "state": "running", "gpus": ["<img src=x>"]})
    hostile_metrics = {
        "type": "metrics",
        "t": 1.0,
        "tasks": {
            "ps-0": {
                "cpu (%)": "<u>9</u>",
                "rss (MiB)": float("nan"),
                "gpus": [{"index": "<s>0</s>", "util (%)": 5.0, "mem_used (MiB)": "<x>"}],
            }
        },
    }
    # mistyped values never get in through an event (tfdist.events refuses them) ...
    assert not v.apply({"type": "task", "task": "worker-0", "state": "x", "restarts": "<script>x</script>"})
    assert not v.apply(hostile_metrics) and v.dropped == 2
    # ... but a view read back from an older job's state.json is not checked: the table escapes anyway
    v.tasks["worker-0"]["restarts"] = "<script>x</script>"
    v.metrics.append({"t": 1.0, "tasks": hostile_metrics["tasks"]})
    out = tasks_html(v)
    for raw in ("<b>", "<script>", "<img", "<s>", "<u>", "<x>"):
        assert raw not in out, raw
    assert "&lt;script&gt;" in out and "gpu&lt;s&gt;0&lt;/s&gt; 5% -" in out


def test_a_finished_job_shows_no_live_task_in_its_table():
    v = JobView(name="j", total_tasks=2)
    v.apply({"type": "task", "task": "chief-0", "state": "running"})
    v.apply({"type": "task", "task": "ps-0", "state": "running"})
    v.apply({"type": "metrics", "t": 1.0, "tasks": {"chief-0": {"cpu (%)": 0.0, "rss (MiB)": 0.0}}})
    v.apply(
        {
            "type": "state",
            "state": "stopped",
            "reason": "interrupted",
            "message": "interrupted from the notebook",
        }
    )
    out = tasks_html(v)
    assert "running" not in out and out.count(">stopped<") == 2 and "0 MiB" not in out
    m = WidgetMonitor(v)
    m.note = "looks stuck"
    m.refresh(v)
    assert "interrupted from the notebook" in m.header.value
    assert "looks stuck" not in m.header.value  # a warning about a running job, gone once it ended


def test_png_legends_never_cover_the_plotted_area():
    t0 = time.time()
    v = JobView(name="j", created=t0)
    for ev in events(t0):
        v.apply(ev)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = static_figure(v)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    with_legend = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert len(with_legend) == 5  # curves, CPU, memory, GPU util, GPU memory
    for ax in with_legend:
        box = ax.get_legend().get_window_extent(renderer)
        assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
    assert "worker-1 running" in fig._suptitle.get_text() or "tasks:" in fig._suptitle.get_text()


def test_widget_close_leaves_none_of_its_widgets_open():
    from ipywidgets.widgets.widget import _instances

    v = JobView(name="j", total_tasks=2)
    m = WidgetMonitor(v)
    m.refresh(v)
    ids = {m.widget.model_id, m.figs["cpu"].model_id, m.figs["cpu"].marks[0].model_id, m.header.model_id}
    before = set(_instances)
    m.close()
    assert not ids & set(_instances)
    assert len(before - set(_instances)) > 30  # figures, marks, scales, axes, layouts, styles


def test_a_mig_instance_shows_its_memory_and_no_made_up_utilization():
    """NVML has no utilization for a MIG instance: the row says so, and its memory still gets a chart."""
    t0 = time.time()
    mig = "MIG-5a7c1a3e-0b1f-5e63-9d6a-0a1b2c3d4e5f"
    v = JobView(name="j", created=t0, total_tasks=1)
    m = WidgetMonitor(v)
    v.apply({"type": "task", "task": "worker-0", "state": "running", "gpus": [mig]})
    gpu = {
        "index": 0,
        "uuid": mig,
        "mig_profile": "1g.10gb",
        "util (%)": None,
        "util_missing": "mig",
        "mem_used (MiB)": 1200.0,
        "mem_total (MiB)": 9728.0,
    }
    for i in (
        1,
        2,
    ):  # as the supervisor's sampler writes them (appended: the event types are not this test's)
        v.metrics.append(
            {"t": t0 + i, "tasks": {"worker-0": {"cpu (%)": 5.0, "rss (MiB)": 1.0, "gpus": [gpu]}}}
        )
    m.refresh(v)
    assert "gpu0 MIG 1g.10gb n/a (MIG) 1200MiB" in tasks_html(v)
    assert m.gpu_box.layout.display == "flex"
    assert list(m.figs["gpumem"].marks[0].labels) == ["worker-0 gpu0 MIG 1g.10gb"]
    assert list(m.figs["gpu"].marks[0].labels) == []  # no utilization line, not a line at 0
    assert v.summary()["gpu_util"] == []
    assert len(static_figure(v).axes) == 5  # the memory panel is drawn too
