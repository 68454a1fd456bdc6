"""The local supervisor's parts on their own, without a job: the control socket (a real Unix socket),
the log lines held between ticks, the memory guard (a real process over its --memory), and a task's GPUs
as the sampler gets them (UUIDs kept: a MIG slice is named only so)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from tfdist.events import LogEvent, MetricsEvent, to_wire
from tfdist.jobview import Reason
from tfdist.runtime import events
from tfdist.runtime.control import ControlServer
from tfdist.runtime.guards import MemoryGuard
from tfdist.runtime.spawn import PendingLines, Task
from tfdist.sampler import TaskProcess, sampler_gpus

MIG = "MIG-5a7c1a3e-0b1f-5e63-9d6a-0a1b2c3d4e5f"
GPU = "GPU-11111111-1111-1111-1111-111111111111"


def test_gpu_uuids_reach_the_sampler() -> None:
    """CUDA_VISIBLE_DEVICES may hold UUIDs: they were dropped, so a job on a MIG slice had no GPU metrics."""
    assert sampler_gpus(["0", "2"]) == [0, 2]
    assert sampler_gpus([MIG]) == [MIG]
    assert sampler_gpus(["1", GPU, ""]) == [1, GPU]
    assert TaskProcess("worker-0", 1, sampler_gpus([MIG])).gpu_indices == [MIG]


def test_pending_lines_drop_noise_and_keep_the_newest() -> None:
    p = PendingLines(cap=3)
    p.keep("worker-0", ["a", "b"])
    p.add("tfdist", "tfdist: said")
    p.keep("worker-0", ["c"])
    assert p.take() == [("worker-0", "b"), ("tfdist", "tfdist: said"), ("worker-0", "c")]
    assert not p and p.take() == []


async def _request(path: str, req: dict) -> list[dict]:
    r, w = await asyncio.open_unix_connection(path)
    w.write(json.dumps(req).encode() + b"\n")
    await w.drain()
    out = [json.loads(await r.readline())]
    w.close()
    return out


def test_the_control_socket_answers_snapshots_streams_and_stops(tmp_path) -> None:
    async def main() -> None:
        stops: list[Reason] = []
        server = ControlServer(
            str(tmp_path / "control.sock"),
            view=lambda: {"name": "j", "state": "running"},
            finished=lambda: False,
            stop=stops.append,
        )
        await server.start()
        assert (tmp_path / "control.sock").stat().st_mode & 0o777 == 0o600
        (snap,) = await _request(server.path, {"op": "status"})
        assert snap["type"] == "snapshot" and snap["view"]["name"] == "j"
        r, w = await asyncio.open_unix_connection(server.path)
        w.write(b'{"op": "watch"}\n')
        assert json.loads(await r.readline())["type"] == "snapshot"
        for _ in range(50):  # registered once it has its snapshot written
            if server.watchers:
                break
            await asyncio.sleep(0.02)
        server.broadcast(events.dumps(to_wire(LogEvent(lines=[("worker-0", "hello")]))))
        assert json.loads(await r.readline())["lines"] == [["worker-0", "hello"]]
        assert await _request(server.path, {"op": "stop", "reason": "interrupted"}) == [{"type": "ack"}]
        assert await _request(server.path, {"op": "stop", "reason": "kernel-gone"}) == [{"type": "ack"}]
        assert stops == [Reason.INTERRUPTED, Reason.STOPPED]  # a client names no other reason
        await server.close()
        assert await r.read() == b""  # the watcher is closed with the job
        assert not (tmp_path / "control.sock").exists()
        w.close()

    asyncio.run(main())


def test_the_memory_guard_kills_a_task_over_its_limit_and_keeps_peaks() -> None:
    async def main() -> None:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
        try:
            pending = PendingLines()
            guard = MemoryGuard(100 * 2**20, None, pending)
            tasks = {"worker-0": Task("worker-0", 0, {}, proc=proc)}
            sample = MetricsEvent(
                t=time.time(), tasks={"worker-0": {"rss (MiB)": 150.0}, "ps-0": {"rss (MiB)": 20.0}}
            )
            stopped: list = []
            guard.check(sample, tasks, False, lambda *a: stopped.append(a))
            assert await asyncio.wait_for(proc.wait(), 10) == -9
            assert tasks["worker-0"].killed_for == "it used 150 MiB, over --memory 100 MiB"
            assert pending.take() == [
                ("worker-0", "tfdist: worker-0 killed: it used 150 MiB, over --memory 100 MiB")
            ]
            assert guard.peaks_mib == {"worker": 150.0, "ps": 20.0} and stopped == []
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    asyncio.run(main())


def test_the_memory_guard_leaves_a_task_under_its_limit() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        guard = MemoryGuard(200 * 2**20, None, PendingLines())
        sample = MetricsEvent(t=time.time(), tasks={"worker-0": {"rss (MiB)": 150.0}})
        guard.check(sample, {"worker-0": Task("worker-0", 0, {}, proc=proc)}, False, lambda *a: None)
        time.sleep(0.2)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_pods_sampler_keeps_a_mig_instance_named_by_uuid(monkeypatch) -> None:
    """In a pod CUDA_VISIBLE_DEVICES may name the slice only by its UUID: it was dropped (digits only)."""
    from tfdist.runtime.podmain import pod_sampler

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{MIG}, 1")
    sampler = pod_sampler("worker-0", 1)
    assert sampler._tasks["worker-0"].gpu_indices == [MIG, 1]
