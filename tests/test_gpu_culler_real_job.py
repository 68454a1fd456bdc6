"""The GPU-idle culler fed by a real job's GPU samples (issue 27): no hard-coded utilization anywhere.

A real local `%%tfdist` job (its supervisor and TensorFlow PS/worker tasks, started by `LocalBackend` in the
user's state directory as the kernel starts it) samples its worker's GPU through NVML, here the named double
tests/doubles/fake_pynvml reporting load on that GPU. Its samples reach the user's notebook server (the
server's backend lists the job with its GPU utilization), are pushed to the hub's GPU admin service in the
server's report, and keep the culler from stopping the server; once the job ends and the GPU stays idle
past the threshold, the server is warned and stopped.

On the local backend a job's GPUs are its server's, so the server's own tracker would see the load too; here
the job is given a GPU the server's tracker does not watch (as on Kubernetes, where a job's GPUs are in its
own pods), so only the job's samples can keep the server alive. The rule culls during jobs
(``cull_during_jobs: true``): a running job alone does not protect the server, its measured GPU use does.
A second server without a job, on the same rule, is culled meanwhile: the rule does cull.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.hub_fixtures import DOUBLES, RunningHub, start_hub
from tests.test_hub_gpu_culler import admin_session, hub_extra, page_rows, server_get, spawn
from tests.test_hub_gpu_culler import write_nvml as write_culler_nvml
from tfdist.backends.base import Launch
from tfdist.backends.local import LocalBackend
from tfdist.jobspec import JobSpec
from tfdist.payload import pack

H100 = "NVIDIA H100 80GB HBM3"
NAMES = [H100] * 3  # GPU 0: jobuser's server, GPU 1: control's server, GPU 2: the job's worker
PROFILES = """
gpu_models:
  h100: {display_name: "NVIDIA H100 80GB", nvml_name: "NVIDIA H100.*"}
profiles:
  - slug: gpu
    display_name: "GPU"
    groups: ["*"]
    cpu: {min: 0.5, max: 2, default: 0.5}
    memory_gib: {min: 0.5, max: 4, default: 1}
    gpus: {min: 0, max: 1, default: 1}
    gpu_models: [h100]
    images: [local]
gpu_admin:
  culling:
    check_interval_s: 1
    default: {idle_below_percent: 10, idle_minutes: 0.2, warn_minutes: 0.1, cull_during_jobs: true}
"""
GPU = {"profile": "gpu", "cpu": 0.5, "memory": 1, "gpus": 1, "gpu_model": "h100", "image": "local"}
IDLE_LIMIT_S = 12.0


def write_nvml(path: Path, job_gpu_util: int) -> None:
    """Only GPU 2, the job's worker's, is loaded (the servers' own GPUs stay idle)."""
    write_culler_nvml(path, {"GPU-fake-0002": job_gpu_util})


@pytest.fixture
def hub(tmp_path: Path) -> Any:
    repo = str(Path(__file__).resolve().parent.parent)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, old) if p)
    nvml = tmp_path / "nvml.json"
    write_nvml(nvml, 80)
    h = start_hub(tmp_path / "hub", profiles_yaml=PROFILES, fake_gpus=NAMES, extra=hub_extra(nvml))
    h.nvml = nvml  # type: ignore[attr-defined]
    try:
        yield h
    finally:
        h.stop()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def wait_for(what: str, check: Any, timeout: float, hub: RunningHub) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{hub.log_tail()}")


def test_a_real_jobs_gpu_samples_keep_its_server_until_the_job_ends(
    hub: RunningHub, tmp_path: Path, monkeypatch
) -> None:
    from tfdist.spawner.local import safe_dirname

    nvml: Path = hub.nvml  # type: ignore[attr-defined]
    jobs_dir = hub.state_dir / "users" / safe_dirname("jobuser") / ".tfdist" / "jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    done = tmp_path / "job-done"
    code = f"import os, time\nwhile not os.path.exists({str(done)!r}):\n    time.sleep(0.2)\n"
    # the supervisor's NVML (it samples its tasks' GPUs) is the double, as the servers' is
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(DOUBLES / "fake_pynvml"), os.environ["PYTHONPATH"]])
    )
    monkeypatch.setenv("TFDIST_FAKE_NVML", str(nvml))
    loop = asyncio.new_event_loop()
    backend = LocalBackend(str(jobs_dir))
    spec = JobSpec(name="train1", user="jobuser", workers=1, ps=1, gpus_per_worker=1)
    try:
        loop.run_until_complete(backend.submit(spec, pack(code, [], {}), Launch(gpus=["2"])))

        def job_samples() -> list[float]:
            view = loop.run_until_complete(backend.status("train1"))
            assert view.state not in ("failed", "stopped", "succeeded"), view.message
            return view.summary()["gpu_util"] if view.state == "running" else []

        assert wait_for("the job's worker samples its GPU", job_samples, 240, hub) == [80.0]

        spawn(hub, "jobuser", GPU)
        spawn(hub, "control", GPU)
        started = time.monotonic()
        report = wait_for(
            "the job reaches the server's report",
            lambda: server_get(hub, "jobuser", "activity")["jobs_running"],
            60,
            hub,
        )
        assert report == [{"name": "train1", "state": "running", "gpu_util": [80.0]}]
        assert [g["uuid"] for g in server_get(hub, "jobuser", "activity")["gpus"]] == ["GPU-fake-0000"]
        admin = admin_session(hub)
        row = wait_for(
            "the service has the job",
            lambda: (r := page_rows(admin, hub).get("jobuser/")) and r["jobs"] and r,
            30,
            hub,
        )
        assert row["jobs"] == [{"name": "train1", "state": "running", "gpu_util": [80.0]}]
        assert row["util"] == [0.0]  # the server's own GPU is idle: the job's samples are what count

        # the control server (same rule, no job) is warned and stopped; jobuser is left alone all along.
        # jobuser's own GPU has been idle since before control started: without the job's samples it would
        # have been culled first, so control's cull plus a few of the service's checks is the proof
        wait_for("control is culled", lambda: "" not in hub.servers("control"), 90, hub)
        while time.monotonic() - started < IDLE_LIMIT_S + 15:
            time.sleep(1)
        assert hub.servers("jobuser")[""]["ready"]
        assert server_get(hub, "jobuser", "notice")["notice"] is None
        assert page_rows(admin, hub)["jobuser/"]["action"] in ("active", "job-running"), hub.log_tail()

        # the job ends and its GPU goes idle: past the threshold and the warning, the server is stopped
        write_nvml(nvml, 0)
        done.write_text("")
        wait_for(
            "the job ends",
            lambda: loop.run_until_complete(backend.status("train1")).state == "succeeded",
            120,
            hub,
        )
        notice = wait_for(
            "jobuser is warned",
            lambda: server_get(hub, "jobuser", "notice")["notice"],
            IDLE_LIMIT_S + 30,
            hub,
        )
        assert "will stop this server" in notice["message"]
        wait_for("jobuser is culled", lambda: "" not in hub.servers("jobuser"), 60, hub)
        assert time.time() >= notice["cull_at"] - 1.5  # the whole warning time
    finally:
        done.write_text("")
        with contextlib.suppress(Exception):
            loop.run_until_complete(backend.stop("train1"))
        loop.run_until_complete(backend.close())
        loop.close()
