"""The bare TF_CONFIG launch as plain pods: the Kubernetes baseline of `%%tfdist run` (issue 26).

`shared/baseline/bare_ps/server.py` and `coordinator.py`, unmodified, run one pod per task in the job
image, mounted from a ConfigMap; TF_CONFIG is written here by hand with the pods' stable names under a
headless Service (`<pod>.<service>`), and every container gets the same CPU/memory requests and limits as
the tfdist job's. `bare_objects` is pure (the manifests only): benchmarks/bench_k8s_realnode.py applies
them, reads the coordinator's JSON line from its log and deletes them.

Timestamps: each container runs its file through `WRAPPER`, which imports TensorFlow exactly as the file
would (same environment first), prints `BARE {"mark": ..., "t": ...}` lines (TF imported; for the
coordinator also the strategy connected and the fit called; Keras refuses batch callbacks under
ParameterServerStrategy, so the first step has no mark), then runs the file
unmodified with `runpy` (its `import tensorflow` then finds the module loaded). The figures that the
issue compares are the file's own JSON line (LAUNCH_T0 -> end of the first epoch, steps/s after it).
The local launch (benchmarks/bench_launch.py) runs `run.sh` with the same wrapper as its PYTHON, the marks
appended to the file BARE_MARKS names (run.sh keeps only the coordinator's last line).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TF_PORT = 2222
MOUNT = "/bare"
LABEL = "tfdist-bench/bare"  # every object of one bare job carries it, with the job's name
BASELINE = Path("/work/shared/baseline/bare_ps")

# Run as `python -u -c WRAPPER FILE ARGS...`; the marks are the only addition, the file runs as is.
WRAPPER = """
import json, os, runpy, sys, time
def mark(m, t=None):
    line = "BARE " + json.dumps({"mark": m, "t": time.time() if t is None else t})
    print(line, flush=True)
    if os.environ.get("BARE_MARKS"):  # local run.sh keeps only the file's last line of stdout
        with open(os.environ["BARE_MARKS"], "a") as f:
            f.write(line + chr(10))
path = sys.argv[1]
if path.endswith("coordinator.py") and os.environ.get("LAUNCH_T0"):
    mark("launch", float(os.environ["LAUNCH_T0"]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if path.endswith("coordinator.py"):
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
import tensorflow as tf
mark("tf_imported")
if path.endswith("coordinator.py"):
    import tf_keras
    _init = tf.distribute.ParameterServerStrategy.__init__
    def init(self, *a, **k):
        _init(self, *a, **k)
        mark("servers")
    tf.distribute.ParameterServerStrategy.__init__ = init
    _fit = tf_keras.Model.fit
    def fit(self, *a, **k):
        mark("fit_start")
        return _fit(self, *a, **k)
    tf_keras.Model.fit = fit
sys.argv = sys.argv[1:]
runpy.run_path(path, run_name="__main__")
"""


def task_names(workers: int, ps: int) -> list[str]:
    return ["chief-0", *(f"worker-{i}" for i in range(workers)), *(f"ps-{i}" for i in range(ps))]


def pod_name(name: str, task: str) -> str:
    return f"{name}-{task}"


def cluster(name: str, workers: int, ps: int) -> dict[str, list[str]]:
    """TF_CONFIG's cluster: each task's pod name under the headless Service `name` (same namespace)."""
    out: dict[str, list[str]] = {"chief": [], "worker": [], "ps": []}
    for task in task_names(workers, ps):
        out[task.split("-")[0]].append(f"{pod_name(name, task)}.{name}:{TF_PORT}")
    return out


def labels(name: str) -> dict[str, str]:
    return {LABEL: name}


def config_map(name: str, files: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": labels(name)},
        "data": dict(files),
    }


def service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "clusterIP": "None",
            "selector": labels(name),
            "publishNotReadyAddresses": True,  # a peer resolves as soon as its pod has an address
            "ports": [{"name": "tf", "port": TF_PORT}],
        },
    }


def pod(
    name: str,
    task: str,
    *,
    image: str,
    workers: int,
    ps: int,
    epochs: int,
    steps: int,
    cpu: str,
    memory: str,
    launch_t0: float,
    node: str | None = None,
) -> dict[str, Any]:
    kind, index = task.split("-")
    tf_config = {"cluster": cluster(name, workers, ps), "task": {"type": kind, "index": int(index)}}
    script = f"{MOUNT}/coordinator.py" if kind == "chief" else f"{MOUNT}/server.py"
    args = [str(epochs), str(steps)] if kind == "chief" else []
    res = {"cpu": cpu, "memory": memory}
    spec: dict[str, Any] = {
        "hostname": pod_name(name, task),
        "subdomain": name,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [
            {
                "name": "tensorflow",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["python", "-u", "-c", WRAPPER, script, *args],
                "env": [
                    {"name": "TF_CONFIG", "value": json.dumps(tf_config)},
                    {"name": "LAUNCH_T0", "value": f"{launch_t0:.6f}"},
                    {"name": "GRPC_FAIL_FAST", "value": "use_caller"},  # as run.sh sets it
                ],
                "ports": [{"name": "tf", "containerPort": TF_PORT}],
                "resources": {"requests": dict(res), "limits": dict(res)},
                "volumeMounts": [{"name": "bare", "mountPath": MOUNT, "readOnly": True}],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "runAsNonRoot": True,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            }
        ],
        "volumes": [{"name": "bare", "configMap": {"name": name}}],
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name(name, task), "labels": labels(name) | {"task": task}},
        "spec": spec,
    }


def bare_objects(
    name: str,
    *,
    image: str,
    files: dict[str, str],
    workers: int = 2,
    ps: int = 1,
    epochs: int = 4,
    steps: int = 200,
    cpu: str = "450m",
    memory: str = "1536Mi",
    launch_t0: float = 0.0,
    node: str | None = None,
) -> list[dict[str, Any]]:
    """The ConfigMap with the two files, the headless Service, then one pod per task (servers first, the
    coordinator last): in the order they are to be created."""
    missing = {"server.py", "coordinator.py"} - set(files)
    if missing:
        raise ValueError(f"the bare launch needs {', '.join(sorted(missing))} in files")
    if workers < 1 or ps < 1:
        raise ValueError(f"a PS job needs at least one worker and one PS (got {workers} and {ps})")
    tasks = task_names(workers, ps)
    pods = [
        pod(
            name,
            t,
            image=image,
            workers=workers,
            ps=ps,
            epochs=epochs,
            steps=steps,
            cpu=cpu,
            memory=memory,
            launch_t0=launch_t0,
            node=node,
        )
        for t in tasks[1:] + tasks[:1]
    ]
    return [config_map(name, files), service(name), *pods]


def baseline_files(folder: Path = BASELINE) -> dict[str, str]:
    """The unmodified server.py and coordinator.py."""
    return {f: (folder / f).read_text() for f in ("server.py", "coordinator.py")}


def marks(log: str) -> dict[str, float]:
    """The wrapper's `BARE` marks in a container's log (first of each)."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        if line.startswith("BARE "):
            m = json.loads(line[5:])
            out.setdefault(m["mark"], m["t"])
    return out


def result(log: str) -> dict[str, Any] | None:
    """The coordinator's own JSON line (its last line that parses as an object with the epoch figure)."""
    for line in reversed(log.splitlines()):
        if line.startswith("{"):
            try:
                got = json.loads(line)
            except ValueError:
                continue
            if "launch_to_first_epoch_s" in got:
                return got
    return None
