"""What the jobs panel reads first (issue 15): a finished job's stored charts, and its logs without
TensorFlow's start-up noise (the files keep it), through a real Jupyter server with the extension.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tfdist.jobspec import JobSpec
from tfdist.labserver.logfilter import readable

pytest_plugins = ["pytest_jupyter.jupyter_server"]

ME = "alice"
# the first lines of a real chief log of the example notebook, and of a task's stderr on a GPU-less machine
WARNING = (
    "/venv/lib/python3.11/site-packages/tensorflow/python/data/ops/dataset_ops.py:463: UserWarning: To make "
    "it possible to preserve tf.data options across serialization boundaries, their implementation has moved"
)
NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796040651.195373   23365 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to "
    "use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the "
    "appropriate compiler flags.",
    "E0000 00:00:1796040651.2 23365 cuda_executor.cc:1228] failed call to cuInit: UNKNOWN ERROR (303)",
    "2026-11-30 12:00:01.123456: I tensorflow/core/util/port.cc:153] oneDNN custom operations are on.",
    WARNING,
    '  warnings.warn("To make it possible to preserve tf.data options across "',
]
JOB_LINES = [
    "Epoch 1/8",
    "40/40 - 12s - loss: 1.8286 - accuracy: 0.5477 - 12s/epoch - 293ms/step",
    "  indented job output after a kept line stays",
    "Traceback (most recent call last):",
    '  File "<cell>", line 3, in <module>',
    "ValueError: a user's own error is never hidden",
    "/home/u/train.py:12: RuntimeWarning: the user's own warning is TensorFlow-free but still a warning",
]


def test_readable_drops_tensorflow_start_up_noise_and_keeps_the_job() -> None:
    kept, hidden = readable(NOISE + JOB_LINES)
    assert kept == JOB_LINES[:-1]
    assert hidden == len(NOISE) + 1
    kept, hidden = readable(JOB_LINES[:-1])
    assert kept == JOB_LINES[:-1] and hidden == 0
    # a warning's own indented source lines go with it, but no further than its few lines
    kept, _ = readable([WARNING, "  line 1", "  line 2", "  line 3", "  line 4", "  fifth: kept"])
    assert kept == ["  fifth: kept"]
    assert readable([]) == ([], 0)


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> str:
    d = tmp_path / "jobs"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("TFDIST_STATE_DIR", str(d))
    monkeypatch.setenv("TFDIST_USER", ME)
    monkeypatch.setenv("TFDIST_BACKEND", "local")
    return str(d)


@pytest.fixture
def jp_server_config(state_dir):
    return {"ServerApp": {"jpserver_extensions": {"tfdist": True}}}


def finished_job(state_dir: str, name: str, metrics: list | None) -> None:
    """A job the supervisor has left: spec, state.json with its stored history, full log files."""
    d = os.path.join(state_dir, name)
    os.makedirs(os.path.join(d, "logs"))
    spec = JobSpec(name=name, user=ME, workers=1, ps=1)
    with open(os.path.join(d, "spec.json"), "w") as f:
        f.write(spec.to_json())
    now = time.time()
    state = {
        "state": "succeeded",
        "message": "finished",
        "created": now - 60,
        "ended": now - 1,
        "tasks_total": 3,
        "tasks": {
            t: {"state": "exited-ok", "restarts": 0, "gpus": []} for t in ("chief-0", "ps-0", "worker-0")
        },
    }
    if metrics is not None:
        state["metrics"] = metrics
    with open(os.path.join(d, "state.json"), "w") as f:
        json.dump(state, f)
    with open(os.path.join(d, "logs", "chief-0.log"), "w") as f:
        f.write("\n".join(NOISE + JOB_LINES) + "\n")


def sample(t: float, cpu: float) -> dict:
    return {"t": t, "tasks": {"worker-0": {"cpu (%)": cpu, "rss (MiB)": 300.0, "gpus": []}}}


async def _finished_job_view(jp_fetch, state_dir):
    stored = [sample(i, 10.0 * i) for i in range(120)]
    finished_job(state_dir, "done", [*stored, "junk", {"t": 1}])  # malformed entries are ignored
    finished_job(state_dir, "old", None)  # written before histories were kept
    r = await jp_fetch("tfdist", "api", "jobs", "done")
    view = json.loads(r.body)
    assert view["state"] == "succeeded"
    assert view["metrics"] == stored  # the panel's charts, after the supervisor is gone
    assert view["logs"]["chief-0"] == JOB_LINES[:-1]
    assert view["logs_hidden"] == len(NOISE) + 1
    old = json.loads((await jp_fetch("tfdist", "api", "jobs", "old")).body)
    assert old["metrics"] == [] and old["state"] == "succeeded"
    listed = json.loads((await jp_fetch("tfdist", "api", "jobs")).body)
    assert sorted(j["name"] for j in listed["jobs"]) == ["done", "old"]
    # the full log is still all there for %tfdist logs
    with open(os.path.join(state_dir, "done", "logs", "chief-0.log")) as f:
        assert f.read().count("\n") == len(NOISE) + len(JOB_LINES)


def test_finished_job_view_has_charts_and_readable_logs(jp_fetch, state_dir, jp_asyncio_loop) -> None:
    jp_asyncio_loop.run_until_complete(_finished_job_view(jp_fetch, state_dir))
