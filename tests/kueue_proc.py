"""Kueue's manager as a plain process against a test plane (a tests/kube_plane.py ControlPlane).

The binary comes from ``scripts/build-k8s --kueue`` (Go module k8s/modules/kueue, cached outside the
checkout, with the module's own ``config/`` beside it). Its CRDs and webhook configurations are the
module's own manifests; only what kustomize and the release's Deployment would fill in differs: the
webhooks' and conversion's ``clientConfig`` is a URL on this host (the API server calls the manager
process here) with the CA of a serving certificate made here, instead of a Service in kueue-system.

    kueue = KueueProcess(plane).start()       # CRDs, process, webhooks: 8-28 s on 2 busy cores
    ... pods labelled kueue.x-k8s.io/queue-name get Kueue's scheduling gate ...
    kueue.stop()

Its visibility API (a user's place in line among every user's jobs) is served as in the release, behind an
APIService, where the plane's API server has aggregation (tests/kube_plane.py): the server listens on this
host's non-loopback address (the API server dials the endpoint itself and refuses loopback), with a
serving certificate for its Service's name in Kueue's fixed /visibility (`visibility_cert`).

The plane's admin credentials are system:masters, so no RBAC is installed. Kueue runs with the ``pod``
integration only: a ``%%tfdist run`` job is admitted as one pod group (tfdist.kube.queueing), and the
batch/Job integration would manage each of its Jobs on its own (docs/queueing.md).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import fcntl
import ipaddress
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.kube_plane import (
    REPO,
    ControlPlane,
    ControlPlaneError,
    _die_with_parent,
    go_env,
    private_dir,
    write_private,
)

KUEUE_NS = "kueue-system"
# Kueue's internal certificate management: its defaults (the release's names), kept so that it finds and
# keeps the Secret made here
WEBHOOK_SERVICE = "kueue-webhook-service"
WEBHOOK_SECRET = "kueue-webhook-server-cert"
WEBHOOK_DNS = f"{WEBHOOK_SERVICE}.{KUEUE_NS}.svc"
CA_NAME = "kueue-ca"
GATE = "kueue.x-k8s.io/admission"  # the scheduling gate Kueue's pod webhook adds
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# waitForPodsReady's timeout: an admitted group whose pods do not all run by then is evicted and requeued
WAIT_FOR_PODS_READY_S = 300
# Admission Fair Sharing for the queues that ask for it (admissionScope): a LocalQueue's usage is sampled
# every second (Kueue's default, 5 min, is for days of jobs, not seconds) and halves in a minute; GPUs
# only count (cpu and memory in bytes would drown them), so a user who held GPUs lately waits behind one
# who did not
FAIR_SHARING: dict[str, Any] = {
    "usageHalfLifeTime": "60s",
    "usageSamplingInterval": "1s",
    "resourceWeights": {"nvidia.com/gpu": 1.0, "cpu": 0.0, "memory": 0.0, "ephemeral-storage": 0.0},
}
FRAMEWORKS = ("pod",)
# Kueue's visibility API (the place in line a user may read): the release's names. v0.17.0's server reads
# its serving certificate from this fixed path (it writes a self-signed one for localhost there if none is
# readable: the tests run as root, so it may); the API server verifies it against the APIService's caBundle
# as VISIBILITY_DNS, so the one made here (`visibility_cert`) names that and is kept by Kueue
VISIBILITY_DIR = Path("/visibility")
VISIBILITY_SERVICE = "kueue-visibility-server"
VISIBILITY_DNS = f"{VISIBILITY_SERVICE}.{KUEUE_NS}.svc"
VISIBILITY_GROUP = "visibility.kueue.x-k8s.io"
VISIBILITY_VERSION = "v1beta2"
APISERVICE = f"{VISIBILITY_VERSION}.{VISIBILITY_GROUP}"
# Webhooks of an integration that is off: Kueue serves a no-op for most, but v0.17.0's batch/Job webhook
# ignores that option and panics on every Job (nil queue manager); so they are not installed when it is off
WEBHOOKS_OF = {"batch/job": ("mjob.kb.io", "vjob.kb.io")}


def kueue_bin_dir() -> Path:
    """$TFDIST_KUEUE_BIN, else where ``scripts/build-k8s --kueue`` puts (or would put) the manager."""
    env = os.environ.get("TFDIST_KUEUE_BIN")
    if env:
        return Path(env)
    out = subprocess.run(
        [str(REPO / "scripts" / "build-k8s"), "--kueue", "--print-bindir"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return Path(out.stdout.strip())


def kueue_missing(bin_dir: Path | None = None) -> str | None:
    """Why Kueue cannot run here (a sentence), or None."""
    d = bin_dir or kueue_bin_dir()
    if not os.access(d / "kueue", os.X_OK):
        return f"Kueue's manager is missing in {d} (run scripts/build-k8s --kueue)"
    if not (d.parent / "config" / "components" / "crd" / "bases").is_dir():
        return f"Kueue's manifests are missing in {d.parent / 'config'} (run scripts/build-k8s --kueue)"
    return None


# ------------------------------------------------------------------------------------ manifests (pure)


def load_crds(config_dir: Path) -> list[dict[str, Any]]:
    """The CRDs of config/components/crd (its kustomization's resources), with the conversion-webhook
    patches it lists applied (their clientConfig filled in later by `with_client_config`)."""
    crd_dir = config_dir / "components" / "crd"
    kust = yaml.safe_load((crd_dir / "kustomization.yaml").read_text())
    crds = {}
    for rel in kust["resources"]:
        crd = yaml.safe_load((crd_dir / rel).read_text())
        crd.pop("status", None)  # controller-gen writes an empty one; the API server owns it
        crds[crd["metadata"]["name"]] = crd
    for patch in kust.get("patches", []):
        p = yaml.safe_load((crd_dir / patch["path"]).read_text())
        crds[p["metadata"]["name"]]["spec"]["conversion"] = p["spec"]["conversion"]
    return list(crds.values())


def _merge_webhooks(doc: dict, patch: dict) -> None:
    by_name = {w["name"]: w for w in doc["webhooks"]}
    for w in patch.get("webhooks", []):
        by_name[w["name"]].update({k: v for k, v in w.items() if k != "name"})


def load_webhook_configurations(
    config_dir: Path, frameworks: tuple[str, ...] = FRAMEWORKS
) -> list[dict[str, Any]]:
    """The mutating and validating webhook configurations of config/components/webhook with its
    kustomization's patches (the namespaceSelector that leaves kube-system and kueue-system alone) and the
    release's name prefix, without the webhooks of integrations that are off and have no no-op
    (`WEBHOOKS_OF`)."""
    wh_dir = config_dir / "components" / "webhook"
    kust = yaml.safe_load((wh_dir / "kustomization.yaml").read_text())
    docs = [d for d in yaml.safe_load_all((wh_dir / "manifests.yaml").read_text()) if d]
    for patch in kust.get("patches", []):
        p = yaml.safe_load(patch["patch"])
        for d in docs:
            if d["kind"] == p["kind"] and d["metadata"]["name"] == p["metadata"]["name"]:
                _merge_webhooks(d, p)
    drop = {name for fw, names in WEBHOOKS_OF.items() if fw not in frameworks for name in names}
    for d in docs:
        d["metadata"]["name"] = "kueue-" + d["metadata"]["name"]
        d["webhooks"] = [w for w in d["webhooks"] if w["name"] not in drop]
    return docs


def with_client_config(obj: dict[str, Any], base_url: str, ca_pem: bytes) -> dict[str, Any]:
    """``obj`` (a webhook configuration or a CRD with a conversion webhook) calling ``base_url`` instead of
    the Service the release's kustomize points at, trusting ``ca_pem``."""
    out = copy.deepcopy(obj)
    ca = base64.b64encode(ca_pem).decode()

    def fix(cc: dict) -> dict:
        path = cc.get("service", {}).get("path", "/")
        return {"url": base_url + path, "caBundle": ca}

    if out["kind"] == "CustomResourceDefinition":
        hook = out["spec"].get("conversion", {}).get("webhook")
        if hook:
            hook["clientConfig"] = fix(hook["clientConfig"])
    else:
        for w in out["webhooks"]:
            w["clientConfig"] = fix(w["clientConfig"])
    return out


def manager_configuration(
    *,
    health_port: int,
    webhook_port: int,
    cert_dir: str,
    wait_for_pods_ready_s: int | None,
    fair_sharing: dict[str, Any] | None = None,
    visibility: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for a manager outside the cluster: webhook on
    127.0.0.1, its internal certificate management on (off, v0.17.0 reads the metrics certificate from the
    fixed path /etc/kueue/metrics/certs) with the Secret made here (`serving_pki`), no leader election, no
    metrics listener, the pod integration only, and waitForPodsReady (an admitted job whose pods do not all
    run within the timeout is evicted and requeued, so an admitted group never holds quota it cannot use),
    and ``fair_sharing`` as its ``admissionFairSharing`` (what ClusterQueues with an admissionScope use).
    ``visibility`` (address, port): the visibility server listens there; None: it is off."""
    cfg: dict[str, Any] = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NS,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": cert_dir},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": WEBHOOK_SERVICE,
            "webhookSecretName": WEBHOOK_SECRET,
        },
        "clientConnection": {"qps": 50, "burst": 100},
        "integrations": {"frameworks": list(FRAMEWORKS)},
        "manageJobsWithoutQueueName": False,
        # off where the API server cannot proxy to it (no aggregation): the positions come from the
        # Workloads then (tfdist.kube.queueing_apply.read_position)
        "featureGates": {"VisibilityOnDemand": visibility is not None},
    }
    if visibility is not None:
        cfg["visibilityServer"] = {"bindAddress": visibility[0], "bindPort": visibility[1]}
    if fair_sharing:
        cfg["admissionFairSharing"] = fair_sharing
    if wait_for_pods_ready_s:
        cfg["waitForPodsReady"] = {
            "timeout": f"{wait_for_pods_ready_s}s",
            "blockAdmission": False,
            "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 10, "backoffMaxSeconds": 60},
        }
    return cfg


# A kwok Stage for planes with Kueue: a deleted pod that still runs and holds a finalizer (Kueue's
# kueue.x-k8s.io/managed) ends as a kubelet would end it (containers killed: phase Failed, exit 143), so that
# Kueue sees it terminate, releases its finalizer and the group's quota. kwok's own pod-delete (weight 0)
# only deletes, which a finalizer holds forever; a positive weight makes kwok pick this stage first.
KWOK_STAGE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-end-on-delete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  weight: 1
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
    - key: '.metadata.finalizers'
      operator: 'Exists'
    - key: '.status.phase'
      operator: 'In'
      values:
      - 'Running'
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - lastTransitionTime: {{ $now | Quote }}
        reason: PodFailed
        status: "False"
        type: Ready
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: false
        restartCount: 0
        started: false
        state:
          terminated:
            exitCode: 143
            finishedAt: {{ $now | Quote }}
            reason: Error
            startedAt: {{ $now | Quote }}
      {{ end }}
      phase: Failed
"""


def write_kwok_stage(workdir: Path) -> Path:
    """The Stage above as a file for kwok's --config (tests/kube_plane.py passes it when kueue=True)."""
    path = workdir / "kueue-kwok-stage.yaml"
    path.write_text(KWOK_STAGE)
    return path


# ------------------------------------------------------------------------------------------- PKI


def serving_pki() -> dict[str, bytes]:
    """Kueue's webhook Secret (ca.crt, ca.key, tls.crt, tls.key), made here so that the serving certificate
    names 127.0.0.1 (the API server calls the process on this host) besides the Service name Kueue's own
    certificate manager checks (it keeps a Secret whose certificates it finds valid for 90 days ahead, and
    injects its CA into the webhook configurations and the CRDs' conversion webhooks). RSA keys in PKCS#1:
    the only form it parses."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1)
    later = now + datetime.timedelta(days=3650)

    def key_pem(k) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )

    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kueue"),
            x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME),
        ]
    )
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(CA_NAME)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, WEBHOOK_DNS)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(WEBHOOK_DNS), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        "ca.key": key_pem(ca_key),
        "tls.crt": cert.public_bytes(serialization.Encoding.PEM),
        "tls.key": key_pem(key),
    }


def visibility_objects(address: str, port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """What the release's Deployment and kustomize give the visibility API, for a manager outside the
    cluster: a Service without a selector whose EndpointSlice is the manager's ``address:port`` on this
    host (the API server dials it: --enable-aggregator-routing), and the APIService trusting ``ca_pem``
    (the release says insecureSkipTLSVerify; here the serving certificate is known)."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": VISIBILITY_SERVICE, "namespace": KUEUE_NS},
            "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port, "protocol": "TCP"}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{VISIBILITY_SERVICE}-host",
                "namespace": KUEUE_NS,
                "labels": {
                    "kubernetes.io/service-name": VISIBILITY_SERVICE,
                    "endpointslice.kubernetes.io/managed-by": "tfdist-tests",
                },
            },
            "addressType": "IPv6" if ipaddress.ip_address(address).version == 6 else "IPv4",
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        },
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": APISERVICE},
            "spec": {
                "group": VISIBILITY_GROUP,
                "version": VISIBILITY_VERSION,
                "groupPriorityMinimum": 100,
                "versionPriority": 200,
                "service": {"name": VISIBILITY_SERVICE, "namespace": KUEUE_NS, "port": 443},
                "caBundle": base64.b64encode(ca_pem).decode(),
            },
        },
    ]


def host_address(plane_address: str) -> str:
    """An address of this host the API server may dial for an extension (it refuses loopback endpoints):
    the plane's own where it is not loopback (the real node's), else the source address of the default
    route (a UDP connect sends nothing)."""
    if not ipaddress.ip_address(plane_address).is_loopback:
        return plane_address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))  # TEST-NET-3: routed by the default route, never answered
        except OSError as e:
            raise ControlPlaneError(
                f"no default route, so no non-loopback address for Kueue's visibility server ({e})"
            ) from e
        return s.getsockname()[0]


def _names_dns(cert_pem: bytes, dns: str) -> bool:
    from cryptography import x509

    try:
        leaf = x509.load_pem_x509_certificate(cert_pem)
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    return dns in sans.get_values_for_type(x509.DNSName)


def visibility_cert(cert_dir: Path = VISIBILITY_DIR) -> bytes:
    """The CA of the visibility server's certificate in ``cert_dir`` (apiserver.crt: the serving certificate,
    then its CA, as Kueue writes it), made there first unless one naming VISIBILITY_DNS is there already.
    Every plane on this host shares the path (Kueue's, fixed), so they share one certificate: made under a
    lock, key then certificate each replaced whole, and left for the next plane."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    private_dir(cert_dir)
    crt, key_file = cert_dir / "apiserver.crt", cert_dir / "apiserver.key"
    with open(cert_dir / ".tfdist.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):
            have = crt.read_bytes()
            if key_file.is_file() and _names_dns(have, VISIBILITY_DNS):
                return x509.load_pem_x509_certificates(have)[-1].public_bytes(serialization.Encoding.PEM)
        now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1)
        later = now + datetime.timedelta(days=3650)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tfdist-test-kueue-visibility-ca")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(later)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(ca_key, hashes.SHA256())
        )  # its key is dropped: nothing else is ever signed with it
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, VISIBILITY_DNS)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(later)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(VISIBILITY_DNS)]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        ca_pem = ca.public_bytes(serialization.Encoding.PEM)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        chain = leaf.public_bytes(serialization.Encoding.PEM) + ca_pem
        for path, data in ((key_file, key_pem), (crt, chain)):
            tmp = path.with_suffix(".tmp")
            write_private(tmp, data)
            os.replace(tmp, path)
        return ca_pem


# ------------------------------------------------------------------------------------------ process


class KueueProcess:
    """Kueue's manager for one plane: installs the CRDs, starts the process (registered in the plane's
    ``procs``, so ``plane.stop()`` ends it and the plane's waits notice its death), installs the webhook
    configurations, and returns once a pod labelled for a queue really gets Kueue's scheduling gate (and,
    with ``visibility`` and an API server that can proxy to it, once its visibility APIService is
    Available)."""

    def __init__(
        self,
        plane: ControlPlane,
        bin_dir: Path | None = None,
        *,
        wait_for_pods_ready_s: int | None = WAIT_FOR_PODS_READY_S,
        fair_sharing: dict[str, Any] | None = FAIR_SHARING,
        visibility: bool = True,
    ):
        self.plane = plane
        self.bin_dir = bin_dir or kueue_bin_dir()
        self.config_dir = self.bin_dir.parent / "config"
        self.wait_for_pods_ready_s = wait_for_pods_ready_s
        self.fair_sharing = fair_sharing
        self.want_visibility = visibility
        self.visibility: tuple[str, int] | None = None  # where its visibility server listens, once on
        self.visibility_seconds: float | None = None  # what waiting for the APIService adds to a start
        self.start_seconds: float | None = None
        self.crd_seconds: float | None = None

    def start(self, timeout: float = 120.0) -> KueueProcess:
        why = kueue_missing(self.bin_dir)
        if why:
            raise ControlPlaneError(why)
        plane = self.plane
        assert plane.workdir is not None, "start the plane first"
        t0 = time.monotonic()
        deadline = t0 + timeout
        d = private_dir(plane.workdir / "kueue")
        pki = serving_pki()
        # what the kubelet's Secret volume would give the manager's pod: Kueue's certificate manager waits
        # for these files, and its webhook server serves them
        private_dir(d / "certs")
        for name, data in pki.items():
            write_private(d / "certs" / name, data)
        ca_pem = pki["ca.crt"]
        for name in ("kueue-webhook", "kueue-health"):
            plane.ports[name] = plane._free_port("127.0.0.1")
        base = f"https://127.0.0.1:{plane.ports['kueue-webhook']}"

        crds = [with_client_config(c, base, ca_pem) for c in load_crds(self.config_dir)]
        for crd in crds:
            self._apply("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        for crd in crds:
            name = crd["metadata"]["name"]
            plane._wait(f"CRD {name} Established", deadline, lambda n=name: self._crd_established(n))
        self.crd_seconds = time.monotonic() - t0
        if plane.get(f"/api/v1/namespaces/{KUEUE_NS}") is None:
            plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": KUEUE_NS}})
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": WEBHOOK_SECRET, "namespace": KUEUE_NS},
            "data": {k: base64.b64encode(v).decode() for k, v in pki.items()},
        }
        self._apply(f"/api/v1/namespaces/{KUEUE_NS}/secrets", secret)
        # before the manager: its certificate manager injects the CA into them and waits for that
        for wh in load_webhook_configurations(self.config_dir):
            kind = wh["kind"].lower() + "s"
            self._apply(f"/apis/admissionregistration.k8s.io/v1/{kind}", with_client_config(wh, base, ca_pem))

        if self.want_visibility and self._aggregation():
            # the API server's own address (a running cluster's client plane has no `address`)
            address = host_address(urllib.parse.urlsplit(plane.server).hostname or "127.0.0.1")
            plane.ports["kueue-visibility"] = plane._free_port(address)
            self.visibility = (address, plane.ports["kueue-visibility"])
            for obj in visibility_objects(*self.visibility, visibility_cert()):
                self._apply(self._collection(obj), obj)

        cfg = manager_configuration(
            health_port=plane.ports["kueue-health"],
            webhook_port=plane.ports["kueue-webhook"],
            cert_dir=str(d / "certs"),
            wait_for_pods_ready_s=self.wait_for_pods_ready_s,
            fair_sharing=self.fair_sharing,
            visibility=self.visibility,
        )
        write_private(d / "config.yaml", yaml.safe_dump(cfg))
        self._spawn([f"--config={d / 'config.yaml'}", f"--kubeconfig={plane.kubeconfig}"])
        plane._wait("kueue /readyz", deadline, self._ready)
        plane._wait("kueue's pod webhook gates a queued pod", deadline, self._webhook_gates)
        if self.visibility:
            t_vis = time.monotonic()
            plane._wait(f"APIService {APISERVICE} Available", deadline, self._visibility_available)
            self.visibility_seconds = time.monotonic() - t_vis
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """End the manager, and first its APIService: left pointing at nothing, it fails the API server's
        discovery of every group, which the namespace controller needs to delete a namespace."""
        if self.visibility:
            with contextlib.suppress(OSError, urllib.error.URLError):
                self.plane.request("DELETE", f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}")
            self.visibility = None
        self.plane._kill("kueue")
        self.plane.procs.pop("kueue", None)

    def logs(self, lines: int = 40) -> str:
        return self.plane.logs("kueue", lines)

    # ------------------------------------------------------------------ internals

    def _apply(self, collection: str, obj: dict) -> None:
        """Create, or replace what a previous start of this plane left (same name)."""
        try:
            self.plane.request("POST", collection, obj)
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise ControlPlaneError(f"{obj['kind']} {obj['metadata']['name']}: {e.read()[:300]!r}") from e
            path = f"{collection}/{obj['metadata']['name']}"
            cur = self.plane.request("GET", path)
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
            self.plane.request("PUT", path, obj)

    @staticmethod
    def _collection(obj: dict) -> str:
        group, _, version = obj["apiVersion"].rpartition("/")
        base = f"/apis/{group}/{version}" if group else f"/api/{version}"
        ns = obj["metadata"].get("namespace")
        plural = {"Service": "services", "EndpointSlice": "endpointslices", "APIService": "apiservices"}
        return f"{base}/namespaces/{ns}/{plural[obj['kind']]}" if ns else f"{base}/{plural[obj['kind']]}"

    def _aggregation(self) -> bool:
        """Whether the API server can proxy to an extension (it publishes its front-proxy CA): a cluster
        started before it had that gets Kueue without the visibility server, as before."""
        cm = self.plane.get("/api/v1/namespaces/kube-system/configmaps/extension-apiserver-authentication")
        return bool(((cm or {}).get("data") or {}).get("requestheader-client-ca-file"))

    def _visibility_available(self) -> bool:
        svc = self.plane.get(f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}") or {}
        conds = (svc.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Available" and c["status"] == "True" for c in conds)

    def _crd_established(self, name: str) -> bool:
        crd = self.plane.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        conds = ((crd or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

    def _spawn(self, args: list[str]) -> None:
        plane = self.plane
        assert plane.workdir is not None
        in_main = threading.current_thread() is threading.main_thread()
        log = open(plane.workdir / "kueue.log", "ab")
        try:
            plane.procs["kueue"] = subprocess.Popen(
                [str(self.bin_dir / "kueue"), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=plane.workdir,
                env={**go_env(), "HOME": str(plane.workdir)},
                start_new_session=True,
                preexec_fn=_die_with_parent if in_main and not plane.detach else None,
            )
        finally:
            log.close()

    def _ready(self) -> bool:
        url = f"http://127.0.0.1:{self.plane.ports['kueue-health']}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False

    def _webhook_gates(self) -> bool:
        """A dry-run pod with a queue label in ``default``: the API server calls the mutating webhook (dry
        run included), which adds the gate. Proves the whole path: URL, certificate, handler."""
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"generateName": "kueue-probe-", "labels": {QUEUE_LABEL: "probe"}},
            "spec": {"containers": [{"name": "c", "image": "probe"}]},
        }
        try:
            out = self.plane.request("POST", "/api/v1/namespaces/default/pods?dryRun=All", pod)
        except urllib.error.HTTPError:
            return False
        gates = [g["name"] for g in out.get("spec", {}).get("schedulingGates", [])]
        return GATE in gates
