"""What a job's pod runs: `python -m tfdist.runtime.podmain chief|worker|ps|allreduce-*`.

chief: the agent (tfdist.runtime.agent) plus the coordinator (tfdist.runtime.coordinator, the same code
the local backend runs), exiting once the notebook has its results. worker/ps: the TF server
(tfdist.runtime.task) plus a sampler that posts this pod's CPU, memory and GPU use to the agent; the pod
exits when the coordinator has finished or its agent has been gone for a while, so PS pods never linger
holding resources (TFJob's PS pods do). allreduce-worker|allreduce-chief: tfdist.runtime.allreduce_pod (the
cell again, as one more MultiWorkerMirroredStrategy replica; chief-0 is replica 0 and runs run_chief).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

# Only light imports here: every pod starts with this module under its CPU limit, and a server pod's
# TensorFlow server waits for nothing else (the event records, pydantic and aiohttp come once it serves)
from ..settings import ENV_EVENTS_FD, ENV_TASK, ENV_TOKEN, SettingsError, TaskSettings
from .deathsig import die_with_parent

ORPHAN_AFTER_S = 30.0  # a server whose agent is unreachable this long ends itself
SERVING_WAIT_S = 300.0  # a server not serving by then is sampled and watched anyway
TERMINATED = 143  # 128 + SIGTERM: a pod ended by the cluster has failed, whatever it was doing
ENV_GATE_FD = "_TFDIST_PAYLOAD_GATE_FD"  # run_gated_coordinator reads its go from this pipe


def run_chief() -> int:
    # As a container's PID 1 this process ignores SIGTERM unless it handles it: a pod deleted while it
    # waits for the payload would otherwise linger for the whole grace period.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(TERMINATED))
    ts = TaskSettings()
    token = ts.token
    if token is None:
        raise SettingsError(f"{ENV_TOKEN} is not set: chief-0's agent takes no request without it")
    port = ts.agent_port
    jobdir = tempfile.mkdtemp(prefix="tfdist-job-")
    # The coordinator starts first, gated: TensorFlow loads while the agent starts and the notebook sends
    # the payload (after the payload, that import took 3-4 s of a 0.45-core pod's path to the first epoch).
    # Nothing heavy before it: the PS watch's checkpoint settings come from the light psrecovery.
    from . import psrecovery
    from .importing import collector_paused

    every = psrecovery.pod_checkpoint_every(ts)
    early = _start_coordinator(jobdir, psrecovery.checkpoint_env(every, jobdir) if every else {}, gated=True)
    # The agent keeps its share of the pod's CPU beside the coordinator (no _yield_cpu here): the payload
    # it receives is needed by the time the coordinator's import ends, and the events it relays are the
    # notebook's live view while the coordinator keeps the pod busy.
    with collector_paused():
        from ..job.events import ProgressEvent, StateEvent, error_info, to_wire
        from .agent import AgentState, serve, wait_until
        from .outcome import coordinator_outcome

    state = AgentState(jobdir, token)
    srv = serve(state, port)
    print(f"tfdist: agent listening on :{port}", flush=True)
    state.log.add(to_wire(ProgressEvent(phase="waiting for the payload")))
    if not state.payload_ready.wait(ts.payload_wait_s):
        print("tfdist: no payload arrived; giving up", flush=True)
        early.abandon()
        return 3
    code = _run_coordinator(state, jobdir, early)
    out = coordinator_outcome(jobdir, code)  # the same reading as the local supervisor's
    done = to_wire(
        StateEvent(
            state=out.state,
            t=time.time(),
            message=out.message,
            error=error_info(out.error),
        )
    )
    state.finished.set()
    state.log.add(done)
    keep = ts.result_wait_s
    wait_until(state.delivered.is_set, keep if code == 0 else 60.0)
    srv.shutdown()
    return code


class _Coordinator:
    """A coordinator subprocess and the read end of its events; `gated`: started before the payload, it
    imports what the coordinator needs, then waits for `open()` (or ends at `abandon()`)."""

    def __init__(self, proc: subprocess.Popen, events: int, gate: int | None):
        self.proc, self.events, self.gate = proc, events, gate

    def open(self) -> None:
        if self.gate is not None:
            with contextlib.suppress(OSError):
                os.write(self.gate, b"1")
            os.close(self.gate)
            self.gate = None

    def abandon(self) -> None:
        if self.gate is not None:
            os.close(self.gate)  # EOF without the byte: the process ends at once
            self.gate = None
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        os.close(self.events)


YIELD_NICENESS = 10  # CFS weight 110 against a default task's 1024


def _yield_cpu() -> None:
    """A server pod's entry point below its TF server on the pod's CPU: the niceness weighs only within
    the pod's own cgroup, so the pod's share of the node is what it was."""
    with contextlib.suppress(OSError):
        os.nice(YIELD_NICENESS)


def _start_coordinator(jobdir: str, extra_env: dict[str, str], gated: bool = False) -> _Coordinator:
    r, w = os.pipe()
    env = dict(os.environ) | {ENV_EVENTS_FD: str(w)} | extra_env
    fds = [w]
    gate_r = gate_w = None
    if gated:
        gate_r, gate_w = os.pipe()
        env[ENV_GATE_FD] = str(gate_r)
        fds.append(gate_r)
        cmd = [sys.executable, "-u", "-m", "tfdist.runtime.podmain", "coordinator", jobdir]
    else:
        cmd = [sys.executable, "-u", "-m", "tfdist.runtime.coordinator", jobdir]
    proc = subprocess.Popen(
        cmd,
        env=env,
        pass_fds=tuple(fds),
        preexec_fn=die_with_parent(),  # outside a container too, nothing outlives this process
    )
    os.close(w)
    if gate_r is not None:
        os.close(gate_r)
    return _Coordinator(proc, r, gate_w)


def is_coordinator(cmdline: list[str]) -> bool:
    """A process running the coordinator: started after the payload, or gated before it (the chief's
    replica sampler looks for it among the entry point's children)."""
    line = " ".join(cmdline)
    return "tfdist.runtime.coordinator" in line or "tfdist.runtime.podmain coordinator" in line


def run_gated_coordinator(jobdir: str) -> int:
    """The coordinator started before its payload: the imports of tfdist.runtime.coordinator.run (same
    environment first: thread pools and Keras 2 are read at TensorFlow's import), then the gate's byte,
    then the coordinator itself. No byte (the chief gave up): exit 3 without running anything."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    gate = int(os.environ.pop(ENV_GATE_FD))
    from ..taskenv import ensure_threads

    ensure_threads()
    from .importing import import_coordinator

    import_coordinator()
    from . import coordinator

    with os.fdopen(gate, "rb") as f:
        if f.read(1) != b"1":
            return 3
    return coordinator.run(jobdir)


def _run_coordinator(state: Any, jobdir: str, early: _Coordinator | None = None) -> int:
    """The coordinator subprocess, its events into the agent's log; with --checkpoint-every, started again
    after a lost PS came back (tfdist.runtime.pspod), resuming from its checkpoint. `early`: the first one,
    started gated before the payload came (with the same checkpoint environment)."""
    from . import events as wire
    from .pspod import PsWatch

    watch = PsWatch.from_env(jobdir, state.log.add)
    while True:
        if early is not None:
            coord, early = early, None
            coord.open()
        else:
            coord = _start_coordinator(jobdir, watch.coordinator_env() if watch is not None else {})
        proc = coord.proc
        if watch is not None:
            watch.follow(proc)
        with os.fdopen(coord.events, "rb") as pipe:
            for line in pipe:
                try:
                    state.log.add(wire.loads(line))
                except ValueError:
                    continue
        code = proc.wait()
        if watch is None or not watch.resume(code):
            break
    if watch is not None:
        watch.close()
    return code


class _AgentLink:
    """A server pod's side of the agent: the unsigned /healthz probe and signed /metrics posts over one
    kept-alive connection. The standard library's http.client, not aiohttp (the notebook's client): this
    entry point is plain blocking code around its TF server, and aiohttp's import alone took ~0.15 CPU-s of
    each server pod's share while the job starts (three pods: ~0.4 CPU-s of a busy machine)."""

    def __init__(self, url: str, token: str):
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.url, self._token = url.rstrip("/"), token
        self._host, self._port = parts.hostname or "", parts.port or 80
        self._conn: Any = None

    def _request(self, method: str, path: str, timeout: float, body: bytes | None = None, **headers: str):
        """(status, body); a kept-alive connection the agent closed meanwhile is opened again, once, for a
        GET (a POST is not sent twice: its signature is for one use, and the next sample comes anyway)."""
        import http.client

        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
            try:
                self._conn.request(method, path, body=body, headers=headers)
                r = self._conn.getresponse()
                return r.status, r.read()
            except (OSError, http.client.HTTPException):
                self._drop()
                if attempt or method != "GET":
                    raise
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def healthy(self) -> bool | None:
        """True: agent up and job running; False: job finished; None: agent unreachable."""
        try:
            status, data = self._request("GET", "/healthz", 3.0)
            if status != 200:
                return None
            return not json.loads(data)["finished"]
        except Exception:
            return None

    def post(self, path: str, body: bytes, timeout: float = 5.0) -> None:
        from ..job import signing

        auth, _ = signing.sign_request(self._token, "POST", path, signing.digest(body))
        status, data = self._request("POST", path, timeout, body, Authorization=auth)
        if status >= 400:
            raise OSError(f"agent answered {status} to POST {path}: {data[:200]!r}")

    def close(self) -> None:
        self._drop()


def pod_sampler(task: str, pid: int) -> Any:
    """A sampler of this pod's task process (`pid`) and the pod's own GPUs, for the monitor."""
    from ..sampler import TaskProcess, TaskSampler, sampler_gpus

    sampler = TaskSampler()
    gpus: list[int | str]
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # a MIG instance is named by its UUID: keep it (was dropped)
        gpus = sampler_gpus([g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",")])
    else:  # the device plugin sets NVIDIA_VISIBLE_DEVICES: the container sees only its own GPUs
        gpus = sampler.gpus.indices()
    sampler.track(TaskProcess(task, pid, gpus))
    return sampler


def _own_port() -> int | None:
    """This task's port in TF_CONFIG (its server listens on every interface), or None without one."""
    try:
        cfg = json.loads(os.environ["TF_CONFIG"])
        task = cfg["task"]
        return int(cfg["cluster"][task["type"]][int(task["index"])].rpartition(":")[2])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def wait_serving(proc: subprocess.Popen, port: int | None, timeout: float, every: float = 0.2) -> bool:
    """Until the server process accepts connections on ``port`` (True), ends, or ``timeout`` passes."""
    from .ports import answers

    deadline = time.monotonic() + timeout
    while port is not None and proc.poll() is None and time.monotonic() < deadline:
        if answers("127.0.0.1", port):
            return True
        time.sleep(every)
    return False


def run_server(role: str) -> int:
    ts = TaskSettings()
    url, token, task = ts.agent_url, ts.token or "", ts.task or role
    proc = subprocess.Popen([sys.executable, "-u", "-m", "tfdist.runtime.task"], preexec_fn=die_with_parent())
    # As a container's PID 1 this process ignores SIGTERM unless it handles it: end the server with it,
    # and fail (a pod deleted mid-fit that exited 0 would count as a finished index: no replacement).
    signal.signal(signal.SIGTERM, lambda *_: (proc.kill(), os._exit(TERMINATED)))
    _yield_cpu()  # the sampler and the agent link below: never ahead of the server's steps
    # the pod's CPU goes to TensorFlow's import until the server serves (the coordinator connects only
    # then): the sampler, the agent link and their imports start after it, not beside it
    wait_serving(proc, _own_port(), SERVING_WAIT_S)
    from . import events as wire

    sampler = pod_sampler(task, proc.pid)
    started = last_ok = time.time()
    seen = False
    agent = _AgentLink(url, token)
    while proc.poll() is None:
        time.sleep(1.0)
        if not url:
            continue
        health = agent.healthy()
        if health is False:  # the coordinator finished: this server's work is done
            break
        if health is None:
            never_for = time.time() - started > ts.payload_wait_s + 60
            if (seen and time.time() - last_ok > ORPHAN_AFTER_S) or (not seen and never_for):
                print(f"tfdist: agent unreachable for {ORPHAN_AFTER_S:.0f}s; ending {task}", flush=True)
                break
            continue
        seen, last_ok = True, time.time()
        try:
            agent.post("/metrics", wire.dumps(sampler.sample()))
        except Exception:
            pass
    agent.close()
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 0
    return proc.returncode or 0


def task_environment(role: str, environ: dict[str, str] | None = None) -> None:
    """TF_CONFIG and TFDIST_TASK of this pod: an Indexed Job's pods share one template, so the task index
    is the one the Job controller gave this pod (JOB_COMPLETION_INDEX)."""
    env = os.environ if environ is None else environ
    cluster = None if env.get("TF_CONFIG") else TaskSettings(env).cluster
    if not cluster:
        return
    from .. import tf_config

    task = f"{role}-{int(env.get('JOB_COMPLETION_INDEX') or 0)}"
    env["TF_CONFIG"] = tf_config.tf_config(cluster, task)
    env[ENV_TASK] = task


def main() -> int:
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role in ("chief", "worker", "ps", "allreduce-worker", "allreduce-chief"):
        task_environment(role.removeprefix("allreduce-"))
    if role == "chief":
        return run_chief()
    if role == "coordinator":  # started by run_chief, before the payload
        return run_gated_coordinator(sys.argv[2])
    if role in ("worker", "ps"):
        return run_server(role)
    if role in ("allreduce-worker", "allreduce-chief"):  # every replica of an all-reduce job runs the cell
        from . import allreduce_pod

        return allreduce_pod.run_worker() if role == "allreduce-worker" else allreduce_pod.run_chief()
    print("usage: python -m tfdist.runtime.podmain chief|worker|ps|allreduce-worker|-chief", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
