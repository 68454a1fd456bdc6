"""Every ``TFDIST_*`` variable tfdist reads, by name: the wire between the spawner, the kernel, the job's
processes and pods, and the hub's services.

Older kernels and job images write and read these exact names: never rename one. Only tfdist.settings
reads them from an environment; other modules import a name here to write it for a child process.
"""

# The notebook server, written by the spawner (Settings).
ENV_BACKEND = "TFDIST_BACKEND"  # "local" (default) or "kubernetes"
ENV_NAMESPACE = "TFDIST_NAMESPACE"  # Kubernetes namespace for job objects
ENV_WORKER_IMAGE = "TFDIST_WORKER_IMAGE"  # image of PS/worker/coordinator pods
ENV_GPUS = "TFDIST_GPUS"  # number of GPUs this server was given (the magic's default GPUs per worker)
ENV_GPU_MODEL = "TFDIST_GPU_MODEL"  # GPU model key of the profile: for the user's own code, tfdist reads none
ENV_POD_NAME = "TFDIST_POD_NAME"  # the notebook pod (owner of job objects), via the downward API
ENV_POD_UID = "TFDIST_POD_UID"
ENV_KUEUE_QUEUE = "TFDIST_KUEUE_QUEUE"  # optional Kueue LocalQueue name
ENV_GPU_NODE_SELECTOR = "TFDIST_GPU_NODE_SELECTOR"  # JSON: node selector of the GPU model (workers' pods)
ENV_GPU_TOLERATIONS = "TFDIST_GPU_TOLERATIONS"  # JSON list: tolerations of the GPU model
ENV_GPU_RESOURCE = "TFDIST_GPU_RESOURCE"  # extended resource of the GPU model (nvidia.com/mig-1g.10gb, ...)
ENV_USER = "TFDIST_USER"  # the hub user name (labels); falls back to JUPYTERHUB_USER / $USER
ENV_STATE_DIR = "TFDIST_STATE_DIR"  # where local jobs keep sockets, logs and results
ENV_LIFELINE_GRACE_S = "TFDIST_LIFELINE_GRACE_S"  # kernel gone this long: the cluster ends its attached jobs
ENV_DATA_VOLUMES = "TFDIST_DATA_VOLUMES"  # JSON list: the profile's data volumes {claim, mount, read_only}
ENV_POD_IDENTITY = "TFDIST_POD_IDENTITY"  # JSON: the notebook's user and groups (job pods')

# The notebook server, set by the admin (KernelSettings).
ENV_RESULT_RETENTION_S = "TFDIST_RESULT_RETENTION_S"
ENV_ISOLATION = "TFDIST_ISOLATION"
ENV_POOL_SIZE = "TFDIST_POOL_SIZE"
ENV_POOL_MEMORY = "TFDIST_POOL_MEMORY"
ENV_POOL_ON_LOAD = "TFDIST_POOL_ON_LOAD"
ENV_FORK_TASKS = "TFDIST_FORK_TASKS"
ENV_PROBE_SECONDS = "TFDIST_PROBE_SECONDS"
ENV_PLAN_NODES = "TFDIST_PLAN_NODES"
ENV_PLAN_GPUS_PER_NODE = "TFDIST_PLAN_GPUS_PER_NODE"
ENV_PLAN_BANDWIDTH = "TFDIST_PLAN_BANDWIDTH"
ENV_AGENT_PORT = "TFDIST_AGENT_PORT"  # also the pods' (TaskSettings)

# A job's own processes and pods, written by tfdist (TaskSettings).
ENV_TASK = "TFDIST_TASK"
ENV_STRATEGY = "TFDIST_STRATEGY"
ENV_CLUSTER = "TFDIST_CLUSTER"
ENV_EVENTS_FD = "TFDIST_EVENTS_FD"
ENV_HEARTBEAT_S = "TFDIST_HEARTBEAT_S"
ENV_NETNS = "TFDIST_NETNS"
ENV_CHECKPOINT_EVERY = "TFDIST_CHECKPOINT_EVERY"
ENV_CHECKPOINT_DIR = "TFDIST_CHECKPOINT_DIR"
ENV_TOKEN = "TFDIST_TOKEN"
ENV_AGENT_URL = "TFDIST_AGENT_URL"
ENV_PAYLOAD_WAIT_S = "TFDIST_PAYLOAD_WAIT_S"
ENV_RESULT_WAIT_S = "TFDIST_RESULT_WAIT_S"
ENV_SERVER_PID = "TFDIST_SERVER_PID"  # in a local job's launch environment, not the process's

# The lab server (LabSettings).
ENV_GPU_ACTIVITY_INTERVAL = "TFDIST_GPU_ACTIVITY_INTERVAL"
ENV_GPU_ADMIN_URL = "TFDIST_GPU_ADMIN_URL"

# The embedded hub (HubSettings) and the GPU admin service (AdminSettings).
ENV_HUB_PORT = "TFDIST_HUB_PORT"
ENV_HUB_STATE_DIR = "TFDIST_HUB_STATE_DIR"
ENV_HUB_PASSWORD = "TFDIST_HUB_PASSWORD"
ENV_PROFILES = "TFDIST_PROFILES"
ENV_GPU_ADMIN_BIND = "TFDIST_GPU_ADMIN_BIND"
ENV_GPU_ADMIN_PERIOD = "TFDIST_GPU_ADMIN_PERIOD"
ENV_GPU_ADMIN_LOCAL_GPUS = "TFDIST_GPU_ADMIN_LOCAL_GPUS"

# The Kubernetes hub's config file (hub_config/jupyterhub_config.py; z2jh: hub.extraEnv), KubeHubSettings.
ENV_EGRESS_API_SERVER = "TFDIST_EGRESS_API_SERVER"  # the API server as user namespaces' pods reach it
ENV_EGRESS_DENY = "TFDIST_EGRESS_DENY"  # IPv4 addresses user pods may not reach as the internet
ENV_GPU_ADMIN = "TFDIST_GPU_ADMIN"  # "0": no GPU admin service
ENV_GPU_ADMIN_PUBLIC_URL = "TFDIST_GPU_ADMIN_PUBLIC_URL"
ENV_GPU_ADMIN_HOST = "TFDIST_GPU_ADMIN_HOST"
ENV_GPU_ADMIN_REPORT_URL = "TFDIST_GPU_ADMIN_REPORT_URL"
