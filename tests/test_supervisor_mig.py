"""A local job on a MIG slice reports its GPU (issue 27): CUDA_VISIBLE_DEVICES names a MIG instance only by
its UUID, and the supervisor dropped every GPU name that was not a number, so such a job's samples had no
GPU at all. A real job (supervisor and TensorFlow PS/worker tasks, started by `LocalBackend`) on a MIG
instance, with NVML the named double tests/doubles/fake_pynvml: its worker's samples carry that instance's
own memory, and no utilization (NVML cannot measure it there), never a 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import pytest

from tfdist.backends.base import Launch
from tfdist.backends.local import LocalBackend
from tfdist.jobspec import JobSpec
from tfdist.payload import pack

pytestmark = pytest.mark.slow

DOUBLES = Path(__file__).resolve().parent / "doubles"
MIG = "MIG-5a7c1a3e-0b1f-5e63-9d6a-0a1b2c3d4e5f"
MACHINE = {
    "gpus": [
        {
            "name": "NVIDIA A100-SXM4-80GB",
            "uuid": "GPU-00000000-0000-0000-0000-000000000000",
            "mig": [{"profile": "1g.10gb", "uuid": MIG, "memory_total_mib": 9728, "mem_used_mib": 1234}],
        }
    ]
}


def test_a_job_on_a_mig_instance_samples_it(tmp_path: Path, monkeypatch) -> None:
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps(MACHINE))
    # the supervisor's NVML (it samples its tasks' GPUs) is the double
    path = [str(DOUBLES / "fake_pynvml"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    monkeypatch.setenv("TFDIST_FAKE_NVML", str(nvml))
    done = tmp_path / "job-done"
    code = f"import os, time\nwhile not os.path.exists({str(done)!r}):\n    time.sleep(0.2)\n"
    loop = asyncio.new_event_loop()
    backend = LocalBackend(str(tmp_path / "jobs"))
    spec = JobSpec(name="mig1", user="u", workers=1, ps=1, gpus_per_worker=1)
    try:
        loop.run_until_complete(backend.submit(spec, pack(code, [], {}), Launch(gpus=[MIG])))
        deadline = time.time() + 240
        gpus: list = []
        while time.time() < deadline and not gpus:
            view = loop.run_until_complete(backend.status("mig1"))
            assert not view.finished, view.message
            for sample in list(view.metrics)[::-1]:
                if gpus := (sample["tasks"].get("worker-0") or {}).get("gpus") or []:
                    break
            time.sleep(0.5)
        assert view.tasks["worker-0"]["gpus"] == [MIG]
        # the instance's own memory (its parent's would be 80 GiB, or refused): the slice was sampled, named
        # as a MIG instance, its utilization unmeasurable there (not a 0), all through the job's wire
        assert gpus == [
            {
                "index": 0,
                "util (%)": None,
                "mem_used (MiB)": 1234.0,
                "mem_total (MiB)": 9728.0,
                "uuid": MIG,
                "mig_profile": "1g.10gb",
                "util_missing": "mig",
            }
        ]
        done.write_text("")
        while (
            time.time() < deadline and not (view := loop.run_until_complete(backend.status("mig1"))).finished
        ):
            time.sleep(0.5)
        assert view.state == "succeeded", view.message
    finally:
        done.write_text("")
        with contextlib.suppress(Exception):
            loop.run_until_complete(backend.stop("mig1"))
        loop.run_until_complete(backend.close())
        loop.close()
