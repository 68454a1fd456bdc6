"""The zero-to-jupyterhub chart on the one-machine cluster (``scripts/cluster hub``; the z2jh real-node test).

What runs is the admin's recipe of hub_config/values.yaml (namespace, admission policy, the hub's tenancy and
GPU-view RBAC, ``helm upgrade --install`` of the vendored z2jh 4.4.0 chart with the values and
``--set-file`` of the profiles) plus only what this machine needs, as a second values file:

* images built here (``scripts/build-images hub proxy notebook job --import``; quay.io cannot be reached),
  never pulled; the profiles' notebook images replaced by the local notebook image and their CPU default by
  their minimum (two cores hold the hub, the proxy, a notebook and its %%tfdist pods);
* the API server's address as user namespaces' pods reach it (``TFDIST_EGRESS_API_SERVER``);
* the hub's database on a hostPath PersistentVolume (no storage provisioner here; the hub keeps its users and
  running servers across ``helm upgrade``), notebooks without a volume, proxy-public a ClusterIP (no load
  balancer);
* a shared-password login (JupyterHub's SharedPasswordAuthenticator) with one admin, ``admin``;
* off: the user scheduler and its placeholders (kube-scheduler and pause images of registry.k8s.io), the
  image pullers (already off in values.yaml).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests import kube_plane, realnode

REPO = realnode.REPO
SHARED = Path(os.environ.get("TFDIST_SHARED") or REPO.parent / "shared")
CHART = SHARED / "vendor" / "z2jh-4.4.0" / "jupyterhub"
RELEASE = NAMESPACE = "jhub"
VALUES = REPO / "hub_config" / "values.yaml"
PROFILES = REPO / "hub_config" / "profiles.yaml"
TENANCY_RBAC = ("rbac-hub-tenancy.yaml", "rbac-hub-gpu-view.yaml", "flowcontrol.yaml")
ADMIN = "admin"
IMAGES = ("hub", "proxy", "notebook", "job")
DB_PV = "tfdist-jhub-hub-db"
DB_DIR = realnode.VARLIB / "hub-db"  # removed by scripts/cluster down
HUB_UID = 1000  # z2jh runs the hub as 1000 (hub.containerSecurityContext)
SECRETS = "z2jh-hub.json"  # passwords, in the cluster's private state directory


class HubError(realnode.ClusterError):
    """The chart could not be deployed (the message says which step and why)."""


@dataclass(frozen=True)
class Images:
    hub: str
    proxy: str
    notebook: str
    job: str


@dataclass(frozen=True)
class Hub:
    url: str  # proxy-public, as this machine reaches it
    password: str  # every user's (shared password)
    admin_password: str  # the admin user's
    profiles: str  # the profiles YAML the hub was given (this machine's version of hub_config/profiles.yaml)

    def export_lines(self) -> str:
        return (
            f"export TFDIST_HUB_URL={self.url}\n"
            f"export TFDIST_HUB_PASSWORD={self.password}\n"
            f"export TFDIST_HUB_ADMIN_PASSWORD={self.admin_password}\n"
            f"# log in as any name with TFDIST_HUB_PASSWORD, as {ADMIN} with TFDIST_HUB_ADMIN_PASSWORD "
            "(the GPU page: /services/tfdist-gpu-admin/)\n"
        )


# ------------------------------------------------------------------------------------- pure parts


def split_ref(ref: str) -> tuple[str, str]:
    """localhost/tfdist-hub:hub-abc -> (localhost/tfdist-hub, hub-abc)."""
    name, _, tag = ref.rpartition(":")
    if not name or "/" in tag:
        raise ValueError(f"image reference without a tag: {ref!r}")
    return name, tag


def local_values(images: Images, api_endpoints: list[str], password: str, admin_password: str) -> dict:
    """What this machine adds to hub_config/values.yaml (helm merges it over the recipe)."""

    def image(ref: str) -> dict:
        name, tag = split_ref(ref)
        return {"name": name, "tag": tag, "pullPolicy": "Never"}

    return {
        "hub": {
            "image": image(images.hub),
            "extraEnv": {
                "TFDIST_WORKER_IMAGE": images.job,
                "TFDIST_EGRESS_API_SERVER": " ".join(api_endpoints),
            },
            "config": {
                "JupyterHub": {"authenticator_class": "shared-password"},
                "Authenticator": {"admin_users": [ADMIN], "allow_all": True},
                "SharedPasswordAuthenticator": {"user_password": password, "admin_password": admin_password},
            },
        },
        "proxy": {
            "chp": {"image": image(images.proxy)},
            "service": {"type": "ClusterIP"},
        },
        # no storage provisioner here: notebooks keep their files in the pod (a real cluster keeps z2jh's
        # dynamic per-user volume)
        "singleuser": {"image": image(images.notebook), "storage": {"type": "none"}},
        "scheduling": {"userScheduler": {"enabled": False}, "userPlaceholder": {"enabled": False}},
        "prePuller": {"hook": {"enabled": False}, "continuous": {"enabled": False}},
    }


def local_profiles(text: str, notebook_image: str) -> str:
    """hub_config/profiles.yaml for this machine: every profile offers the local notebook image, and its
    CPU default is its minimum (a 2-core node)."""
    doc = yaml.safe_load(text)
    for p in doc.get("profiles", []):
        p["images"] = [{"image": notebook_image, "display_name": "tfdist notebook (this machine)"}]
        p.pop("custom_image", None)
        if "cpu" in p and "min" in p["cpu"]:
            p["cpu"]["default"] = p["cpu"]["min"]
    return yaml.safe_dump(doc, sort_keys=False)


def db_volume(path: Path) -> dict:
    """A hostPath PV that only the chart's hub-db-dir claim binds."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": DB_PV},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "claimRef": {"namespace": NAMESPACE, "name": "hub-db-dir"},
            "hostPath": {"path": str(path), "type": "Directory"},
        },
    }


def tenancy_manifests(namespace: str = NAMESPACE) -> str:
    """The recipe's `sed 's/NAMESPACE/jhub/' hub_config/{rbac-hub-*,flowcontrol}.yaml`."""
    return "\n---\n".join(
        (REPO / "hub_config" / f).read_text().replace("NAMESPACE", namespace) for f in TENANCY_RBAC
    )


# ---------------------------------------------------------------------------------------------- I/O


def helm_bin() -> Path:
    out = subprocess.run([str(REPO / "scripts" / "build-helm")], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise HubError(f"scripts/build-helm failed:\n{out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1]) / "helm"


def build_images() -> Images:
    """This checkout's images in the node's containerd (cached by a hash of their inputs)."""
    out = subprocess.run(
        [str(REPO / "scripts" / "build-images"), *IMAGES, "--import"],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        raise HubError(f"scripts/build-images {' '.join(IMAGES)} --import failed:\n{out.stderr[-3000:]}")
    refs = {}
    for line in out.stdout.splitlines():  # name, ref, archive, size
        parts = line.split("\t")
        if len(parts) == 4:
            refs[parts[0]] = parts[1]
    return Images(**{name: refs[name] for name in IMAGES})


def _tool(state: dict, *cmd: str, input: str | None = None, timeout: float = 120) -> str:
    env = {**os.environ, "KUBECONFIG": state["kubeconfig"], "PATH": realnode.ENV_PATH}
    p = subprocess.run(list(cmd), capture_output=True, text=True, input=input, env=env, timeout=timeout)
    if p.returncode != 0:
        raise HubError(f"{' '.join(cmd[:4])} ... failed ({p.returncode}):\n{(p.stderr or p.stdout)[-3000:]}")
    return p.stdout


def kubectl(state: dict, *args: str, input: str | None = None, timeout: float = 120) -> str:
    return _tool(state, state["kubectl"], *args, input=input, timeout=timeout)


def passwords() -> tuple[str, str]:
    """The cluster's hub passwords (made at the first deploy; gone with the cluster)."""
    path = realnode.STATE / SECRETS
    if path.exists():
        d = json.loads(path.read_text())
        return d["password"], d["admin_password"]
    d = {"password": secrets.token_urlsafe(12), "admin_password": secrets.token_urlsafe(32)}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(d, f)
    return d["password"], d["admin_password"]


def proxy_url(state: dict) -> str:
    svc = json.loads(kubectl(state, "-n", NAMESPACE, "get", "service", "proxy-public", "-o", "json"))
    return f"http://{svc['spec']['clusterIP']}"


def wait_answering(url: str, timeout: float = 300) -> float:
    """Until the hub answers through the proxy (its API root: 200 with the version)."""
    t0 = time.monotonic()
    last: object = None
    while time.monotonic() - t0 < timeout:
        try:
            with urllib.request.urlopen(f"{url}/hub/api/", timeout=5) as r:
                if r.status == 200 and "version" in json.loads(r.read()):
                    return time.monotonic() - t0
        except (OSError, urllib.error.URLError, ValueError) as e:
            last = e
        time.sleep(1)
    raise HubError(f"the hub did not answer at {url}/hub/api/ within {timeout:.0f} s (last: {last!r})")


def deploy(state: dict, profiles: str | None = None, images: Images | None = None) -> Hub:
    """The recipe, idempotently (helm upgrade --install): `profiles` replaces hub_config/profiles.yaml's
    text (what an admin's edit of the file is); `images` skips the build."""
    if not CHART.joinpath("Chart.yaml").is_file():
        raise HubError(f"the z2jh 4.4.0 chart is missing at {CHART} (shared/ beside the checkout)")
    t0 = time.monotonic()
    images = images or build_images()
    helm = helm_bin()
    realnode.log(f"images ready ({time.monotonic() - t0:.0f} s)")
    # the recipe: namespace, what users may create, the hub's rights in user namespaces
    kubectl(
        state,
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}),
    )
    kubectl(state, "apply", "-f", str(REPO / "hub_config" / "admission-policy.yaml"))
    kubectl(state, "apply", "-f", "-", input=tenancy_manifests())
    # what this machine needs
    DB_DIR.mkdir(parents=True, exist_ok=True)
    os.chown(DB_DIR, HUB_UID, HUB_UID)
    os.chmod(DB_DIR, 0o700)
    kubectl(state, "apply", "-f", "-", input=yaml.safe_dump(db_volume(DB_DIR)))
    password, admin_password = passwords()
    api = [f"{state['node_ip']}:{state['api_port']}"]
    local = realnode.STATE / "z2jh-local-values.yaml"
    local.write_text(yaml.safe_dump(local_values(images, api, password, admin_password)))
    os.chmod(local, 0o600)
    text = local_profiles(profiles if profiles is not None else PROFILES.read_text(), images.notebook)
    prof = realnode.STATE / "z2jh-profiles.yaml"
    prof.write_text(text)
    t1 = time.monotonic()
    _tool(
        state,
        str(helm),
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--values",
        str(VALUES),
        "--values",
        str(local),
        "--set-file",
        f"hub.extraFiles.tfdist-profiles.stringData={prof}",
        "--wait",
        "--timeout",
        "10m",
        timeout=700,
    )
    realnode.log(f"helm upgrade --install done ({time.monotonic() - t1:.0f} s)")
    url = proxy_url(state)
    wait_answering(url)
    realnode.log(f"the hub answers at {url} ({time.monotonic() - t0:.0f} s in all)")
    return Hub(url, password, admin_password, text)


def release_images(state: dict) -> Images:
    """The images the installed release runs (`helm get values`: what this machine added)."""
    v = json.loads(_tool(state, str(helm_bin()), "get", "values", RELEASE, "-n", NAMESPACE, "-o", "json"))

    def ref(image: dict) -> str:
        return f"{image['name']}:{image['tag']}"

    return Images(
        hub=ref(v["hub"]["image"]),
        proxy=ref(v["proxy"]["chp"]["image"]),
        notebook=ref(v["singleuser"]["image"]),
        job=v["hub"]["extraEnv"]["TFDIST_WORKER_IMAGE"],
    )


def uninstall(state: dict) -> None:
    """`helm uninstall`, and this machine's volume of the hub's database (its claim goes with the release)."""
    _tool(state, str(helm_bin()), "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", timeout=300)
    kubectl(state, "delete", "persistentvolume", DB_PV, "--ignore-not-found", "--wait=false")
    shutil.rmtree(
        DB_DIR, ignore_errors=True
    )  # a later install starts with a new database, as on a real cluster


def hub_cli() -> str:
    """`scripts/cluster hub`: the export lines."""
    if os.geteuid() != 0:
        raise realnode.ClusterError("must run as root (the cluster's admin credentials are root's)")
    state = realnode.load_state()
    realnode._running_api(state)
    kube_plane.private_dir(realnode.STATE)
    return deploy(state).export_lines()
