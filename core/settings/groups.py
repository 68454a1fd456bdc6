"""The ``TFDIST_*`` variables besides the spawner's (`Settings`), in groups by the process that reads them.

Plain (no pydantic): a job pod's or task's process imports these at start. Each field is read when it is
read (see `fields`), so these groups can be made anywhere, cheaply, for ``os.environ`` or a mapping.
"""

from __future__ import annotations

import math
import os

from . import names as n
from .fields import Group, Var, byte_size, digits, flag_1, json_object, words

DEFAULT_AGENT_PORT = 8470
DEFAULT_RETENTION_S = 24 * 3600.0
DEFAULT_RESULT_WAIT_S = 600.0
DEFAULT_PAYLOAD_WAIT_S = 600.0
DEFAULT_POOL_SIZE = 4
DEFAULT_POOL_MEMORY = 3 * 2**30
DEFAULT_ACTIVITY_INTERVAL_S = 10.0
DEFAULT_HUB_PORT = 8000
# the lifeline grace's default and bounds (Settings): the spawner's lifeline_grace_seconds takes the same
LIFELINE_GRACE_S, LIFELINE_GRACE_MIN_S, LIFELINE_GRACE_MAX_S = 60, 15, 3600


def _on_unless_0(raw: str) -> bool:
    return raw != "0"


_on_unless_0.__name__ = "bool"


class KernelSettings(Group):
    """The admin's knobs for a notebook server's kernels and their local jobs (set in the server's
    environment, e.g. the spawner's `environment`; none is required)."""

    title = "Notebook server: the admin's knobs"
    reader = "Read by the kernel (`%%tfdist`, `%tfdist plan`) and its local job processes."
    broken = "This server's tfdist settings are broken"

    result_retention_s = Var(
        n.ENV_RESULT_RETENTION_S,
        float,
        DEFAULT_RETENTION_S,
        "Seconds a detached job's results wait to be attached (both backends); a bad or out-of-range "
        "value falls back to the default rather than keeping results forever or deleting them at once.",
        gt=0,
        lt=math.inf,
        fallback=True,
    )
    isolation = Var(
        n.ENV_ISOLATION,
        str,
        "netns",
        "Local jobs' network isolation: `netns` (a private network namespace) or `none` (trusted "
        "networks only); another value refuses to start a job, with the reason.",
    )
    pool_size = Var(
        n.ENV_POOL_SIZE,
        digits,
        DEFAULT_POOL_SIZE,
        "Warm pooled processes per server, all kernels together; 0 turns the pool off. Not a whole "
        "number: the default.",
        ge=0,
        fallback=True,
    )
    pool_memory = Var(
        n.ENV_POOL_MEMORY,
        byte_size,
        DEFAULT_POOL_MEMORY,
        "Bytes (or 2Gi, 1500Mi) the pooled processes of a server may hold. Not a size: the default.",
        fallback=True,
    )
    pool_on_load = Var(
        n.ENV_POOL_ON_LOAD,
        _on_unless_0,
        True,
        "`%load_ext tfdist` starts the kernel's warm pool at once (local backend, within the pool's "
        "bounds), so its first job is forked from TensorFlow imported meanwhile; `0`: the pool starts "
        "after its first job (any other value keeps it on).",
    )
    fork_tasks = Var(
        n.ENV_FORK_TASKS,
        _on_unless_0,
        True,
        "Local tasks, and `%tfdist plan`'s helpers, fork from a process that imported TensorFlow once; "
        "`0`: every one is a fresh process (any other value keeps forking).",
    )
    probe_seconds = Var(
        n.ENV_PROBE_SECONDS, float, 4.0, "`%tfdist plan`: the longest the probe measures steps.", gt=0
    )
    plan_nodes = Var(
        n.ENV_PLAN_NODES, int, 2, "`%tfdist plan` on Kubernetes: nodes to plan for (`--nodes` wins).", ge=1
    )
    plan_gpus_per_node = Var(
        n.ENV_PLAN_GPUS_PER_NODE,
        int,
        0,
        "`%tfdist plan`: GPUs per node (`--gpus-per-node` wins); 0: this server's GPUs.",
        ge=0,
    )
    plan_bandwidth = Var(
        n.ENV_PLAN_BANDWIDTH,
        str,
        None,
        "`%tfdist plan`: network bandwidth per node, e.g. 10Gbps (`--bandwidth` wins); unset: the "
        "backend's typical one. A bad value is refused when plan runs.",
        type_name="str",
    )
    agent_port = Var(
        n.ENV_AGENT_PORT,
        int,
        DEFAULT_AGENT_PORT,
        "Kubernetes: the port of each job's coordinator agent (read when the kernel starts; the pods "
        "are told).",
        ge=1,
        le=65535,
    )


class TaskSettings(Group):
    """What tfdist tells a job's own processes (supervisor, coordinator, tasks, pods) through their
    environment. Never set by hand: the names and meanings are the wire between a kernel and a job image."""

    title = "A job's processes and pods"
    reader = (
        "Written by the kernel, the local supervisor or the Kubernetes manifests; read by the job's "
        "processes and pods. Listed so that a job image of another version can be checked against them."
    )
    broken = "This job's tfdist settings are broken (a job image of another tfdist version?)"

    task = Var(
        n.ENV_TASK,
        str,
        None,
        "This task's name (`worker-1`, `chief-0`); unset: the role the process was started as.",
        type_name="str",
    )
    strategy = Var(n.ENV_STRATEGY, str, "ps", "The job's tf.distribute strategy: `ps` or `allreduce`.")
    cluster = Var(
        n.ENV_CLUSTER,
        json_object,
        None,
        "Pods: the cluster spec, role to addresses; each pod builds TF_CONFIG from it and its Job index.",
    )
    events_fd = Var(
        n.ENV_EVENTS_FD,
        int,
        None,
        "The coordinator's pipe to its supervisor (one JSON event per line).",
        ge=0,
    )
    heartbeat_s = Var(
        n.ENV_HEARTBEAT_S,
        float,
        2.0,
        "Seconds between the coordinator's reads of steps done during a fit.",
        gt=0,
    )
    netns = Var(
        n.ENV_NETNS, flag_1, False, "`1`: the supervisor runs in its own network namespace (brings up lo)."
    )
    checkpoint_every = Var(
        n.ENV_CHECKPOINT_EVERY,
        int,
        None,
        "`--checkpoint-every`: steps between checkpoints, so that a lost PS resumes from one.",
        ge=1,
    )
    checkpoint_dir = Var(
        n.ENV_CHECKPOINT_DIR, str, None, "Where the coordinator keeps those checkpoints.", type_name="str"
    )
    token = Var(
        n.ENV_TOKEN,
        str,
        None,
        "Kubernetes: the job's secret for its agent (from the job's Secret); chief-0 needs it.",
        type_name="str",
    )
    agent_url = Var(n.ENV_AGENT_URL, str, "", "Kubernetes: chief-0's agent, as the other pods reach it.")
    agent_port = Var(
        n.ENV_AGENT_PORT,
        int,
        DEFAULT_AGENT_PORT,
        "Kubernetes: the port chief-0's agent listens on.",
        ge=1,
        le=65535,
    )
    payload_wait_s = Var(
        n.ENV_PAYLOAD_WAIT_S,
        float,
        DEFAULT_PAYLOAD_WAIT_S,
        "Kubernetes: seconds chief-0 waits for the cell; the other pods give up a minute after.",
        gt=0,
    )
    result_wait_s = Var(
        n.ENV_RESULT_WAIT_S,
        float,
        DEFAULT_RESULT_WAIT_S,
        "Kubernetes: seconds a finished chief-0 keeps its results for the notebook (detached jobs: the "
        "retention).",
        ge=0,
    )
    server_pid = Var(
        n.ENV_SERVER_PID,
        int,
        None,
        "Local jobs: the notebook server's process, for the memory guard. In the job's launch.json, "
        "not in a process's environment.",
        ge=1,
    )


class LabSettings(Group):
    """The lab server extension's (GPU activity for the culler and the admins' page)."""

    title = "Lab server"
    reader = "Read by the Jupyter server extension; the spawner writes the report URL."
    broken = "This server's tfdist settings are broken"

    activity_interval_s = Var(
        n.ENV_GPU_ACTIVITY_INTERVAL,
        float,
        DEFAULT_ACTIVITY_INTERVAL_S,
        "Seconds between GPU activity samples. Bad or out of range: the default.",
        ge=0.05,
        le=3600,
        fallback=True,
    )
    gpu_admin_url = Var(
        n.ENV_GPU_ADMIN_URL,
        str,
        None,
        "Where the server pushes its GPU activity (the spawner's `gpu_admin_report_url`); unset: nowhere.",
        type_name="str",
    )


class HubSettings(Group):
    """The embedded hub's (`tfdist-local-hub` and `TfdistLocalSpawner`)."""

    title = "Embedded hub"
    reader = (
        "Read by `tfdist-local-hub` (defaults of its flags), `TfdistLocalSpawner` and "
        "`hub_config/local_hub_config.py`."
    )
    broken = "The hub's tfdist settings are broken"

    port = Var(n.ENV_HUB_PORT, int, DEFAULT_HUB_PORT, "`tfdist-local-hub --port`'s default.", ge=1, le=65535)
    state_dir = Var(
        n.ENV_HUB_STATE_DIR,
        str,
        None,
        "The hub's database, cookie secret and users' folders (`users/<name>`).",
        type_name="str",
        default_text="~/.local/share/tfdist-hub",
    )
    password = Var(
        n.ENV_HUB_PASSWORD,
        str,
        None,
        "`tfdist-local-hub --password`'s default: the users' shared password; unset: generated, printed.",
        type_name="str",
    )
    profiles = Var(
        n.ENV_PROFILES,
        str,
        None,
        "`hub_config/local_hub_config.py`: the profiles YAML; unset: the packaged single-machine profiles.",
        type_name="str",
    )

    def state_base(self) -> str:
        return self.state_dir or os.path.join(os.path.expanduser("~"), ".local", "share", "tfdist-hub")


class KubeHubSettings(Group):
    """The Kubernetes hub's config file (`hub_config/jupyterhub_config.py`, or z2jh's `hub.extraConfig`)."""

    title = "Kubernetes hub"
    reader = (
        "Read by `hub_config/jupyterhub_config.py` when JupyterHub loads it (z2jh: `hub.extraEnv`), "
        "which hands them to `TfdistKubeSpawner` and the GPU admin service."
    )
    broken = "The hub's tfdist settings are broken"

    profiles = Var(
        n.ENV_PROFILES,
        str,
        None,
        "The profiles YAML; unset: `profiles.yaml` next to the config file.",
        type_name="str",
    )
    worker_image = Var(
        n.ENV_WORKER_IMAGE,
        str,
        "",
        "Image of `%%tfdist` pods (`c.TfdistKubeSpawner.worker_image`); unset: the notebook's own image.",
    )
    egress_api_server = Var(
        n.ENV_EGRESS_API_SERVER,
        words,
        (),
        "The API server as user namespaces' pods reach it, `ADDRESS:PORT` each "
        "(`c.TfdistKubeSpawner.egress_api_server`); unset: the hub's own API server address, which a "
        "hub in a pod cannot see.",
    )
    egress_deny = Var(
        n.ENV_EGRESS_DENY,
        words,
        (),
        "IPv4 addresses or CIDRs user pods may not reach as the internet, space-separated "
        "(`c.TfdistKubeSpawner.egress_deny`): the nodes' public addresses, pod or Service ranges outside "
        "the private ones.",
    )
    gpu_admin = Var(
        n.ENV_GPU_ADMIN,
        _on_unless_0,
        True,
        "`0`: no GPU admin service (GPU-idle culling, the admins' GPU page, metrics); any other value "
        "keeps it.",
    )
    gpu_admin_public_url = Var(
        n.ENV_GPU_ADMIN_PUBLIC_URL,
        str,
        "http://proxy-public",
        "How notebook servers reach the GPU admin service: the proxy's URL.",
    )
    gpu_admin_host = Var(
        n.ENV_GPU_ADMIN_HOST, str, "hub", "How the proxy reaches the GPU admin service: the hub's Service."
    )
    gpu_admin_report_url = Var(
        n.ENV_GPU_ADMIN_REPORT_URL,
        str,
        None,
        "The whole URL servers push their GPU activity to; unset: the public URL's service path.",
        type_name="str",
    )


class AdminSettings(Group):
    """The GPU admin service's (`python -m tfdist.hubadmin`), written by `hubadmin.hubconfig`."""

    title = "GPU admin service"
    reader = "Read by `python -m tfdist.hubadmin`; `tfdist.hubadmin.hubconfig.enable_gpu_admin` writes them."
    broken = "The GPU admin service's settings are broken"

    profiles = Var(n.ENV_PROFILES, str, "", "The profiles YAML (its `gpu_admin` section).", required=True)
    bind = Var(
        n.ENV_GPU_ADMIN_BIND,
        str,
        None,
        "Address to listen on; unset: the host of the service's URL.",
        type_name="str",
    )
    period_s = Var(
        n.ENV_GPU_ADMIN_PERIOD,
        float,
        None,
        "Seconds between checks, and servers' reports; unset: the culling rule's interval, else 30.",
        gt=0,
    )
    local_gpus = Var(
        n.ENV_GPU_ADMIN_LOCAL_GPUS, flag_1, False, "`1`: list this machine's GPUs (an embedded hub)."
    )


GROUPS: tuple[type[Group], ...] = (
    KernelSettings,
    TaskSettings,
    LabSettings,
    HubSettings,
    KubeHubSettings,
    AdminSettings,
)
__all__ = [
    "GROUPS",
    "AdminSettings",
    "HubSettings",
    "KernelSettings",
    "KubeHubSettings",
    "LabSettings",
    "TaskSettings",
]
