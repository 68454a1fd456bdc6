"""An all-reduce job's pods: `python -m tfdist.runtime.podmain allreduce-worker|allreduce-chief`.

Under MultiWorkerMirroredStrategy every replica runs the cell (docs/users.md), so a worker pod is
not a bare TF server: it fetches the payload from chief-0's agent (a signed GET with the job's token from
the job's Secret; an answer not signed with it is never run), then runs the coordinator program
(`tfdist.runtime.coordinator`) as its replica, and posts its CPU and memory to the agent like a PS job's
server pods. Nothing outlives the job: the pod ends when its replica ends, when the chief has finished and
this replica has not followed within FINISH_GRACE_S (it would wait in a collective forever), or when the
chief's agent has been unreachable for ORPHAN_AFTER_S (the chief's pod is gone). chief-0 runs the
ordinary chief entry point (agent + the cell as replica 0) with a sampler posting its replica's use.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from ..job import signing
from ..settings import ENV_EVENTS_FD, TaskSettings
from . import events as wire
from .deathsig import die_with_parent

FINISH_GRACE_S = 30.0  # the chief finished: this replica's last collective is done, it ends right after
POLL_S = 1.0


class PayloadRefused(Exception):
    """Something answered at the chief's address without the job's signature: never run what it sent."""


def fetch_payload(url: str, token: str, timeout: float = 600.0) -> bytes | None:
    """The job's payload from the chief's agent; None while the notebook has not uploaded it yet.
    Raises OSError (or http.client.HTTPException) while the agent is unreachable."""
    auth, nonce = signing.sign_request(token, "GET", "/payload", signing.digest(b""))
    # no proxies: the agent is in the cluster, whatever the image's environment says
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url.rstrip("/") + "/payload", headers={"Authorization": auth})
    try:
        with opener.open(req, timeout=timeout) as r:
            status, body, sig = r.status, r.read(), r.headers.get(signing.RESPONSE_HEADER)
    except urllib.error.HTTPError as exc:
        status, body, sig = exc.code, exc.read(), exc.headers.get(signing.RESPONSE_HEADER)
    if status in (502, 503, 504):
        raise ConnectionError(f"the agent answered {status}")
    try:
        signing.verify_response(token, nonce, status, body, sig)
    except signing.BadSignature:
        raise PayloadRefused(f"{url} answered {status} without the job's signature") from None
    if status == 404:
        return None
    if status != 200:
        raise PayloadRefused(f"the chief's agent answered {status}: {body[:200]!r}")
    return body


def wait_for_payload(url: str, token: str, task: str, wait_s: float, orphan_s: float) -> bytes | None:
    """The payload, or None when the chief's agent never answered within `wait_s` or stopped answering
    for `orphan_s` (the job is gone) or answered without the job's signature."""
    started = time.monotonic()
    last_ok: float | None = None
    while True:
        try:
            data = fetch_payload(url, token)
        except PayloadRefused as exc:
            print(f"tfdist: {task}: {exc}; not running it", flush=True)
            return None
        except (OSError, http.client.HTTPException):
            now = time.monotonic()
            if (last_ok is not None and now - last_ok > orphan_s) or (
                last_ok is None and now - started > wait_s
            ):
                print(f"tfdist: {task}: the chief's agent is unreachable; ending", flush=True)
                return None
        else:
            if data is not None:
                return data
            last_ok = time.monotonic()
        time.sleep(POLL_S)


def follow(proc: subprocess.Popen, url: str, token: str, task: str, orphan_s: float) -> int:
    """Sample this replica for the monitor until it ends; end it when the job has (see module doc)."""
    from .podmain import _AgentLink, pod_sampler

    sampler = pod_sampler(task, proc.pid)
    agent = _AgentLink(url, token)
    last_ok = time.monotonic()
    finished_at: float | None = None
    why = ""
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            health = agent.healthy()
            now = time.monotonic()
            if health is False:  # the chief is done: this replica should be too
                finished_at = finished_at or now
                if now - finished_at > FINISH_GRACE_S:
                    why = f"the chief finished {FINISH_GRACE_S:.0f}s ago"
                    break
                continue
            if health is None:
                if now - last_ok > orphan_s:
                    why = f"the chief's agent was unreachable for {orphan_s:.0f}s"
                    break
                continue
            last_ok = now
            try:
                agent.post("/metrics", wire.dumps(sampler.sample()))
            except Exception:
                pass
    finally:
        agent.close()
    if proc.poll() is None:
        print(f"tfdist: {why}; ending {task}", flush=True)
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 0  # the job ended without this replica: not a failure of its own
    return proc.returncode or 0


def sample_chief(port: int, token: str, period: float = POLL_S) -> None:
    """chief-0 is replica 0: post its replica's CPU and memory to its own agent, as the worker pods do,
    so that the monitor shows every replica. Runs in a daemon thread of the chief's entry point."""
    import psutil

    from ..sampler import TaskProcess, TaskSampler
    from .podmain import _AgentLink, is_coordinator

    sampler = TaskSampler()
    agent = _AgentLink(f"http://127.0.0.1:{port}", token)
    me = psutil.Process()
    tracked = None
    while True:
        time.sleep(period)
        try:
            replica = next((c for c in me.children() if is_coordinator(c.cmdline())), None)
        except psutil.Error:
            replica = None
        if replica is None:
            continue
        if replica.pid != tracked:
            tracked = replica.pid
            sampler.track(TaskProcess("chief-0", replica.pid, sampler.gpus.indices()))
            continue  # the first sample primes the CPU counter
        try:
            agent.post("/metrics", wire.dumps(sampler.sample()))
        except Exception:
            pass


def run_chief() -> int:
    """chief-0 of an all-reduce job: the ordinary chief entry point (agent + the cell as replica 0), with
    its replica sampled for the monitor."""
    import threading

    from . import podmain

    ts = TaskSettings()
    args = (ts.agent_port, ts.token or "")
    threading.Thread(target=sample_chief, args=args, name="tfdist-sampler", daemon=True).start()
    return podmain.run_chief()


def run_worker() -> int:
    from .podmain import ORPHAN_AFTER_S, TERMINATED

    ts = TaskSettings()
    url, token, task = ts.agent_url, ts.token or "", ts.task or "worker-0"
    child: list[subprocess.Popen] = []

    def terminated(*_: object) -> None:
        # As a container's PID 1 this process ignores SIGTERM unless it handles it; a deleted pod fails.
        for p in child:
            p.kill()
        os._exit(TERMINATED)

    signal.signal(signal.SIGTERM, terminated)
    if not url or not token:
        print("tfdist: TFDIST_AGENT_URL and TFDIST_TOKEN are required", file=sys.stderr, flush=True)
        return 2
    wait_s = ts.payload_wait_s + 60
    print(f"tfdist: {task} waiting for the cell from the chief's agent", flush=True)
    data = wait_for_payload(url, token, task, wait_s, ORPHAN_AFTER_S)
    if data is None:
        return 3
    jobdir = tempfile.mkdtemp(prefix="tfdist-job-")
    with open(os.path.join(jobdir, "payload.bin"), "wb") as f:
        f.write(data)
    del data
    print(f"tfdist: {task} running the cell as an all-reduce replica", flush=True)
    env = {k: v for k, v in os.environ.items() if k != ENV_EVENTS_FD}  # only chief-0 reports
    child.append(
        subprocess.Popen(
            [sys.executable, "-u", "-m", "tfdist.runtime.coordinator", jobdir],
            env=env,
            preexec_fn=die_with_parent(),
        )
    )
    return follow(child[0], url, token, task, ORPHAN_AFTER_S)
