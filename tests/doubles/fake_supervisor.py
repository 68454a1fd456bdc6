"""FakeSupervisor: a process that is, to `LocalBackend`, the supervisor of a running `%%tfdist` job.

Named, one behaviour: run as ``python fake_supervisor.py JOBDIR USER``; it writes the job's spec.json,
state.json and supervisor.pid (its own PID and start time) and answers every control-socket request with
a snapshot of a job in state "running" whose worker's GPU is at FAKE_JOB_GPU_UTIL %, until killed. For
tests that need "a job is running on this server" without TensorFlow processes (the GPU-idle culler must
leave such a server alone; the admin page shows the job's GPUs).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from tfdist.jobspec import JobSpec
from tfdist.jobview import JobView
from tfdist.procid import ProcessId
from tfdist.runtime import events
from tfdist.runtime.unixsock import short_path

FAKE_JOB_GPU_UTIL = 70.0


async def main(jobdir: str, user: str) -> None:
    name = os.path.basename(jobdir.rstrip("/"))
    os.makedirs(os.path.join(jobdir, "logs"), exist_ok=True)
    spec = JobSpec(name=name, user=user, workers=1, ps=1)
    with open(os.path.join(jobdir, "spec.json"), "w") as f:
        f.write(spec.to_json())
    with open(os.path.join(jobdir, "state.json"), "w") as f:
        json.dump({"state": "running", "created": time.time(), "tasks_total": spec.task_count}, f)
    view = JobView(
        name=name, user=user, state="running", total_tasks=spec.task_count, spec=json.loads(spec.to_json())
    )
    # its worker's latest sample: one GPU at FAKE_JOB_GPU_UTIL % (what the hub's admin page shows per job)
    gpu = {"index": 0, "util (%)": FAKE_JOB_GPU_UTIL, "mem_used (MiB)": 1024.0}
    view.metrics.append({"t": time.time(), "tasks": {"worker-0": {"cpu (%)": 50.0, "gpus": [gpu]}}})

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(events.dumps({"type": "snapshot", "view": view.to_dict()}))
        await writer.drain()
        writer.close()

    with short_path(os.path.join(jobdir, "control.sock")) as sock:
        server = await asyncio.start_unix_server(answer, sock)
    me = ProcessId.of(os.getpid())
    with open(os.path.join(jobdir, "supervisor.pid"), "w") as f:
        f.write(me.dumps())
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
