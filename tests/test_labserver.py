"""The jobs panel's server extension: authentication, ownership, a real stop, the shared GPU sampler.

Given a Jupyter server with the extension enabled (pytest-jupyter) and a TFDIST_STATE_DIR holding
jobs of this user and of another one, written as the local backend writes them. The GPU routes read the
named NVML double (tests/doubles/fake_pynvml) where this machine has no GPU, so their rows are checked.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from tornado.httpclient import HTTPClientError

from tests.kernels import wait_gone
from tfdist.backends.base import Launch
from tfdist.backends.local import LocalBackend
from tfdist.errors import NoSuchJob
from tfdist.jobspec import JobSpec
from tfdist.payload import pack
from tfdist.procid import ProcessId

pytest_plugins = ["pytest_jupyter.jupyter_server"]

ME = "alice"
OTHER = "mallory"
H100 = "NVIDIA H100 80GB HBM3"
MIG = "MIG-5a7c1a3e-0b1f-5e63-9d6a-0a1b2c3d4e5f"


def write_nvml(path, util0: int, util1: int) -> None:
    """Two whole GPUs and a GPU in MIG mode with one 1g.10gb instance (memory, no utilization)."""
    gpus = [
        {"name": H100, "uuid": "GPU-lab-0", "util": util0, "mem_used_mib": 1000.0, "mig_mode": 0},
        {"name": H100, "uuid": "GPU-lab-1", "util": util1, "mem_used_mib": 2000.0},
        {
            "name": "NVIDIA A100-SXM4-80GB",
            "uuid": "GPU-lab-2",
            "mig": [{"profile": "1g.10gb", "uuid": MIG, "memory_total_mib": 9728, "mem_used_mib": 512.0}],
        },
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)


@pytest.fixture
def fake_nvml(tmp_path, monkeypatch):
    """This (the lab server's) process's `pynvml` is the double; the GPUs are the file's."""
    import importlib.util

    from tests.test_mig_local import DOUBLES

    path = tmp_path / "nvml.json"
    write_nvml(path, 35, 0)
    monkeypatch.setenv("TFDIST_FAKE_NVML", str(path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = importlib.util.spec_from_file_location("pynvml", DOUBLES / "fake_pynvml" / "pynvml.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    return path


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
    """Enable the extension the way the installed jupyter-config file does."""
    return {"ServerApp": {"jpserver_extensions": {"tfdist": True}}}


def fake_job(state_dir: str, name: str, user: str, state: str = "running", pid: int | None = None) -> str:
    """A job directory as LocalBackend.submit leaves it (spec.json, state.json, logs/)."""
    d = os.path.join(state_dir, name)
    os.makedirs(os.path.join(d, "logs"))
    spec = JobSpec(name=name, user=user, workers=1, ps=1)
    with open(os.path.join(d, "spec.json"), "w") as f:
        f.write(spec.to_json())
    with open(os.path.join(d, "state.json"), "w") as f:
        json.dump({"state": state, "message": "", "created": time.time(), "tasks_total": spec.task_count}, f)
    with open(os.path.join(d, "logs", "worker-0.log"), "w") as f:
        f.write("hello from worker\n<img src=x onerror=alert(1)>\n")
    if pid is not None:
        with open(os.path.join(d, "supervisor.pid"), "w") as f:
            f.write(ProcessId.current().dumps() if pid == os.getpid() else ProcessId.of(pid).dumps())
    return d


async def get_json(jp_fetch, *path: str, method: str = "GET") -> dict:
    kw = {"method": method, "body": b""} if method == "POST" else {}
    r = await jp_fetch("tfdist", "api", *path, **kw)
    return json.loads(r.body)


async def _unauthenticated_requests_are_refused(jp_fetch, state_dir):
    fake_job(state_dir, "mine", ME)
    for path, method in [("jobs", "GET"), ("jobs/mine", "GET"), ("gpus", "GET"), ("jobs/mine/stop", "POST")]:
        with pytest.raises(HTTPClientError) as e:
            await jp_fetch(
                "tfdist",
                "api",
                *path.split("/"),
                method=method,
                body=b"" if method == "POST" else None,
                headers={"Authorization": ""},
                follow_redirects=False,
            )
        assert e.value.code in (302, 403), (path, e.value.code)
    # and with the token the same routes answer
    assert [j["name"] for j in (await get_json(jp_fetch, "jobs"))["jobs"]] == ["mine"]


async def _another_users_job_is_invisible_and_cannot_be_stopped(jp_fetch, state_dir):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        fake_job(state_dir, "mine", ME)
        fake_job(state_dir, "theirs", OTHER, pid=sleeper.pid)
        jobs = await get_json(jp_fetch, "jobs")
        assert jobs["user"] == ME
        assert [j["name"] for j in jobs["jobs"]] == ["mine"]
        view = await get_json(jp_fetch, "jobs", "mine")
        assert view["user"] == ME and view["logs"]["worker-0"][-1] == "<img src=x onerror=alert(1)>"
        for path, method in [
            (("jobs", "theirs"), "GET"),
            (("jobs", "theirs", "stop"), "POST"),
            (("jobs", "nosuch"), "GET"),
            (("jobs", ".."), "GET"),
        ]:
            with pytest.raises(HTTPClientError) as e:
                await get_json(jp_fetch, *path, method=method)
            assert e.value.code == 404, path
        assert sleeper.poll() is None, "another user's job process was touched"
        assert psutil.Process(sleeper.pid).status() != psutil.STATUS_ZOMBIE
    finally:
        sleeper.kill()
        sleeper.wait()


async def _gpus_report_this_server_from_one_shared_sampler(jp_fetch, jp_serverapp, nvml):
    first = await get_json(jp_fetch, "gpus")
    assert first["cpu_count"] >= 1 and first["gpu_count"] == 3
    assert [g["name"] for g in first["gpus"]] == [H100, H100, "NVIDIA A100-SXM4-80GB MIG 1g.10gb"]
    assert first["samples"] and "cpu (%)" in first["samples"][-1]
    gpus = first["samples"][-1]["gpus"]
    assert [g["util (%)"] for g in gpus] == [35.0, 0.0, None]  # the instance: not measurable, not 0
    assert gpus[2]["util_missing"] == "mig" and gpus[2]["uuid"] == MIG
    assert [g["mem_used (MiB)"] for g in gpus] == [1000.0, 2000.0, 512.0]
    write_nvml(nvml, 0, 90)
    await asyncio.sleep(2.2)
    second = await get_json(jp_fetch, "gpus")
    sampler = jp_serverapp.web_app.settings["tfdist"].sampler
    assert sampler.running
    assert 2 <= len(second["samples"]) - len(first["samples"]) <= 4, "sampled at ~1 Hz, not per request"
    assert [g["util (%)"] for g in second["samples"][-1]["gpus"]] == [0.0, 90.0, None]  # read live
    sampler.stop()


async def _stop_ends_every_process_of_the_job(jp_fetch, state_dir):
    name = "labstop"
    submitter = LocalBackend(state_dir)
    spec = JobSpec(name=name, user=ME, workers=1, ps=1)
    payload = pack("import time\ntime.sleep(300)\n", [], {})
    await submitter.submit(spec, payload, Launch(env={"TF_CPP_MIN_LOG_LEVEL": "3"}))
    try:
        deadline = time.time() + 180
        view = await get_json(jp_fetch, "jobs", name)
        while view["state"] != "running" and time.time() < deadline:
            assert view["state"] not in ("failed", "succeeded", "stopped"), view["message"]
            await asyncio.sleep(1)
            view = await get_json(jp_fetch, "jobs", name)
        assert view["state"] == "running", view
        with open(os.path.join(state_dir, name, "supervisor.pid")) as f:
            sup = psutil.Process(json.load(f)["pid"])
        pids = [sup.pid] + [c.pid for c in sup.children(recursive=True)]
        assert len(pids) >= 2
        listed = await get_json(jp_fetch, "jobs")
        assert [j["state"] for j in listed["jobs"] if j["name"] == name] == ["running"]

        result = await get_json(jp_fetch, "jobs", name, "stop", method="POST")
        assert result["stopped"] is True and result["state"] == "stopped", result
        proc = submitter._lifelines.get(name)
        if proc is not None:  # reap the supervisor we started (our end of its lifeline)
            proc.wait(10)
            submitter._release(name)
        assert wait_gone(pids, 15) == []
        assert (await get_json(jp_fetch, "jobs", name))["state"] == "stopped"
    finally:
        await submitter.close()


async def _detached_jobs(jp_fetch, state_dir):
    """The panel's rows and views say which jobs are detached and where their results are; a detached job
    (no kernel holds it) is stopped from the panel and leaves no process."""
    ended = time.time() - 60
    for name, user, extra in (
        ("waiting", ME, {"retention_s": 3600}),
        ("taken", ME, {"retention_s": 3600, "taken": ended + 5}),
        ("theirs", OTHER, {"retention_s": 3600}),
    ):
        d = fake_job(state_dir, name, user, state="succeeded")
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump({"state": "succeeded", "message": "finished", "created": ended - 30, "ended": ended}, f)
        with open(os.path.join(d, "detached.json"), "w") as f:
            json.dump({"uid": os.getuid(), "user": user, **extra}, f)
        if "taken" not in extra:
            with open(os.path.join(d, "result.bin"), "wb") as f:
                f.write(b"results")
    fake_job(state_dir, "plain", ME, state="succeeded")
    submitter = LocalBackend(state_dir)
    spec = JobSpec(name="away", user=ME, workers=1, ps=1, extra={"detach": True})
    payload = pack("import time\ntime.sleep(300)\n", [], {})
    await submitter.submit(spec, payload, Launch(env={"TF_CPP_MIN_LOG_LEVEL": "3"}))
    try:
        assert not submitter._lifelines, "a detached job has no lifeline to its kernel"
        jobs = {j["name"]: j for j in (await get_json(jp_fetch, "jobs"))["jobs"]}
        assert sorted(jobs) == ["away", "plain", "taken", "waiting"]  # not another user's
        assert (jobs["away"]["detached"], jobs["away"]["results"]) == (True, "pending")
        assert (jobs["waiting"]["results"], jobs["waiting"]["kept_until"]) == ("waiting", ended + 3600)
        assert jobs["taken"]["results"] == "taken" and jobs["plain"]["detached"] is False
        view = await get_json(jp_fetch, "jobs", "waiting")
        assert view["summary"]["detached"] and view["summary"]["results"] == "waiting"
        with pytest.raises(HTTPClientError) as e:
            await get_json(jp_fetch, "jobs", "theirs")
        assert e.value.code == 404

        deadline = time.time() + 180
        while (await get_json(jp_fetch, "jobs", "away"))["state"] != "running" and time.time() < deadline:
            await asyncio.sleep(1)
        assert (await get_json(jp_fetch, "jobs", "away"))["state"] == "running"  # what "stop" is tried on
        with open(os.path.join(state_dir, "away", "supervisor.pid")) as f:
            sup = psutil.Process(json.load(f)["pid"])
        pids = [sup.pid] + [c.pid for c in sup.children(recursive=True)]
        result = await get_json(jp_fetch, "jobs", "away", "stop", method="POST")
        assert result["stopped"] is True and result["state"] == "stopped", result
        assert wait_gone(pids, 15) == []
        view = await get_json(jp_fetch, "jobs", "away")
        assert view["state"] == "stopped" and view["summary"]["results"] == "none"
    finally:
        await submitter.stop("away")


# pytest-jupyter serves on its own loop (jp_asyncio_loop); pytest-asyncio (asyncio_mode=auto) would run an
# async test on another one, where the server never answers. So the tests are sync and drive that loop.


def test_unauthenticated_requests_are_refused(jp_fetch, state_dir, jp_asyncio_loop) -> None:
    jp_asyncio_loop.run_until_complete(_unauthenticated_requests_are_refused(jp_fetch, state_dir))


def test_another_users_job_is_invisible_and_cannot_be_stopped(jp_fetch, state_dir, jp_asyncio_loop) -> None:
    jp_asyncio_loop.run_until_complete(
        _another_users_job_is_invisible_and_cannot_be_stopped(jp_fetch, state_dir)
    )


def test_gpus_report_this_server_from_one_shared_sampler(
    fake_nvml, jp_fetch, jp_serverapp, jp_asyncio_loop
) -> None:
    jp_asyncio_loop.run_until_complete(
        _gpus_report_this_server_from_one_shared_sampler(jp_fetch, jp_serverapp, fake_nvml)
    )


@pytest.mark.slow
def test_stop_ends_every_process_of_the_job(jp_fetch, state_dir, jp_asyncio_loop) -> None:
    jp_asyncio_loop.run_until_complete(_stop_ends_every_process_of_the_job(jp_fetch, state_dir))


def test_detached_jobs_are_shown_with_their_results_and_stop(jp_fetch, state_dir, jp_asyncio_loop) -> None:
    jp_asyncio_loop.run_until_complete(_detached_jobs(jp_fetch, state_dir))


def test_shared_reads_coalesce_tabs_and_do_not_cache_errors():
    """Three tabs asking at once cost one backend call; a failure is not remembered."""
    import asyncio as aio

    from tfdist.labserver.handlers import SharedReads

    calls = {"n": 0}

    async def read():
        calls["n"] += 1
        await aio.sleep(0.05)
        return {"state": "running"}

    async def fail():
        calls["n"] += 1
        raise NoSuchJob("gone")

    async def scenario():
        reads = SharedReads(ttl=0.5)
        got = await aio.gather(*(reads.get("job", read) for _ in range(3)))
        assert got == [{"state": "running"}] * 3 and calls["n"] == 1
        await aio.sleep(0.6)
        await reads.get("job", read)
        assert calls["n"] == 2  # stale after ttl: asked again
        for _ in range(2):
            try:
                await reads.get("missing", fail)
            except NoSuchJob:
                pass
        assert calls["n"] == 4

    aio.run(scenario())
