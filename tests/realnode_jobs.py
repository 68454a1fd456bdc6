"""Helpers for `%%tfdist run` jobs on the one-machine cluster's real node (tests/test_k8s_realnode_jobs.py,
benchmarks/bench_k8s_realnode.py).

A host kernel plays the notebook: it acts as a user's notebook service account (a TokenRequest from the
user namespace the spawner's own code prepared, tfdist.kube.apply.setup_user), and a stand-in notebook pod
in that namespace (labelled as the user's notebook, so the job's NetworkPolicy admits it to the agent)
owns the user's jobs through TFDIST_POD_NAME/UID, as the spawner's downward API would set them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import queue
import re
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests import realnode
from tests.kernels import Kernel, Result, kernel_env

REPO = Path(__file__).resolve().parents[1]
JOB_KINDS = {  # what a job consists of, and where to list it
    "jobs": "/apis/batch/v1/namespaces/{ns}/jobs",
    "pods": "/api/v1/namespaces/{ns}/pods",
    "services": "/api/v1/namespaces/{ns}/services",
    "secrets": "/api/v1/namespaces/{ns}/secrets",
    "networkpolicies": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
}
# two cores in all: four tasks at 0.45 each leave room for the stand-in notebook pods
JOB_FLAGS = "--cpu 0.45 --memory 1536Mi"


def build_job_image() -> str:
    """The job image of this checkout, imported into the node's containerd (cached by a hash of its inputs:
    seconds when nothing changed). Its ref from the command's own line: images/current.json may already
    name another checkout's build."""
    out = subprocess.run(
        [str(REPO / "scripts" / "build-images"), "job", "--import"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise RuntimeError(f"scripts/build-images job --import failed:\n{out.stderr[-3000:]}")
    refs = [
        p[1] for p in (line.split("\t") for line in out.stdout.splitlines()) if len(p) == 4 and p[0] == "job"
    ]
    assert refs, out.stdout
    return refs[0]


@dataclass
class Tenant:
    """A user's namespace as the spawner prepares it, and a kubeconfig acting as their notebook."""

    user: str
    namespace: str
    kubeconfig: str
    notebook_pod: str = ""
    notebook_uid: str = ""


def make_tenant(cluster: Any, prefix: str, workdir: Path, **policy: Any) -> Tenant:
    """`policy`: TenantPolicy fields that differ from the tests' small CPU-only profile (egress, ...)."""
    from tfdist.kube.apply import setup_user
    from tfdist.kube.tenancy import TenantPolicy

    user = f"{prefix}-{uuid.uuid4().hex[:6]}"
    ns = f"tfdist-user-{user}"
    state = cluster.state
    if hasattr(realnode, "apply_admission_policy"):
        realnode.apply_admission_policy(cluster.client)
    policy = TenantPolicy(
        user=user,
        namespace=ns,
        gpu_quota={"nvidia.com/gpu": 0},
        cpu_quota=4.0,
        memory_quota_bytes=12 * 2**30,
        pods_quota=16,
        default_cpu="100m",
        default_memory="128Mi",
        **policy,
    )
    ca = base64.b64encode(Path(state["ca_file"]).read_bytes()).decode()

    async def prepare() -> dict:
        from kubernetes_asyncio import client, config

        cfg = client.Configuration()
        await config.load_kube_config(config_file=state["kubeconfig"], client_configuration=cfg)
        async with client.ApiClient(cfg) as api:
            return await setup_user(api, user, ns, server=state["server"], ca_data_b64=ca, policy=policy)

    kc = workdir / f"{user}.kubeconfig"
    kc.write_text(json.dumps(asyncio.run(prepare())))
    kc.chmod(0o600)
    return Tenant(user=user, namespace=ns, kubeconfig=str(kc))


def start_notebook_pod(cluster: Any, tenant: Tenant, name: str = "notebook", forged: str = "") -> None:
    """A stand-in for the user's notebook pod: labelled as the spawner labels it, it owns the user's jobs
    (TFDIST_POD_NAME/UID) and the probes run inside it (kubectl exec). `forged`: also carry that user's
    notebook label (what another user could put on their own pod)."""
    from tfdist.kube import names as kn

    labels = {**kn.notebook_pod_labels(tenant.user), "component": "singleuser-server"}
    if forged:
        labels.update(kn.notebook_pod_labels(forged))
    cluster.pod(
        tenant.namespace,
        name,
        "import time; time.sleep(7200)",
        labels=labels,
        limits={"cpu": "50m", "memory": "64Mi"},
    )
    pod = cluster.wait_pod(tenant.namespace, name, ("Running",), timeout=120)
    tenant.notebook_pod, tenant.notebook_uid = name, pod["metadata"]["uid"]


def drop_tenant(cluster: Any, tenant: Tenant) -> None:
    try:
        cluster.request("DELETE", f"/api/v1/namespaces/{tenant.namespace}")
    except Exception:  # already gone, or the cluster is down
        pass


def left(cluster: Any, ns: str, job: str) -> list[str]:
    """Every object of `job` still in `ns` (being deleted counts as left)."""
    from tfdist.kube import names as kn

    out = []
    for kind, path in JOB_KINDS.items():
        body = cluster.get(path.format(ns=ns) + f"?labelSelector={kn.L_JOB}%3D{job}") or {"items": []}
        out += [f"{kind}/{o['metadata']['name']}" for o in body["items"]]
    return out


def wait_gone(cluster: Any, ns: str, job: str, timeout: float) -> float:
    """Seconds until nothing of `job` is left; AssertionError with what is left after `timeout`."""
    return GoneWatch(cluster, ns, job, timeout).check()


class GoneWatch:
    """`wait_gone` in the background, so the test goes on meanwhile (its next job's start overlaps the
    clean-up's TTL); `check()` asserts the same bound, measured from when the watch began."""

    def __init__(self, cluster: Any, ns: str, job: str, timeout: float) -> None:
        self.job, self.timeout = job, timeout
        self.took: float | None = None
        self.rest: list[str] | str = "never read"
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._watch, args=(cluster, ns), daemon=True)
        self._thread.start()

    def _watch(self, cluster: Any, ns: str) -> None:
        while time.monotonic() - self._t0 <= self.timeout:
            try:
                self.rest = left(cluster, ns, self.job)
            except Exception as exc:  # the API server busy: read again, as wait_gone would
                self.rest = f"not read: {exc!r}"
            else:
                if not self.rest:
                    self.took = time.monotonic() - self._t0
                    return
            time.sleep(0.5)

    def check(self) -> float:
        """Seconds from the watch's start until nothing of the job was left; AssertionError otherwise."""
        self._thread.join(max(0.0, self._t0 + self.timeout - time.monotonic()) + 10)
        if self.took is None:
            raise AssertionError(f"{self.job}: left after {self.timeout:.0f}s: {self.rest}")
        return self.took


def job_pods(cluster: Any, ns: str, job: str, role: str | None = None) -> list[dict]:
    from tfdist.kube import names as kn

    sel = f"{kn.L_JOB}%3D{job}" + (f",{kn.L_ROLE}%3D{role}" if role else "")
    return (cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={sel}") or {"items": []})["items"]


def running(pods: list[dict]) -> list[dict]:
    return [
        p
        for p in pods
        if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def wait_for(what: str, probe, timeout: float, every: float = 0.5):
    t0 = time.monotonic()
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def job_state(cluster: Any, ns: str, job: str) -> str:
    """What a stuck job's pods are doing (phase, each container's state and restarts), the other pods on
    the node and the namespace's last events: the message of a wait that timed out."""
    lines = []
    for p in job_pods(cluster, ns, job):
        st = p.get("status") or {}
        cs = []
        for c in st.get("containerStatuses") or []:
            state = c.get("state") or {}
            how = ",".join(f"{k}/{v.get('reason', '')}" for k, v in state.items())
            cs.append(f"{c['name']}:{how} restarts={c.get('restartCount', 0)}")
        lines.append(f"{p['metadata']['name']} {st.get('phase')} {' '.join(cs)}")
    # what else holds the real node (another test's pods still terminating would starve this job)
    on_node = (cluster.get(f"/api/v1/pods?fieldSelector=spec.nodeName%3D{realnode.NODE_NAME}") or {}).get(
        "items", []
    )
    for p in on_node:
        if p["metadata"]["namespace"] == ns:
            continue
        req = [c.get("resources", {}).get("requests", {}).get("cpu", "-") for c in p["spec"]["containers"]]
        gone = " terminating" if p["metadata"].get("deletionTimestamp") else ""
        lines.append(
            f"also on the node: {p['metadata']['namespace']}/{p['metadata']['name']} "
            f"{(p.get('status') or {}).get('phase')}{gone} cpu={','.join(req)}"
        )
    events = (cluster.get(f"/api/v1/namespaces/{ns}/events") or {}).get("items", [])
    for e in events[-12:]:
        lines.append(
            f"event {e.get('involvedObject', {}).get('name')}: {e.get('reason')}: {e.get('message')}"
        )
    return "\n".join(lines)


def wait_first_epoch(
    cluster: Any, k: WatchedKernel, cell: str, since: int, ns: str, job: str, timeout: float = 600
) -> None:
    """Until the cell's monitor shows a finished epoch; fails at once if the cell ends first, and says what
    the job's pods were doing if none comes in `timeout`."""

    def probe() -> bool:
        if k.idle_after(cell):
            r = k.wait(cell, timeout=5)
            raise AssertionError(f"the cell ended before its first epoch: {r.error_text or r.text}")
        return epochs_shown(k.widget_texts(since)) >= 1

    try:
        wait_for("the first epoch", probe, timeout)
    except AssertionError as exc:
        if "timed out" not in str(exc):
            raise
        shown = k.widget_texts(since)[-4:]
        raise AssertionError(
            f"{exc}\nthe job's pods:\n{job_state(cluster, ns, job)}\nthe cell showed: {shown}"
        ) from None


def kubectl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    state = realnode.load_state()
    return subprocess.run(
        [str(realnode.plane_bin_dir() / "kubectl"), "--kubeconfig", state["kubeconfig"], *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


PROBE = """
import socket, sys, urllib.request
def tcp(host, port):
    s = socket.socket(); s.settimeout(5)
    try:
        s.connect((host, port)); return 'CONNECTED'
    except OSError:
        return 'BLOCKED'
    finally:
        s.close()
tf_ip, agent_ip, tf_port, agent_port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
print('TF', tcp(tf_ip, tf_port))
print('AGENT', tcp(agent_ip, agent_port))
try:
    with urllib.request.urlopen('http://%s:%d/healthz' % (agent_ip, agent_port), timeout=5) as r:
        print('HEALTHZ', r.status, r.read().decode()[:200])
except Exception as e:
    print('HEALTHZ', 'FAILED', type(e).__name__)
"""


def probe_from(ns: str, pod: str, tf_ip: str, agent_ip: str, tf_port: int, agent_port: int) -> dict[str, str]:
    """From inside `pod`: connect to a job task's TF port and to the coordinator's agent (TCP, then an HTTP
    GET of its health check). {"TF": CONNECTED|BLOCKED, "AGENT": ..., "HEALTHZ": "200 {...}"|"FAILED"}."""
    r = kubectl(
        "exec", "-n", ns, pod, "--", "python3", "-c", PROBE, tf_ip, agent_ip, str(tf_port), str(agent_port)
    )
    assert r.returncode == 0, r.stderr
    return dict(line.partition(" ")[::2] for line in r.stdout.splitlines() if " " in line)


class WatchedKernel(Kernel):
    """A real kernel whose iopub messages are all kept (the monitor's widget updates are comm messages),
    so a test can wait for what the cell shows while it runs."""

    def __init__(self, env: dict[str, str], cwd: str):
        super().__init__(env, cwd)
        self.messages: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            except Exception:  # channels closed
                return
            with self._lock:
                self.messages.append(msg)

    def submit(self, code: str) -> str:
        return self.kc.execute(code)

    def wait(self, msg_id: str, timeout: float = 600) -> Result:
        """The cell's Result once the kernel is idle after it."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                mine = [m for m in self.messages if m["parent_header"].get("msg_id") == msg_id]
            if any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in mine):
                res = Result()
                for m in mine:
                    if m["msg_type"] == "error":
                        res.error = m["content"]
                    elif m["msg_type"] in ("stream", "display_data", "execute_result"):
                        res.outputs.append(m)
                return res
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell did not finish in {timeout}s: {self.widget_texts()[-3:]}")
            time.sleep(0.2)

    def run(self, code: str, timeout: float = 600) -> Result:
        return self.wait(self.submit(code), timeout)

    def mark(self) -> int:
        """Where the messages from now on start (for widget_texts of one cell only)."""
        with self._lock:
            return len(self.messages)

    def idle_after(self, msg_id: str) -> bool:
        with self._lock:
            return any(
                m["parent_header"].get("msg_id") == msg_id
                and m["msg_type"] == "status"
                and m["content"]["execution_state"] == "idle"
                for m in self.messages
            )

    def widget_texts(self, since: int = 0) -> list[str]:
        """Every string value the kernel's widgets were set to, in order (the monitor's header, epoch
        line, task table, log)."""
        out = []
        with self._lock:
            msgs = self.messages[since:]
        for m in msgs:
            if m["msg_type"] not in ("comm_msg", "comm_open"):
                continue
            state = (m["content"].get("data") or {}).get("state") or {}
            v = state.get("value")
            if isinstance(v, str):
                out.append(v)
        return out

    def shutdown(self) -> None:
        self._stop.set()
        super().shutdown()


TASK_ROW = re.compile(
    r"<tr><td[^>]*>(?P<task>[a-z]+-\d+)</td><td[^>]*>running</td><td[^>]*>\d+</td>"
    r"<td[^>]*>(?P<cpu>\d+)%</td><td[^>]*>(?P<mem>\d+) MiB</td>"
)


def sampled_tasks(texts: list[str]) -> dict[str, tuple[float, float]]:
    """Task -> the largest (CPU %, memory MiB) the monitor's task table showed for it while it ran."""
    out: dict[str, tuple[float, float]] = {}
    for t in texts:
        for m in TASK_ROW.finditer(t):
            cpu, mem = float(m["cpu"]), float(m["mem"])
            old = out.get(m["task"], (0.0, 0.0))
            out[m["task"]] = (max(old[0], cpu), max(old[1], mem))
    return out


def restarts_shown(texts: list[str], task: str) -> list[int]:
    """Every restart count the monitor's task table showed for `task`."""
    row = re.compile(rf"<tr><td[^>]*>{re.escape(task)}</td><td[^>]*>[a-z-]+</td><td[^>]*>(\d+)</td>")
    return [int(m[1]) for t in texts for m in row.finditer(t)]


EPOCH_LINE = re.compile(r"^(\d+)/(\d+|\?) (?!servers started)")


def epochs_shown(texts: list[str]) -> int:
    """The highest epoch count the monitor's epoch line showed ("3/8 training ...")."""
    best = 0
    for t in texts:
        m = EPOCH_LINE.match(t)
        if m:
            best = max(best, int(m[1]))
    return best


def notebook_cells() -> list[str]:
    nb = json.loads((REPO / "examples" / "digits.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def digits_kernel(tenant: Tenant, image: str, workdir: Path, **extra: str) -> WatchedKernel:
    """A host kernel set up as the spawner sets up a Kubernetes notebook server, with the example's first
    two cells run (model and data built, accuracy before training measured)."""
    env = kernel_env(
        str(workdir / "state"),
        KUBECONFIG=tenant.kubeconfig,
        TFDIST_BACKEND="kubernetes",
        TFDIST_NAMESPACE=tenant.namespace,
        TFDIST_WORKER_IMAGE=image,
        TFDIST_USER=tenant.user,
        **(
            {"TFDIST_POD_NAME": tenant.notebook_pod, "TFDIST_POD_UID": tenant.notebook_uid}
            if tenant.notebook_pod
            else {}
        ),
        **extra,
    )
    env.pop("TFDIST_AGENT_PORT", None)
    k = WatchedKernel(env, cwd=tempfile.mkdtemp(dir=workdir))
    for cell in notebook_cells()[:2]:
        r = k.run(cell, timeout=300)
        assert r.error is None, r.error_text
    return k


def run_line(name: str, flags: str = "") -> str:
    """The example's `%%tfdist run` line with this job's name and its pods' resources."""
    first, _, body = notebook_cells()[2].partition("\n")
    assert first.startswith("%%tfdist run")
    return f"{first} --name {name} {JOB_FLAGS} {flags}".rstrip() + "\n" + body


# ------------------------------------------------------------ the example in a notebook pod (z2jh test)

# run in the notebook's kernel after the example: what the cells after the %%tfdist one computed
EXAMPLE_CHECK = """
import json
print("RESULT " + json.dumps({"changed": bool(changed), "acc": float(acc_after),
                              "epochs": len(history.history["loss"])}))
"""


def code_cells(nb: dict) -> list[str]:
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def all_job_objects(cluster: Any, ns: str) -> list[str]:
    """Every %%tfdist job object in `ns`, of any job (being deleted counts)."""
    from tfdist.kube import names as kn

    out = []
    for kind, path in JOB_KINDS.items():
        body = cluster.get(path.format(ns=ns) + f"?labelSelector={kn.L_JOB}") or {"items": []}
        out += [f"{kind}/{o['metadata']['name']}" for o in body["items"]]
    return out


class PodWatcher:
    """Samples the namespace's job pods every 0.5 s: (job, role, node) of each pod seen Running (a job of a
    few seconds would slip between the polls of a slower watcher)."""

    def __init__(self, cluster: Any, ns: str) -> None:
        self.cluster, self.ns, self.seen = cluster, ns, set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        from tfdist.kube import names as kn

        while not self._stop.is_set():
            try:
                pods = self.cluster.get(f"/api/v1/namespaces/{self.ns}/pods?labelSelector={kn.L_JOB}")
            except Exception:  # one failed poll: the next one counts
                pods = None
            for p in running((pods or {}).get("items", [])):
                labels = p["metadata"]["labels"]
                self.seen.add((labels[kn.L_JOB], labels.get(kn.L_ROLE), p["spec"].get("nodeName")))
            self._stop.wait(0.5)

    def stop(self) -> set[tuple[str, str | None, str | None]]:
        self._stop.set()
        self._t.join()
        return self.seen
