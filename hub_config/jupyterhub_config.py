"""JupyterHub config for the Kubernetes hub with the tfdist GPU spawn form.

Use it as the hub's config file (``jupyterhub -f hub_config/jupyterhub_config.py``) or paste the part
below the marker into z2jh's ``hub.extraConfig`` (hub_config/values.yaml does that). Settings come from
the environment so one file serves every deployment, read through `tfdist.settings.KubeHubSettings`
(TFDIST_PROFILES, TFDIST_WORKER_IMAGE, TFDIST_EGRESS_API_SERVER, TFDIST_EGRESS_DENY, TFDIST_GPU_ADMIN*;
every one with its default in docs/configuration.md). Notebook pods run as the spawner's service account,
`tfdist-notebook`, which it creates with its Role in each user namespace.

A broken profiles file stops the hub here with "file: key: reason" lines (exit status 2).
"""

import os

from tfdist.settings import KubeHubSettings
from tfdist.spawner.hubroles import shared_origin_warning
from tfdist.spawner.profiles import load_profiles_or_exit

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

# ---- tfdist (z2jh: hub.extraConfig) ------------------------------------------------------------------
hub_settings = KubeHubSettings()
PROFILES = hub_settings.profiles or os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles.yaml")
load_profiles_or_exit(PROFILES)

c.JupyterHub.spawner_class = "tfdist.spawner.kube.TfdistKubeSpawner"
c.TfdistKubeSpawner.profiles_file = PROFILES
c.TfdistKubeSpawner.worker_image = hub_settings.worker_image
c.TfdistKubeSpawner.egress_api_server = list(hub_settings.egress_api_server)
c.TfdistKubeSpawner.egress_deny = list(hub_settings.egress_deny)
# free GPUs per model in the form: one cluster-wide node+pod watch (RBAC: rbac-hub-gpu-view.yaml)
c.TfdistKubeSpawner.gpu_availability_enabled = True
# kubespawner's own profile_list stays empty: the tfdist form replaces it
c.KubeSpawner.profile_list = []
# named servers: the per-user GPU cap counts GPUs across all of a user's servers
c.JupyterHub.allow_named_servers = True
c.JupyterHub.named_server_limit_per_user = 3
# bad spawn input is a 400 ("handled rejection"), so this counts only real spawn failures
c.JupyterHub.consecutive_failure_limit = 5
# GPU images are large: give the first pull time
c.KubeSpawner.start_timeout = 600
# users' servers share the hub's origin unless JupyterHub.subdomain_host is set: an admin who opens one runs
# its user's code as the admin (docs/security.md); said in the hub's log at every start
if warning := shared_origin_warning(c):
    print(warning)

# ---- tfdist GPU admin service: GPU-idle culling (the profiles' gpu_admin section), the admin page at
# /services/tfdist-gpu-admin/ and Prometheus metrics there (dashboard: grafana-gpu-dashboard.json).
# z2jh: expose port 10101 of the hub (hub.service.extraPorts, hub.networkPolicy.ingress for the proxy).
# Notebook servers push their GPU activity to it through the proxy (TFDIST_GPU_ADMIN_PUBLIC_URL, or the
# whole URL in TFDIST_GPU_ADMIN_REPORT_URL): singleuser egress must reach proxy-public.
if hub_settings.gpu_admin:
    from tfdist.hubadmin.hubconfig import enable_gpu_admin

    enable_gpu_admin(
        c,
        profiles=PROFILES,
        public_url=hub_settings.gpu_admin_public_url,
        ip=hub_settings.gpu_admin_host,
        bind_ip="0.0.0.0",
        port=10101,
        servers_report_to=hub_settings.gpu_admin_report_url,
    )
