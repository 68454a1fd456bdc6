"""A real, local Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (fake kubelets, fake GPU nodes), all plain processes on 127.0.0.1 free ports.

The binaries come from ``scripts/build-k8s`` (built from the Go modules under k8s/modules, cached outside
the checkout). Nothing here needs root, containers or a real kubelet.

    plane = ControlPlane().start()           # ~8-15 s on 2 cores once the binaries exist
    plane.add_gpu_nodes(2, gpus_per_node=8, model="NVIDIA-H100-80GB-HBM3")
    ... use plane.kubeconfig with any client ...
    plane.stop()                             # kills every process by PID, removes the temp dir

Stdlib-only on purpose (plus ``cryptography`` for the PKI and PyYAML for the node template), so it
can be used from sync or async tests alike; talk to the cluster with kubernetes_asyncio via
``plane.kubeconfig``.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import datetime
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
KWOK_DIR = REPO / "k8s" / "kwok"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def go_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the Go processes of a test cluster run with: the collector at GOGC=300 unless the
    caller's environment sets it. The API servers are the suite's largest CPU user after TensorFlow
    (process accounting of a whole CI run: ~650 of ~3000 CPU-s); under test_kueue_plane.py and
    test_k8s_backend.py their CPU fell 21-27 % with GOGC=300 (two A/B rounds) for ~80 MB more each."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("GOGC", "300")
    return env


# GPU memory in MiB as NVIDIA GPU feature discovery reports it (label nvidia.com/gpu.memory); optional.
GPU_MEMORY_MIB = {
    "NVIDIA-H100-80GB-HBM3": 81559,
    "NVIDIA-H200": 143771,
    "NVIDIA-A100-SXM4-80GB": 81920,
    "NVIDIA-A100-SXM4-40GB": 40960,
    "Tesla-V100-SXM2-16GB": 16384,
    "Tesla-T4": 15360,
    "NVIDIA-L4": 23034,
}


def find_bin_dir() -> Path:
    """Where the binaries are (or would be): $TFDIST_K8S_BIN, else what scripts/build-k8s reports."""
    env = os.environ.get("TFDIST_K8S_BIN")
    if env:
        return Path(env)
    out = subprocess.run(
        [str(REPO / "scripts" / "build-k8s"), "--print-bindir"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return Path(out.stdout.strip())


def missing_binaries(bin_dir: Path) -> list[str]:
    return [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]


# Listening ports of a plane come from a block below the ephemeral range (32768-60999 here): a port picked
# from that range is free when checked but can become an outgoing connection's source port before the
# component binds it. The kwok plane and the real node's plane get blocks of their own, so the two can run
# side by side (on two test workers) and neither takes the real cluster's fixed ports (6443, 10248-10256).
KWOK_PORTS = (20000, 26000)
REALNODE_PORTS = (26000, 32000)


def free_port(address: str = "127.0.0.1", block: tuple[int, int] | None = None) -> int:
    """A port nothing listens on; from ``block`` (a random one, so two planes rarely try the same) or else
    from the kernel's ephemeral range."""
    if block is None:
        with socket.socket() as s:
            s.bind((address, 0))
            return s.getsockname()[1]
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(*block)
        with socket.socket() as s:  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
            try:
                s.bind((address, port))
            except OSError:
                continue
            return port
    raise ControlPlaneError(f"no free port in {block[0]}-{block[1] - 1} on {address}")


try:  # resolved before any fork: the child must not dlopen/dlsym
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # PR_SET_PDEATHSIG=1, SIGKILL: if the test process dies (even by SIGKILL) the kernel kills the child.
    if _prctl is not None:
        _prctl(1, signal.SIGKILL, 0, 0, 0)


# --------------------------------------------------------------------------------------------- PKI


def write_private(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` to ``path`` as a file only its owner can read (0600), whatever the umask: created with
    that mode (never a moment wider), and an existing file narrowed before it gets the new content."""
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(raw)
    finally:
        os.close(fd)


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` (and missing parents) as a directory only its owner can enter (0700), whatever the umask."""
    d = Path(path)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


# the aggregation layer's client certificate's name: the only one an extension API server takes headers from
FRONT_PROXY_CLIENT = "front-proxy-client"


def _write_pki(d: Path, extra_ips: tuple[str, ...] = ()) -> None:
    """Two CAs and what they sign, every file 0600 in a 0700 directory:

    - ``ca``: the cluster CA. The apiserver serving cert (IP SAN 127.0.0.1 and ``extra_ips``); it also signs
      the client certificates the API server trusts (tests/realnode.py issues the node's).
    - ``etcd-ca``: etcd's own CA, trusted by etcd alone. etcd's serving/peer cert (127.0.0.1) and the one
      client certificate etcd accepts, the API server's. A separate CA, so that no certificate the cluster
      CA signs (a kubelet's, kube-proxy's) opens etcd: with client-certificate auth etcd admits any
      certificate of the CA it trusts, as an etcd root.
    - ``front-proxy-ca``: the aggregation layer's CA, trusted for nothing but the request headers of a
      proxied call (``--requestheader-client-ca-file``). It signs ``front-proxy-client``, the certificate the
      API server presents to an extension API server (Kueue's visibility server) with the caller's identity
      in ``X-Remote-*`` headers. Its own CA, so that no cluster-CA certificate can assert a user that way.
    - the service-account signing key pair (EC P-256)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def key_pem(k) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )

    def pem(cert) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1)
    later = now + datetime.timedelta(days=30)

    def make_ca(cn: str):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(later)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return key, cert

    def issue(ca_key, ca_cert, cn: str, usages: list, sans: list | None = None):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(later)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, b.sign(ca_key, hashes.SHA256())

    ca_key, ca = make_ca("tfdist-test-ca")
    sans = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("10.0.0.1")),  # first IP of --service-cluster-ip-range
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"),
        x509.DNSName("kubernetes.default.svc.cluster.local"),
        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips),
    ]
    srv_key, srv = issue(ca_key, ca, "kube-apiserver", [ExtendedKeyUsageOID.SERVER_AUTH], sans)

    etcd_ca_key, etcd_ca = make_ca("tfdist-etcd-ca")
    etcd_key, etcd = issue(
        etcd_ca_key,
        etcd_ca,
        "etcd",
        # server for clients, and both ways for the peer port (a member is client and server there)
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    etcd_client_key, etcd_client = issue(
        etcd_ca_key, etcd_ca, "kube-apiserver-etcd-client", [ExtendedKeyUsageOID.CLIENT_AUTH]
    )

    fp_ca_key, fp_ca = make_ca("tfdist-front-proxy-ca")
    fp_key, fp = issue(fp_ca_key, fp_ca, FRONT_PROXY_CLIENT, [ExtendedKeyUsageOID.CLIENT_AUTH])

    sa_key = ec.generate_private_key(ec.SECP256R1())
    files = {
        "ca.crt": pem(ca),
        "ca.key": key_pem(ca_key),
        "apiserver.crt": pem(srv),
        "apiserver.key": key_pem(srv_key),
        "etcd-ca.crt": pem(etcd_ca),
        "etcd-ca.key": key_pem(etcd_ca_key),
        "etcd-server.crt": pem(etcd),
        "etcd-server.key": key_pem(etcd_key),
        "apiserver-etcd-client.crt": pem(etcd_client),
        "apiserver-etcd-client.key": key_pem(etcd_client_key),
        "front-proxy-ca.crt": pem(fp_ca),
        "front-proxy-ca.key": key_pem(fp_ca_key),
        "front-proxy-client.crt": pem(fp),
        "front-proxy-client.key": key_pem(fp_key),
        "sa.key": key_pem(sa_key),
        "sa.pub": sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }
    private_dir(d)
    for name, data in files.items():
        write_private(d / name, data)


# --------------------------------------------------------------------------------------- the plane


def node_usable(node: dict) -> bool:
    """Ready, and without the not-ready/unreachable taints the controller-manager removes: schedulable."""
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in node.get("status", {}).get("conditions", [])
    )
    blocked = any(
        t.get("key") in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
        for t in node.get("spec", {}).get("taints", []) or []
    )
    return ready and not blocked


class ControlPlaneError(RuntimeError):
    pass


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok on free 127.0.0.1 ports.

    Attributes once started: ``kubeconfig`` (admin kubeconfig path), ``server`` (https URL),
    ``token`` (admin bearer token, group system:masters), ``ca_file``, ``workdir``, ``start_seconds``.

    The real-node cluster (tests/realnode.py) passes ``address`` (the apiserver binds and advertises it, so
    the ``kubernetes`` Service gets an endpoint pods can reach), a fixed ``apiserver_port`` and ``workdir``,
    and ``detach`` (the processes outlive this Python process: no PDEATHSIG, no atexit stop).

    ``kueue=True`` also starts Kueue's manager with its CRDs and working admission webhooks
    (tests/kueue_proc.py; ``kueue`` then holds it, ``kueue_seconds`` its start time); other planes pay
    nothing.
    """

    def __init__(
        self,
        bin_dir: str | os.PathLike | None = None,
        kwok_dir: str | os.PathLike | None = None,
        *,
        address: str = "127.0.0.1",
        apiserver_port: int | None = None,
        workdir: str | os.PathLike | None = None,
        detach: bool = False,
        port_block: tuple[int, int] = KWOK_PORTS,
        kueue: bool = False,
    ):
        self.bin_dir = Path(bin_dir) if bin_dir else find_bin_dir()
        self.kwok_dir = Path(kwok_dir) if kwok_dir else KWOK_DIR
        self.address = address
        self.apiserver_port = apiserver_port
        self.port_block = port_block
        self.fixed_workdir = Path(workdir) if workdir else None
        self.detach = detach
        self.workdir: Path | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.args: dict[str, list[str]] = {}
        self.start_seconds: float | None = None
        self._node_seq = 0
        self._ssl: ssl.SSLContext | None = None
        self.with_kueue = kueue
        self.kueue = None  # tests.kueue_proc.KueueProcess once started
        self.kueue_seconds: float | None = None

    def _free_port(self, address: str) -> int:
        taken = set(self.ports.values())
        while (port := free_port(address, self.port_block)) in taken:
            pass  # picked but not bound yet by an earlier component of this plane
        return port

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 120.0) -> ControlPlane:
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise ControlPlaneError(f"missing binaries in {self.bin_dir}: {missing} (run scripts/build-k8s)")
        t0 = time.monotonic()
        deadline = t0 + timeout
        if not self.detach:
            atexit.register(self.stop)
        try:
            self._prepare()
            self._spawn("etcd")
            self._wait("etcd /health", deadline, self._etcd_healthy)
            self._spawn("kube-apiserver")
            self._wait("kube-apiserver /readyz", deadline, self._apiserver_ready)
            self._spawn("kube-controller-manager")
            self._spawn("kube-scheduler")
            self._spawn("kwok")
            self._wait("kube-scheduler /healthz", deadline, lambda: self._component_healthy("kube-scheduler"))
            self._wait(
                "kube-controller-manager /healthz",
                deadline,
                lambda: self._component_healthy("kube-controller-manager"),
            )
            # The ServiceAccount admission plugin rejects pods until KCM has created the default SA.
            self._wait(
                "serviceaccount default/default",
                deadline,
                lambda: self.get("/api/v1/namespaces/default/serviceaccounts/default") is not None,
            )
            if self.with_kueue:
                from tests.kueue_proc import KueueProcess

                self.kueue = KueueProcess(self).start(timeout=max(30.0, deadline - time.monotonic()))
                self.kueue_seconds = self.kueue.start_seconds
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Kill every process by PID, newest first (SIGTERM, then SIGKILL), and remove the temp dir."""
        for name in reversed(list(self.procs)):
            self._kill(name)
        self.procs.clear()
        if self.workdir and self.workdir.exists() and not os.environ.get("TFDIST_K8S_KEEP_DIR"):
            shutil.rmtree(self.workdir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def restart_apiserver(
        self, timeout: float = 90.0, down_seconds: float = 0.0, hard: bool = False
    ) -> float:
        """Stop kube-apiserver (SIGTERM, or SIGKILL with ``hard``), keep it down ``down_seconds``, start it
        again with the same flags and port; returns the seconds from restart to /readyz ok (~5 s).
        etcd keeps the state; the other components and kwok reconnect by themselves."""
        self._kill("kube-apiserver", grace=0.0 if hard else 5.0)
        if down_seconds:
            time.sleep(down_seconds)
        t0 = time.monotonic()
        self._spawn("kube-apiserver")
        self._wait("kube-apiserver /readyz", t0 + timeout, self._apiserver_ready)
        return time.monotonic() - t0

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ nodes

    def add_gpu_nodes(
        self,
        count: int,
        gpus_per_node: int,
        model: str,
        *,
        name_prefix: str | None = None,
        labels: dict[str, str] | None = None,
        taints: list[dict] | None = None,
        cpu: str = "64",
        memory: str = "512Gi",
        mig: dict[str, int] | None = None,
        wait: bool = True,
        timeout: float = 60.0,
    ) -> list[str]:
        """Create ``count`` kwok nodes advertising ``gpus_per_node`` x nvidia.com/gpu of ``model``
        (label nvidia.com/gpu.product), and ``mig`` ({"1g.10gb": 7, ...}) as the GPU operator's mixed MIG
        strategy does (nvidia.com/mig-<profile> resources and .count labels). Waits until kwok reports them
        Ready and the controller-manager has lifted the not-ready taint, i.e. until the scheduler may use
        them. Returns the node names."""
        template = yaml.safe_load((self.kwok_dir / "gpu-node.yaml").read_text())
        slug = "".join(c if c.isalnum() else "-" for c in model.lower()).strip("-")[:30].strip("-")
        prefix = name_prefix or f"kwok-gpu-{slug}"
        names = []
        for _ in range(count):
            name = f"{prefix}-{self._node_seq}"
            self._node_seq += 1
            node = copy.deepcopy(template)
            meta = node["metadata"]
            meta["name"] = name
            meta["labels"].update(
                {
                    "kubernetes.io/hostname": name,
                    "nvidia.com/gpu.product": model,
                    "nvidia.com/gpu.count": str(gpus_per_node),
                }
            )
            if model in GPU_MEMORY_MIB:
                meta["labels"]["nvidia.com/gpu.memory"] = str(GPU_MEMORY_MIB[model])
            else:
                meta["labels"].pop("nvidia.com/gpu.memory", None)
            for profile, n in (mig or {}).items():
                meta["labels"][f"nvidia.com/mig-{profile}.count"] = str(n)
            if mig:
                meta["labels"]["nvidia.com/mig.strategy"] = "mixed"
            meta["labels"].update(labels or {})
            node["spec"]["providerID"] = f"kwok://{name}"
            if taints:
                node["spec"]["taints"] = taints
            for key in ("capacity", "allocatable"):
                node["status"][key].update(
                    {"nvidia.com/gpu": str(gpus_per_node), "cpu": cpu, "memory": memory}
                )
                node["status"][key].update({f"nvidia.com/mig-{p}": str(n) for p, n in (mig or {}).items()})
            self.request("POST", "/api/v1/nodes", node)
            names.append(name)
        if wait:
            deadline = time.monotonic() + timeout
            for name in names:
                self._wait(
                    f"node {name} Ready and schedulable", deadline, lambda n=name: self._node_usable(n)
                )
        return names

    def _node_usable(self, name: str) -> bool:
        node = self.get(f"/api/v1/nodes/{name}")
        return bool(node) and node_usable(node)

    def create_namespace(self, name: str, timeout: float = 60.0) -> str:
        """Create a namespace and wait for its default ServiceAccount (created by KCM; pods need it)."""
        self.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        self._wait(
            f"serviceaccount {name}/default",
            time.monotonic() + timeout,
            lambda: self.get(f"/api/v1/namespaces/{name}/serviceaccounts/default") is not None,
        )
        return name

    def service_account_kubeconfig(self, ns: str, account: str, path: Path) -> str:
        """A kubeconfig (0600, at `path`) that acts as `account` of `ns` with a 10-minute token: what a user
        with that service account's token has."""
        tok = self.request(
            "POST",
            f"/api/v1/namespaces/{ns}/serviceaccounts/{account}/token",
            {"spec": {"expirationSeconds": 600}},
        )["status"]["token"]
        cfg = yaml.safe_load(Path(self.kubeconfig).read_text())
        cfg["users"] = [{"name": account, "user": {"token": tok}}]
        cfg["contexts"][0]["context"]["user"] = account
        write_private(path, yaml.safe_dump(cfg))
        return str(path)

    # ------------------------------------------------------------------ tiny REST client (stdlib)

    def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        timeout: float = 10.0,
        content_type: str = "application/json",
    ):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        with urllib.request.urlopen(req, context=self._ssl, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw[:1] == b"{" else raw.decode()

    def get(self, path: str):
        """GET returning None on 404."""
        try:
            return self.request("GET", path)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    @contextlib.contextmanager
    def watching(self, list_path: str, seconds: int = 120, settle: float = 0.5):
        """Every watch event on `list_path` from now on, in order, into the list this yields: a record of
        each object's history that a later GET cannot give (the watch starts at the list's resourceVersion,
        so nothing between the two is missed). The list is complete once the block ends."""
        rv = self.request("GET", list_path)["metadata"]["resourceVersion"]
        sep = "&" if "?" in list_path else "?"
        url = f"{self.server}{list_path}{sep}watch=1&allowWatchBookmarks=false&resourceVersion={rv}"
        events: list[dict] = []
        req = urllib.request.Request(f"{url}&timeoutSeconds={seconds}")
        req.add_header("Authorization", f"Bearer {self.token}")
        resp = urllib.request.urlopen(req, context=self._ssl, timeout=seconds + 10)

        def read() -> None:
            with contextlib.suppress(OSError, ValueError):
                for line in resp:
                    events.append(json.loads(line))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            yield events
        finally:
            time.sleep(settle)  # events already sent but not yet read
            with contextlib.suppress(AttributeError, OSError):  # wakes the reader's blocking read
                resp.fp.raw._sock.shutdown(socket.SHUT_RDWR)
            reader.join(5)
            resp.close()

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run kubectl (if scripts/build-k8s built it) against this plane."""
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            check=check,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def logs(self, name: str, lines: int = 40) -> str:
        if not self.workdir:
            return ""
        path = self.workdir / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _sweep_stale_workdirs() -> None:
        """Remove temp dirs of planes whose test process died without stop() (e.g. SIGKILL; PDEATHSIG
        already killed their processes)."""
        for old in Path(tempfile.gettempdir()).glob("tfdist-k8s-*"):
            try:
                pid = int((old / "owner.pid").read_text())
                os.kill(pid, 0)
            except ProcessLookupError:
                shutil.rmtree(old, ignore_errors=True)
            except (OSError, ValueError):
                pass  # no/garbled pid file, or not ours to judge

    def _prepare(self) -> None:
        self._sweep_stale_workdirs()
        if self.fixed_workdir:
            self.workdir = private_dir(self.fixed_workdir)
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="tfdist-k8s-"))
        d = self.workdir
        if not self.detach:
            (d / "owner.pid").write_text(str(os.getpid()))
        pki = d / "pki"
        loopback = ipaddress.ip_address(self.address).is_loopback
        _write_pki(pki, () if loopback else (self.address,))
        self.ca_file = str(pki / "ca.crt")
        self.token = secrets.token_hex(16)
        kcm_token, sched_token, kwok_token = (secrets.token_hex(16) for _ in range(3))
        # token,user,uid,"groups". All components are cluster-admins (system:masters): this is a test plane.
        write_private(
            pki / "tokens.csv",
            f'{self.token},admin,uid-admin,"system:masters"\n'
            f'{kcm_token},system:kube-controller-manager,uid-kcm,"system:masters"\n'
            f'{sched_token},system:kube-scheduler,uid-scheduler,"system:masters"\n'
            f'{kwok_token},kwok,uid-kwok,"system:masters"\n',
        )
        for name in ("etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            self.ports[name] = self._free_port("127.0.0.1")
        self.ports["kube-apiserver"] = self.apiserver_port or self._free_port(self.address)
        self.server = f"https://{self.address}:{self.ports['kube-apiserver']}"
        self._ssl = ssl.create_default_context(cafile=self.ca_file)

        def kubeconfig(path: Path, user: str, token: str) -> str:
            cfg = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "tfdist-test",
                        "cluster": {"server": self.server, "certificate-authority": self.ca_file},
                    }
                ],
                "users": [{"name": user, "user": {"token": token}}],
                "contexts": [{"name": "tfdist-test", "context": {"cluster": "tfdist-test", "user": user}}],
                "current-context": "tfdist-test",
            }
            write_private(path, yaml.safe_dump(cfg))
            return str(path)

        self.kubeconfig = kubeconfig(d / "admin.kubeconfig", "admin", self.token)
        kcm_kc = kubeconfig(d / "kcm.kubeconfig", "kube-controller-manager", kcm_token)
        sched_kc = kubeconfig(d / "scheduler.kubeconfig", "kube-scheduler", sched_token)
        kwok_kc = kubeconfig(d / "kwok.kubeconfig", "kwok", kwok_token)

        # The components' own serving certificates (self-signed, written at start) stay private too.
        for sub in ("kcm-certs", "scheduler-certs"):
            private_dir(d / sub)

        p = self.ports
        # etcd holds every Secret and every RBAC rule: TLS both ways on both ports, and only a certificate
        # of etcd's own CA (the API server's) gets in. Plain HTTP or TLS without that certificate is refused.
        peer = f"https://127.0.0.1:{p['etcd-peer']}"
        client = f"https://127.0.0.1:{p['etcd']}"
        self.etcd_client_cert = (
            str(pki / "apiserver-etcd-client.crt"),
            str(pki / "apiserver-etcd-client.key"),
        )
        self.etcd_ca_file = str(pki / "etcd-ca.crt")
        etcd_tls = [
            f"--cert-file={pki / 'etcd-server.crt'}",
            f"--key-file={pki / 'etcd-server.key'}",
            "--client-cert-auth=true",
            f"--trusted-ca-file={pki / 'etcd-ca.crt'}",
            f"--peer-cert-file={pki / 'etcd-server.crt'}",
            f"--peer-key-file={pki / 'etcd-server.key'}",
            "--peer-client-cert-auth=true",
            f"--peer-trusted-ca-file={pki / 'etcd-ca.crt'}",
        ]
        self.args = {
            "etcd": [
                "--name=tfdist",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=tfdist={peer}",
                *etcd_tls,
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
            "kube-apiserver": [
                f"--etcd-servers={client}",
                f"--etcd-cafile={pki / 'etcd-ca.crt'}",
                f"--etcd-certfile={pki / 'apiserver-etcd-client.crt'}",
                f"--etcd-keyfile={pki / 'apiserver-etcd-client.key'}",
                # Refuse every new Service.spec.externalIPs (CVE-2020-8554: a Service with an externalIP
                # takes that address:port over on every node, the node's own included). The other
                # default admission plugins stay on (this flag adds to them).
                "--enable-admission-plugins=DenyServiceExternalIPs",
                f"--bind-address={self.address}",
                f"--advertise-address={self.address}",
                f"--secure-port={p['kube-apiserver']}",
                # Without it the apiserver tries to write a loopback IP into the kubernetes Endpoints. A
                # real address gets the endpoint (the real node's pods reach the API through the Service).
                f"--endpoint-reconciler-type={'none' if loopback else 'lease'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--allow-privileged=true",
                f"--cert-dir={pki}",
                "--profiling=false",
                # The aggregation layer (an APIService such as Kueue's visibility API): the API server
                # proxies to the extension with the front-proxy client certificate and the caller's
                # identity in these headers; it publishes the CA and names in kube-system's
                # extension-apiserver-authentication, where the extension reads them. It dials the
                # Service's endpoint directly (no kube-proxy on a kwok plane)
                f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
                f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
                "--enable-aggregator-routing=true",
            ],
            "kube-controller-manager": [
                f"--kubeconfig={kcm_kc}",
                f"--authentication-kubeconfig={kcm_kc}",
                f"--authorization-kubeconfig={kcm_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p['kube-controller-manager']}",
                f"--cert-dir={d / 'kcm-certs'}",
                "--leader-elect=false",
                # Don't read the requestheader CA from kube-system/extension-apiserver-authentication:
                # nothing proxies to the controller-manager, so it needs none.
                "--authentication-skip-lookup=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                "--node-monitor-period=2s",
                "--profiling=false",
            ],
            "kube-scheduler": [
                f"--kubeconfig={sched_kc}",
                f"--authentication-kubeconfig={sched_kc}",
                f"--authorization-kubeconfig={sched_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p['kube-scheduler']}",
                f"--cert-dir={d / 'scheduler-certs'}",
                "--leader-elect=false",
                "--authentication-skip-lookup=true",
                "--profiling=false",
            ],
            "kwok": [
                f"--kubeconfig={kwok_kc}",
                f"--config={self.kwok_dir / 'kwok.yaml'}",
                f"--config={self.kwok_dir / 'stages.yaml'}",
            ],
        }
        if self.with_kueue:  # a deleted pod ends as a kubelet ends it, so Kueue lets go of it
            from tests.kueue_proc import write_kwok_stage

            self.args["kwok"].append(f"--config={write_kwok_stage(d)}")

    def _spawn(self, name: str) -> None:
        assert self.workdir is not None
        in_main_thread = threading.current_thread() is threading.main_thread()
        log = open(self.workdir / f"{name}.log", "ab")
        try:
            self.procs[name] = subprocess.Popen(
                [str(self.bin_dir / name), *self.args[name]],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env={**go_env(), "HOME": str(self.workdir)},  # kwok reads ~/.kwok; keep it private
                start_new_session=True,
                # PDEATHSIG fires when the spawning *thread* exits, so only from the main thread (a plane
                # restarted via asyncio.to_thread would otherwise die with the executor's worker thread).
                preexec_fn=_die_with_parent if in_main_thread and not self.detach else None,
            )
        finally:
            log.close()

    def _kill(self, name: str, grace: float = 5.0) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        try:
            proc.wait(timeout=grace if grace > 0 else 10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def _wait(self, what: str, deadline: float, check) -> None:
        last_err = None
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ControlPlaneError(
                        f"{name} exited with {proc.returncode} while waiting for {what}; "
                        f"log tail:\n{self.logs(name)}"
                    )
            try:
                if check():
                    return
            except (OSError, urllib.error.URLError, ValueError) as e:
                last_err = e
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}.log\n{self.logs(n, 15)}" for n in self.procs)
                raise ControlPlaneError(f"timed out waiting for {what} (last error: {last_err!r})\n{tails}")
            time.sleep(0.2)

    def etcd_ssl(self) -> ssl.SSLContext:
        """A TLS context that etcd accepts: its CA, and the API server's client certificate."""
        ctx = ssl.create_default_context(cafile=self.etcd_ca_file)
        ctx.load_cert_chain(*self.etcd_client_cert)
        return ctx

    def _etcd_healthy(self) -> bool:
        url = f"https://127.0.0.1:{self.ports['etcd']}/health"
        with urllib.request.urlopen(url, context=self.etcd_ssl(), timeout=2) as r:
            return json.loads(r.read()).get("health") == "true"

    def _apiserver_ready(self) -> bool:
        try:
            return self.request("GET", "/readyz", timeout=2) == "ok"
        except urllib.error.HTTPError:
            return False

    def _component_healthy(self, name: str) -> bool:
        # KCM and the scheduler serve /healthz with a self-signed certificate; anonymous access is allowed.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        url = f"https://127.0.0.1:{self.ports[name]}/healthz"
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
                return r.read() == b"ok"
        except urllib.error.HTTPError:
            return False


WRITTEN_KINDS = (
    "/apis/batch/v1/namespaces/{ns}/jobs",
    "/api/v1/namespaces/{ns}/pods",
    "/api/v1/namespaces/{ns}/services",
    "/api/v1/namespaces/{ns}/secrets",
    "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
)


@contextlib.contextmanager
def nothing_created(plane: ControlPlane, ns: str, job: str) -> Iterator[None]:
    """Watches every kind a job writes in `ns` across the block: an object created and deleted again
    (a half-made job cleaned up) fails it as much as one left behind, which a list afterwards cannot see.
    Objects of the job `job` only (its label), so other jobs' pods coming and going do not count."""
    from tfdist.kube.names import L_JOB

    sel = f"?labelSelector={L_JOB}%3D{job}"
    with contextlib.ExitStack() as stack:
        streams = {
            p.format(ns=ns): stack.enter_context(plane.watching(p.format(ns=ns) + sel, 60, settle=0))
            for p in WRITTEN_KINDS
        }
        yield
        time.sleep(0.5)  # events already sent but not yet read, once for all the streams
    added = [
        f"{path.rsplit('/', 1)[1]}/{e['object']['metadata']['name']}"
        for path, events in streams.items()
        for e in events
        if e.get("type") == "ADDED"
    ]
    assert added == [], f"created during a refused submit: {added}"
