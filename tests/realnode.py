"""A one-machine Kubernetes cluster with a REAL node: the test control plane (tests/kube_plane.py) bound to
a private node address, containerd + runc + the CNI bridge, kubelet, kube-proxy (iptables), CoreDNS and
kube-router's firewall (NetworkPolicy), all as plain processes that outlive the caller.

Used by ``scripts/cluster up|down|status`` (users) and by the ``realnode`` test fixtures (the same code).
Needs root. Facts behind the settings: ../shared/research/k8s_real_node.md and k8s/README.md.

Every packet stays on this machine: before any pod starts, the service CIDR is routed to the port-less
node bridge (a ClusterIP no kube-proxy rule catches goes nowhere) and a mangle-table guard drops
everything forwarded between the pod bridge and any other interface. ``down`` undoes every machine change
it recorded at the first ``up``: processes, containers, mounts, network namespaces, bridges, routes,
iptables chains, ipsets, nftables tables and sysctls; containerd's image store stays cached.

    python -m tests.realnode up | down | status | hub | user NAME      (what scripts/cluster runs)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests import kube_plane

REPO = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("TFDIST_CLUSTER_STATE", "/run/tfdist-cluster"))  # gone with the cluster
VARLIB = Path(os.environ.get("TFDIST_CLUSTER_DATA", "/var/lib/tfdist-cluster"))  # containerd images stay
NODE_NAME = "tfdist-node"
NODE_BRIDGE = "tfdn0"  # no ports; holds the node address (the kubelet refuses a loopback node IP)
POD_BRIDGE = "tfdcni0"  # made by the CNI bridge plugin
NODE_IP = os.environ.get("TFDIST_CLUSTER_NODE_IP", "10.99.0.1")
POD_CIDR = "10.245.0.0/24"  # kwok's fake pod IPs use 10.244.0.0/16; keep real ones apart
SERVICE_CIDR = "10.0.0.0/24"  # what kube_plane gives the apiserver
API_PORT = int(os.environ.get("TFDIST_CLUSTER_PORT", "6443"))
GUARD_CHAIN = "TFDIST-NODE-GUARD"
CNI_NET = "tfdist"
PAUSE_IMAGE = "localhost/tfdist-pause:3.10"
NODE_BINARIES = ("kubelet", "kube-proxy", "coredns", "kube-router")
# umoci: `up` packs the pause image with it before scripts/build-images (which also installs it) ever ran
APT_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "ipset", "iptables", "nftables", "umoci")
# Sysctls the kubelet, the CNI bridge and we change: recorded at the first up, restored by down.
SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
    "vm.overcommit_memory",
    "kernel.panic",
    "kernel.panic_on_oops",
)
# Order of start; down stops in reverse.
COMPONENTS = (
    "containerd",
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kubelet",
    "kube-proxy",
    "coredns",
    "kube-router",
)
ENV_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ClusterError(RuntimeError):
    """A message for the user: what is wrong and what to do."""


def log(msg: str) -> None:
    print(f"cluster: {msg}", file=sys.stderr, flush=True)


def run(*cmd: str, check: bool = True, timeout: float = 60, input: str | None = None) -> str:
    env = {**os.environ, "PATH": ENV_PATH + ":" + os.environ.get("PATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, input=input)
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def quiet(*cmd: str) -> bool:
    """Run a clean-up command whose failure only means there was nothing to clean."""
    try:
        run(*cmd, timeout=30)
        return True
    except (ClusterError, OSError, subprocess.TimeoutExpired):
        return False


# ------------------------------------------------------------------------------------------- binaries


def plane_bin_dir() -> Path:
    return kube_plane.find_bin_dir()


def node_bin_dir() -> Path:
    env = os.environ.get("TFDIST_K8S_NODE_BIN")
    if env:
        return Path(env)
    out = run(str(REPO / "scripts" / "build-k8s"), "--node", "--print-bindir", timeout=30)
    return Path(out.strip())


def missing_node_binaries() -> list[str]:
    node = node_bin_dir()
    plane = plane_bin_dir()
    miss = [b for b in NODE_BINARIES if not os.access(node / b, os.X_OK)]
    return miss + [b for b in (*kube_plane.BINARIES, "kubectl") if not os.access(plane / b, os.X_OK)]


def missing_packages() -> list[str]:
    need = {
        "containerd": "containerd",
        "runc": "runc",
        "ipset": "ipset",
        "iptables": "iptables",
        "nft": "nftables",
        "umoci": "umoci",
    }
    miss = [pkg for exe, pkg in need.items() if not shutil.which(exe, path=ENV_PATH)]
    if not os.path.exists("/usr/lib/cni/bridge"):
        miss.append("containernetworking-plugins")
    return miss


CNI_BRIDGE = Path("/usr/lib/cni/bridge")


def check_cni_bridge(path: Path = CNI_BRIDGE) -> None:
    """The bridge plugin must know ``macspoofchk`` (containernetworking-plugins 1.0+; bookworm has 1.1.1):
    an older one ignores the key without a word, and pods could spoof MAC addresses on the bridge."""
    try:
        known = b"macspoofchk" in path.read_bytes()
    except OSError as e:
        raise ClusterError(f"cannot read the CNI bridge plugin {path}: {e}") from e
    if not known:
        raise ClusterError(
            f"the CNI bridge plugin {path} has no macspoofchk (pods could spoof MAC addresses): install "
            "containernetworking-plugins 1.0 or newer; nothing was started"
        )


def ensure_built() -> None:
    """apt packages and Go binaries that are missing (minutes cold; milliseconds warm)."""
    miss = missing_packages()
    if miss:
        log(f"installing Debian packages: {' '.join(miss)}")
        run("apt-get", "update", "-qq", timeout=600)
        run("apt-get", "install", "-y", "-qq", *APT_PACKAGES, timeout=1200)
    if missing_node_binaries():
        log("building the Kubernetes binaries (scripts/build-k8s; cold: tens of minutes)")
        for args in ((), ("--node",)):
            p = subprocess.run([str(REPO / "scripts" / "build-k8s"), *args], stdout=subprocess.DEVNULL)
            if p.returncode != 0:
                raise ClusterError(f"scripts/build-k8s {' '.join(args)} failed ({p.returncode})")
    ensure_pause_image_binary()


def pause_binary() -> Path:
    return node_bin_dir().parent / "pause"


def ensure_pause_image_binary() -> None:
    """Kubernetes' own pause.c (from the module cache), compiled static: the sandbox image's only file."""
    out = pause_binary()
    if out.exists():
        return
    gomodcache = run("go", "env", "GOMODCACHE").strip() if shutil.which("go") else ""
    src = (
        Path(gomodcache or Path.home() / "go/pkg/mod") / "k8s.io/kubernetes@v1.36.3/build/pause/linux/pause.c"
    )
    if not src.exists():
        raise ClusterError(f"{src} missing: run scripts/build-k8s first (it downloads k8s.io/kubernetes)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    run("gcc", "-Os", "-static", "-o", str(tmp), str(src), "-DVERSION=3.10-tfdist")
    run("strip", str(tmp))
    tmp.replace(out)


# --------------------------------------------------------------------------------------------- state


@dataclass
class Proc:
    name: str
    pid: int
    start: str  # /proc/<pid>/stat field 22: a reused pid has another start time
    exe: str


def proc_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(p: Proc) -> bool:
    """Same process (pid and start time) and not a zombie (reaped here when it is our own child)."""
    if proc_start(p.pid) != p.start:
        return False
    try:
        zombie = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
    if zombie:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(p.pid, os.WNOHANG)
        return False
    return True


def load_state() -> dict:
    try:
        return json.loads((STATE / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def save_state(state: dict) -> None:
    kube_plane.private_dir(STATE)
    tmp = STATE / "state.json.tmp"
    kube_plane.write_private(tmp, json.dumps(state, indent=1))  # holds the admin token
    tmp.replace(STATE / "state.json")


def recorded_procs(state: dict) -> list[Proc]:
    return [Proc(**p) for p in state.get("procs", [])]


@contextlib.contextmanager
def locked():
    """One up/down/status at a time (a second caller waits)."""
    Path("/run/lock").mkdir(parents=True, exist_ok=True)
    with open("/run/lock/tfdist-cluster.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ------------------------------------------------------------------------------------ machine record


def read_sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys/" + name.replace(".", "/")).read_text().strip()
    except OSError:
        return None


def write_sysctl(name: str, value: str) -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys/" + name.replace(".", "/")).write_text(value)


def iptables_chains(binary: str) -> dict[str, list[str]]:
    """{table: [chain, ...]} as iptables-save shows them (our chains are found by difference)."""
    out: dict[str, list[str]] = {}
    table = ""
    try:
        text = run(binary, check=False)
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:]
            out.setdefault(table, [])
        elif line.startswith(":"):
            out[table].append(line[1:].split()[0])
    return out


def nft_tables() -> list[str]:
    try:
        return [
            " ".join(line.split()[1:3]) for line in run("nft", "list", "tables", check=False).splitlines()
        ]
    except OSError:
        return []


def machine_record() -> dict:
    return {
        "sysctls": {k: read_sysctl(k) for k in SYSCTLS},
        "netns": sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else [],
        "iptables": iptables_chains("iptables-save"),
        "ip6tables": iptables_chains("ip6tables-save"),
        "ipsets": run("ipset", "list", "-n", check=False).split()
        if shutil.which("ipset", path=ENV_PATH)
        else [],
        "nft": nft_tables(),
        "links": sorted(os.listdir("/sys/class/net")),
    }


# ------------------------------------------------------------------------------------------- network


def setup_network() -> None:
    """The node bridge and address, the service route and the forwarding guard: before any pod exists."""
    if not os.path.exists(f"/sys/class/net/{NODE_BRIDGE}"):
        run("ip", "link", "add", NODE_BRIDGE, "type", "bridge")
    run("ip", "addr", "replace", f"{NODE_IP}/32", "dev", NODE_BRIDGE)
    run("ip", "link", "set", NODE_BRIDGE, "up")
    # A ClusterIP that no kube-proxy rule rewrites would otherwise follow the default route off the machine.
    run("ip", "route", "replace", SERVICE_CIDR, "dev", NODE_BRIDGE)
    write_sysctl("net.bridge.bridge-nf-call-iptables", "1")
    for ipt in ("iptables", "ip6tables"):
        # mangle FORWARD runs before every filter-table ACCEPT kube-proxy or kube-router may add.
        run(ipt, "-t", "mangle", "-N", GUARD_CHAIN, check=False)
        run(ipt, "-t", "mangle", "-F", GUARD_CHAIN)
        run(ipt, "-t", "mangle", "-A", GUARD_CHAIN, "-i", POD_BRIDGE, "-o", POD_BRIDGE, "-j", "RETURN")
        run(ipt, "-t", "mangle", "-A", GUARD_CHAIN, "-i", POD_BRIDGE, "-j", "DROP")
        run(ipt, "-t", "mangle", "-A", GUARD_CHAIN, "-o", POD_BRIDGE, "-j", "DROP")
        if not _has_jump(ipt):
            run(ipt, "-t", "mangle", "-I", "FORWARD", "1", "-j", GUARD_CHAIN)


def _has_jump(ipt: str) -> bool:
    env = {**os.environ, "PATH": ENV_PATH}
    return (
        subprocess.run(
            [ipt, "-t", "mangle", "-C", "FORWARD", "-j", GUARD_CHAIN], env=env, capture_output=True
        ).returncode
        == 0
    )


def guard_active() -> bool:
    return all(_has_jump(ipt) for ipt in ("iptables", "ip6tables"))


# ------------------------------------------------------------------------------------------- configs


def write_configs(plane: kube_plane.ControlPlane) -> None:
    """containerd, CNI, kubelet, kube-proxy, CoreDNS, kube-router: files under STATE."""
    cd = STATE / "containerd"
    for d in (cd, STATE / "cni", STATE / "kubelet-pki", VARLIB / "containerd"):
        kube_plane.private_dir(d)
    (cd / "config.toml").write_text(f"""version = 2
root = "{VARLIB / "containerd"}"
state = "{cd / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{cd / "containerd.sock"}"
[ttrpc]
  address = "{cd / "containerd.sock.ttrpc"}"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{VARLIB / "opt"}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # The VM lacks CAP_SYS_RESOURCE: runc cannot set a negative oom_score_adj (the one hard blocker).
  restrict_oom_score_adj = true
  disable_hugetlb_controller = true
  tolerate_missing_hugetlb_controller = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{STATE / "runc"}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{STATE / "cni"}"
    max_conf_num = 1
""")
    (STATE / "cni" / "10-tfdist.conflist").write_text(
        json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": CNI_NET,
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": POD_BRIDGE,
                        "isGateway": True,
                        "ipMasq": False,
                        "hairpinMode": True,
                        # nftables rules (table bridge nat) drop every frame a pod sends with a source
                        # MAC other than its own: no ARP spoofing of a neighbour or the gateway, so no
                        # spoofed sources past NetworkPolicy. Needs the nft binary (nftables).
                        "macspoofchk": True,
                        "ipam": {
                            "type": "host-local",
                            "ranges": [[{"subnet": POD_CIDR}]],
                            "routes": [{"dst": "0.0.0.0/0"}],
                            "dataDir": str(STATE / "cni-ipam"),
                        },
                    },
                    {"type": "portmap", "capabilities": {"portMappings": True}},
                ],
            },
            indent=1,
        )
    )
    pki = Path(plane.workdir) / "pki"
    certs = {
        "kubelet": (f"system:node:{NODE_NAME}", ["system:nodes"]),
        "kube-proxy": ("system:kube-proxy", []),
        "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", ["system:masters"]),
    }
    for name, (cn, orgs) in certs.items():
        issue_client_cert(pki, name, cn, orgs)

    def kubeconfig(name: str, user: dict) -> str:
        path = STATE / f"{name}.kubeconfig"
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "tfdist",
                    "cluster": {"server": plane.server, "certificate-authority": plane.ca_file},
                }
            ],
            "users": [{"name": name, "user": user}],
            "contexts": [{"name": "tfdist", "context": {"cluster": "tfdist", "user": name}}],
            "current-context": "tfdist",
        }
        kube_plane.write_private(path, yaml.safe_dump(cfg))
        return str(path)

    kubeconfig(
        "kubelet", {"client-certificate": str(pki / "kubelet.crt"), "client-key": str(pki / "kubelet.key")}
    )
    kubeconfig(
        "kube-proxy",
        {"client-certificate": str(pki / "kube-proxy.crt"), "client-key": str(pki / "kube-proxy.key")},
    )
    # CoreDNS and kube-router read cluster-wide; on this test cluster they use the admin token.
    kubeconfig("admin", {"token": plane.token})
    (STATE / "resolv.conf").write_text("# pods get cluster DNS only; nothing outside this machine\n")
    kubelet_cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": plane.ca_file},
        },
        "authorization": {"mode": "Webhook"},
        # A container without a seccomp profile gets the runtime's default one (RuntimeDefault), not
        # Unconfined: Pod Security baseline lets a pod leave the profile out.
        "seccompDefault": True,
        "cgroupDriver": "cgroupfs",  # containerd 1.6 has no RuntimeConfig RPC
        "failCgroupV1": False,  # this VM is cgroup v1 (hybrid)
        "failSwapOn": False,
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "clusterDNS": [NODE_IP],
        "clusterDomain": "cluster.local",
        "resolvConf": str(STATE / "resolv.conf"),
        "containerRuntimeEndpoint": f"unix://{STATE / 'containerd' / 'containerd.sock'}",
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "rotateCertificates": False,
        "maxPods": 110,
        # Keep the kubelet's files under our directories (the defaults are /var/log/pods and
        # /usr/libexec/kubernetes); down removes them.
        "podLogsDir": str(VARLIB / "pod-logs"),
        "volumePluginDir": str(VARLIB / "kubelet" / "volume-plugins"),
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
    }
    issue_client_cert(pki, "kubelet-serving", NODE_NAME, [], server_ip=NODE_IP)
    (STATE / "kubelet-config.yaml").write_text(yaml.safe_dump(kubelet_cfg))
    (STATE / "Corefile").write_text(f"""cluster.local in-addr.arpa ip6.arpa {{
    bind {NODE_IP}
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {STATE / "admin.kubeconfig"} tfdist
        pods insecure
    }}
    cache 5
}}
. {{
    bind {NODE_IP}
    # No upstream: nothing leaves this machine.
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
""")


def issue_client_cert(pki: Path, name: str, cn: str, orgs: list[str], server_ip: str | None = None) -> None:
    """A certificate signed by the plane's CA (client auth, or server auth for ``server_ip``)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1)
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=30))
    )
    if server_ip:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(server_ip)), x509.DNSName(cn)]),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    kube_plane.write_private(pki / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
    kube_plane.write_private(
        pki / f"{name}.key",
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        ),
    )


def node_args(plane: kube_plane.ControlPlane) -> dict[str, list[str]]:
    kubelet_root = VARLIB / "kubelet"
    return {
        "containerd": ["--config", str(STATE / "containerd" / "config.toml")],
        "kubelet": [
            f"--config={STATE / 'kubelet-config.yaml'}",
            f"--kubeconfig={STATE / 'kubelet.kubeconfig'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            f"--root-dir={kubelet_root}",
            f"--cert-dir={STATE / 'kubelet-pki'}",
            "--node-labels=tfdist.io/real-node=true",
            "--v=1",
        ],
        "kube-proxy": [
            f"--kubeconfig={STATE / 'kube-proxy.kubeconfig'}",
            f"--hostname-override={NODE_NAME}",
            "--proxy-mode=iptables",
            f"--cluster-cidr={POD_CIDR}",
            f"--bind-address={NODE_IP}",
            # Leave the host's conntrack sysctls and oom_score_adj alone (no CAP_SYS_RESOURCE anyway).
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0",
            "--oom-score-adj=0",
            "--nodeport-addresses=primary",
            "--iptables-localhost-nodeports=false",
            "--healthz-bind-address=127.0.0.1:10256",
            "--metrics-bind-address=127.0.0.1:10249",
        ],
        "coredns": ["-conf", str(STATE / "Corefile"), "-dns.port", "53"],
        "kube-router": [
            f"--kubeconfig={STATE / 'admin.kubeconfig'}",
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            "--enable-cni=false",
            "--enable-ipv6=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--hostname-override={NODE_NAME}",
            "--health-port=0",
            "--metrics-port=0",
        ],
    }


# ------------------------------------------------------------------------------------------ the plane


class NodePlane(kube_plane.ControlPlane):
    """The test plane on the node address with a fixed port and the flags a real kubelet needs."""

    def _prepare(self) -> None:
        super()._prepare()
        pki = Path(self.workdir) / "pki"
        issue_client_cert(
            pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", ["system:masters"]
        )
        self.args["kube-apiserver"] += [
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
        ]
        # The controller-manager must not hand out pod CIDRs or touch routes: the CNI config owns them.
        self.args["kube-controller-manager"] += [
            "--allocate-node-cidrs=false",
            "--configure-cloud-routes=false",
        ]


# ----------------------------------------------------------------------------------------------- up


def spawn(name: str, exe: Path, args: list[str], procs: list[Proc]) -> Proc:
    logf = open(STATE / f"{name}.log", "ab")
    try:
        p = subprocess.Popen(
            [str(exe), *args],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=STATE,
            env={**kube_plane.go_env(), "PATH": ENV_PATH, "HOME": str(STATE)},
            start_new_session=True,  # outlives `up`: stopped by `down`, by pid and start time
        )
    finally:
        logf.close()
    rec = Proc(name, p.pid, proc_start(p.pid) or "", str(exe))
    procs.append(rec)
    return rec


def kube_proxy_synced() -> bool:
    return "KUBE-SVC" in run("iptables-save", "-t", "nat")


def wait_kube_proxy(nb: Path, args: list[str], procs: list[Proc], state: dict) -> float:
    """Seconds until kube-proxy's rules for the kubernetes Service exist; a kube-proxy whose first
    sync failed is restarted once (its own retry gave no rules within 120 s in CI), then has 90 s more."""
    t0 = time.monotonic()
    try:
        wait("kube-proxy rules for the kubernetes Service", kube_proxy_synced, 60, procs, log="kube-proxy")
    except ClusterError as first:
        old = next(p for p in procs if p.name == "kube-proxy")
        if not alive(old):
            raise
        log(f"kube-proxy has no rules after 60 s; restarting it once ({str(first).splitlines()[0]})")
        _stop(old, grace=3)
        procs.remove(old)
        spawn("kube-proxy", nb / "kube-proxy", args, procs)
        save_state({**state, "network": True, "procs": [p.__dict__ for p in procs]})
        wait("kube-proxy rules for the kubernetes Service", kube_proxy_synced, 90, procs, log="kube-proxy")
    return time.monotonic() - t0


def tail(name: str, lines: int = 15) -> str:
    try:
        return "\n".join((STATE / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait(what: str, check, timeout: float, procs: list[Proc], log: str = "") -> float:
    """Seconds until check() holds; ClusterError if a process exits or timeout passes (with `log`'s tail:
    what the component that should have done it said)."""
    t0 = time.monotonic()
    last: Exception | None = None
    while True:
        for p in procs:
            if not alive(p):
                raise ClusterError(f"{p.name} exited while waiting for {what}; {p.name}.log:\n{tail(p.name)}")
        try:
            if check():
                return time.monotonic() - t0
        except (OSError, ValueError, urllib.error.URLError, subprocess.SubprocessError, ClusterError) as e:
            last = e
        if time.monotonic() - t0 > timeout:
            said = f"; {log}.log:\n{tail(log, 40)}" if log else ""
            raise ClusterError(
                f"timed out after {timeout:.0f} s waiting for {what} (last error: {last!r}){said}"
            )
        time.sleep(0.2)


def port_in_use(address: str, port: int, udp: bool = False) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM) as s:
        if not udp:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return True
    return False


def dns_query(name: str, server: str = NODE_IP, timeout: float = 2.0) -> list[str]:
    """A-record lookup with the stdlib (the host's resolver must not be involved)."""
    qid = os.getpid() & 0xFFFF
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    q += struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(q, (server, 53))
        data, _ = s.recvfrom(4096)
    ancount = struct.unpack(">H", data[6:8])[0]
    pos = len(q)
    ips = []
    for _ in range(ancount):
        if data[pos] & 0xC0 == 0xC0:
            pos += 2
        else:
            while data[pos]:
                pos += data[pos] + 1
            pos += 1
        rtype, _cls, _ttl, rdlen = struct.unpack(">HHIH", data[pos : pos + 10])
        pos += 10
        if rtype == 1 and rdlen == 4:
            ips.append(socket.inet_ntoa(data[pos : pos + 4]))
        pos += rdlen
    return ips


def ctr(*args: str, timeout: float = 300) -> str:
    return run(
        "ctr",
        "--address",
        str(STATE / "containerd" / "containerd.sock"),
        "-n",
        "k8s.io",
        *args,
        timeout=timeout,
    )


def import_pause_image() -> None:
    names = ctr("images", "ls", "-q").split()
    for stray in (n for n in names if n.startswith("import-")):  # ctr's default name; confuses the CRI
        ctr("images", "rm", stray)
    if PAUSE_IMAGE in names:
        return
    work = STATE / "pause-image"
    shutil.rmtree(work, ignore_errors=True)
    (work / "rootfs").mkdir(parents=True)
    shutil.copy2(pause_binary(), work / "rootfs" / "pause")
    layout = work / "oci"
    umoci = ["umoci", "--log", "error"]
    run(*umoci, "init", "--layout", str(layout))
    run(*umoci, "new", "--image", f"{layout}:{PAUSE_IMAGE.rsplit(':', 1)[1]}")
    run(
        *umoci,
        "raw",
        "add-layer",
        "--image",
        f"{layout}:{PAUSE_IMAGE.rsplit(':', 1)[1]}",
        str(_tar_dir(work / "rootfs", work / "l.tar")),
    )
    run(
        *umoci,
        "config",
        "--image",
        f"{layout}:{PAUSE_IMAGE.rsplit(':', 1)[1]}",
        "--config.entrypoint",
        "/pause",
        "--config.user",
        "65535",
    )
    tar = work / "pause.tar"
    run("tar", "-C", str(layout), "-cf", str(tar), ".")
    ctr("images", "import", "--base-name", PAUSE_IMAGE.rsplit(":", 1)[0], str(tar))
    shutil.rmtree(work, ignore_errors=True)


def _tar_dir(src: Path, out: Path) -> Path:
    run("tar", "--numeric-owner", "--owner=0", "--group=0", "-C", str(src), "-cf", str(out), ".")
    return out


def node_ready(plane: kube_plane.ControlPlane) -> bool:
    node = plane.get(f"/api/v1/nodes/{NODE_NAME}")
    return bool(node) and kube_plane.node_usable(node)


def up(build: bool = True, kueue: bool = False) -> dict:
    """Start everything (idempotent: a healthy cluster is left as it is); returns the state. ``kueue``:
    also Kueue's manager with its CRDs and admission webhooks (`scripts/cluster up --kueue`), started on a
    healthy cluster that runs without it."""
    if os.geteuid() != 0:
        raise ClusterError(
            "must run as root (containerd, the kubelet and iptables need it): sudo scripts/cluster up"
        )
    state = load_state()
    if state:
        st = status()
        if st["healthy"]:
            log("already up")
            if kueue and not kueue_running(state):
                state = start_kueue_recorded(state)
            return state
        dead = ", ".join(n for n, ok in st["components"].items() if not ok) or "machine changes"
        log(f"found a half-started cluster ({dead} not running): taking it down first")
        down()
    # Ports the cluster needs on this machine (the node address is ours, so a taker holds a wildcard).
    for what, addr, port, udp in (
        ("kube-apiserver", NODE_IP, API_PORT, False),
        ("kubelet", NODE_IP, 10250, False),
        ("kubelet healthz", "127.0.0.1", 10248, False),
        ("kube-proxy healthz", "127.0.0.1", 10256, False),
        ("CoreDNS", NODE_IP, 53, True),
    ):
        probe = addr if os.path.exists(f"/sys/class/net/{NODE_BRIDGE}") else "0.0.0.0"
        if port_in_use(probe, port, udp):
            raise ClusterError(
                f"port {port} ({what}) is taken on this machine; free it"
                + (" or set TFDIST_CLUSTER_PORT" if what == "kube-apiserver" else "")
                + ": nothing was started"
            )
    if build:
        ensure_built()
    else:
        miss = missing_packages() + missing_node_binaries()
        if miss:
            raise ClusterError(f"missing: {', '.join(miss)} (run scripts/cluster up, which builds them)")
        ensure_pause_image_binary()
    check_cni_bridge()
    t0 = time.monotonic()
    kube_plane.private_dir(STATE)
    record_path = STATE / "machine-before.json"
    if not record_path.exists():
        record_path.write_text(json.dumps(machine_record(), indent=1))
    procs: list[Proc] = []
    state = {"procs": [], "started": time.time(), "node_ip": NODE_IP, "api_port": API_PORT}
    timings: dict[str, float] = {}
    try:
        setup_network()
        save_state({**state, "network": True})
        plane = NodePlane(
            plane_bin_dir(),
            address=NODE_IP,
            apiserver_port=API_PORT,
            workdir=STATE / "plane",
            detach=True,
            port_block=kube_plane.REALNODE_PORTS,
        )
        # Files first (the plane's PKI signs the node's certificates), then processes.
        plane._prepare()
        write_configs(plane)
        nb = node_bin_dir()
        spawn(
            "containerd",
            Path(shutil.which("containerd", path=ENV_PATH) or "containerd"),
            node_args(plane)["containerd"],
            procs,
        )
        save_state({**state, "network": True, "procs": [p.__dict__ for p in procs]})
        timings["containerd"] = wait("containerd", lambda: bool(ctr("version", timeout=5)), 30, procs)
        clean_containers()
        import_pause_image()
        # The plane: same code as the test fixture, with the fixed workdir and port prepared above.
        plane._prepare = lambda: None  # type: ignore[method-assign]
        t = time.monotonic()
        plane.start(timeout=120)
        timings["plane"] = time.monotonic() - t
        for name, p in plane.procs.items():
            procs.append(Proc(name, p.pid, proc_start(p.pid) or "", str(plane.bin_dir / name)))
        save_state({**state, "network": True, "procs": [p.__dict__ for p in procs]})
        args = node_args(plane)
        spawn("kubelet", nb / "kubelet", args["kubelet"], procs)
        save_state({**state, "network": True, "procs": [p.__dict__ for p in procs]})
        timings["kubelet"] = wait("node Ready", lambda: node_ready(plane), 90, procs, log="kubelet")
        spawn("kube-proxy", nb / "kube-proxy", args["kube-proxy"], procs)
        spawn("coredns", nb / "coredns", args["coredns"], procs)
        save_state({**state, "network": True, "procs": [p.__dict__ for p in procs]})
        timings["kube-proxy"] = wait_kube_proxy(nb, args["kube-proxy"], procs, state)
        # After kube-proxy's first sync, not beside it: kube-router rewrites the whole filter table
        # (save, edit, restore), so a chain kube-proxy made in between is lost (CI before 3ab8814:
        # "Chain 'KUBE-EXTERNAL-SERVICES' does not exist", and no rules within 120 s).
        spawn("kube-router", nb / "kube-router", args["kube-router"], procs)
        save_state({**state, "network": True, "procs": [p.__dict__ for p in procs]})
        timings["coredns"] = wait(
            "CoreDNS answering kubernetes.default",
            lambda: dns_query("kubernetes.default.svc.cluster.local") == ["10.0.0.1"],
            60,
            procs,
            log="coredns",
        )
        timings["kube-router"] = wait(
            "kube-router's firewall chains",
            lambda: "KUBE-ROUTER-FORWARD" in run("iptables-save", "-t", "filter"),
            60,
            procs,
            log="kube-router",
        )
        if kueue:
            t = time.monotonic()
            k = start_kueue_on(plane)
            pid = plane.procs["kueue"].pid
            procs.append(Proc("kueue", pid, proc_start(pid) or "", str(k.bin_dir / "kueue")))
            save_state({**state, "network": True, "procs": [p.__dict__ for p in procs]})
            timings["kueue"] = time.monotonic() - t
    except BaseException as e:
        known = isinstance(e, ClusterError | kube_plane.ControlPlaneError)
        log(f"up failed, undoing what it did: {e if known else repr(e)}")
        with contextlib.suppress(Exception):
            down()
        if isinstance(e, kube_plane.ControlPlaneError):
            raise ClusterError(f"the control plane did not start: {e}") from e
        raise
    state.update(
        network=True,
        procs=[p.__dict__ for p in procs],
        kubeconfig=str(plane.kubeconfig),
        server=plane.server,
        token=plane.token,
        ca_file=plane.ca_file,
        kubectl=str(plane.bin_dir / "kubectl"),
        up_seconds=round(time.monotonic() - t0, 1),
        timings={k: round(v, 2) for k, v in timings.items()},
    )
    save_state(state)
    log(f"up in {state['up_seconds']} s ({', '.join(f'{k} {v:.1f}s' for k, v in timings.items())})")
    return state


# ---------------------------------------------------------------------------------------------- Kueue
# Kueue's manager as a host process against the node's API server (tests/kueue_proc.py, the kwok plane's
# code): its CRDs, its webhook configurations calling https://127.0.0.1:<port>, a Configuration with the
# pod integration only. `up --kueue` records it with the cluster's processes (down ends it); the realnode
# Kueue tests start one of their own for their module (start_kueue) and stop it after (stop_kueue).


def kueue_host(state: dict, *, detach: bool) -> kube_plane.ControlPlane:
    """The running cluster as the plane KueueProcess expects: its API server and admin credentials, the
    plane's workdir for Kueue's files and log, ports from the real node's block. `detach`: the process
    outlives this one (`up --kueue`); else it dies with it."""
    c = _client(state)
    c.workdir = STATE / "plane"
    c.procs = {}
    c.ports = {}
    c.port_block = kube_plane.REALNODE_PORTS
    c.detach = detach
    return c


def start_kueue_on(plane: kube_plane.ControlPlane, timeout: float = 180):
    """KueueProcess(plane) started: returns once a queued pod really gets Kueue's gate."""
    from tests.kueue_proc import KueueProcess

    return KueueProcess(plane).start(timeout=timeout)


def kueue_running(state: dict) -> bool:
    """Whether `up --kueue` started a Kueue manager that still runs."""
    return any(p.name == "kueue" and alive(p) for p in recorded_procs(state))


def start_kueue_recorded(state: dict) -> dict:
    """Kueue on an already healthy cluster, recorded as one of its processes (`up --kueue` again)."""
    t = time.monotonic()
    host = kueue_host(state, detach=True)
    k = start_kueue_on(host)
    pid = host.procs["kueue"].pid
    state["procs"] = [
        *state.get("procs", []),
        Proc("kueue", pid, proc_start(pid) or "", str(k.bin_dir / "kueue")).__dict__,
    ]
    state.setdefault("timings", {})["kueue"] = round(time.monotonic() - t, 2)
    save_state(state)
    log(f"kueue up in {state['timings']['kueue']} s")
    return state


def start_kueue(state: dict):
    """A Kueue manager for one test module (dies with the test process): (KueueProcess, seconds)."""
    t = time.monotonic()
    k = start_kueue_on(kueue_host(state, detach=False))
    return k, time.monotonic() - t


def stop_kueue(state: dict, k) -> None:
    """End the module's Kueue and remove its webhook configurations (failurePolicy Fail: with the manager
    gone, they would refuse every pod the other tests create). Its CRDs stay (a next start is faster)."""
    k.stop()
    if not os.path.exists(state["ca_file"]):  # the cluster went first (the session's last test): no webhooks
        return
    c = _client(state)
    for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
        listed = c.get(f"/apis/admissionregistration.k8s.io/v1/{kind}") or {"items": []}
        for wh in listed["items"]:
            if wh["metadata"]["name"].startswith("kueue-"):
                with contextlib.suppress(urllib.error.HTTPError):
                    c.request(
                        "DELETE", f"/apis/admissionregistration.k8s.io/v1/{kind}/{wh['metadata']['name']}"
                    )


def clean_containers() -> None:
    """Containers and sandboxes an earlier cluster left in containerd's metadata (images stay)."""
    for kind in ("tasks", "containers"):
        ids = ctr(kind, "ls", "-q").split()
        for cid in ids:
            if kind == "tasks":
                quiet(
                    "ctr",
                    "--address",
                    str(STATE / "containerd" / "containerd.sock"),
                    "-n",
                    "k8s.io",
                    "tasks",
                    "kill",
                    "-s",
                    "KILL",
                    cid,
                )
                quiet(
                    "ctr",
                    "--address",
                    str(STATE / "containerd" / "containerd.sock"),
                    "-n",
                    "k8s.io",
                    "tasks",
                    "rm",
                    "-f",
                    cid,
                )
            else:
                quiet(
                    "ctr",
                    "--address",
                    str(STATE / "containerd" / "containerd.sock"),
                    "-n",
                    "k8s.io",
                    "containers",
                    "rm",
                    cid,
                )


def eval_lines(state: dict) -> str:
    bindir = Path(state["kubectl"]).parent
    return (
        f"export KUBECONFIG={state['kubeconfig']}\n"
        f"export PATH={bindir}:$PATH\n"
        f"# kubectl get nodes  (node {NODE_NAME}; API {state['server']}); scripts/cluster down stops it all\n"
    )


# --------------------------------------------------------------------------------------------- status


def our_processes(state: dict) -> list[Proc]:
    """Every live process of this cluster: recorded ones, and any other whose command line names the
    cluster's state directory (containerd shims, a component an interrupted up did not record). The
    kwok test planes of other test runs use the same binaries but never this directory: they are spared."""
    found: dict[int, Proc] = {}
    for p in recorded_procs(state):
        if alive(p):
            found[p.pid] = p
    mark = str(STATE) + "/"
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in found or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            exe = os.readlink(d / "exe")
        except OSError:
            continue
        if any(mark in c.decode(errors="replace") for c in cmd):
            found[int(d.name)] = Proc(Path(exe).name, int(d.name), proc_start(int(d.name)) or "", exe)
    return list(found.values())


def status() -> dict:
    state = load_state()
    comps = {}
    rec = {p.name: p for p in recorded_procs(state)}
    for name in COMPONENTS:
        comps[name] = name in rec and alive(rec[name])
    if "kueue" in rec:  # up --kueue
        comps["kueue"] = alive(rec["kueue"])
    result = {"components": comps, "network": bool(state.get("network")), "node_ready": False}
    if comps.get("kube-apiserver"):
        with contextlib.suppress(Exception):
            plane = _client(state)
            result["node_ready"] = node_ready(plane)
    result["healthy"] = all(comps.values()) and result["node_ready"] and guard_active()
    return result


def _client(state: dict) -> kube_plane.ControlPlane:
    """A ControlPlane object used only as a REST client for a running cluster."""
    import ssl

    c = kube_plane.ControlPlane.__new__(kube_plane.ControlPlane)
    c.server, c.token, c.kubeconfig, c.ca_file = (
        state["server"],
        state["token"],
        state["kubeconfig"],
        state["ca_file"],
    )
    c._ssl = ssl.create_default_context(cafile=state["ca_file"])
    return c


# ----------------------------------------------------------------------------------------------- down


def down() -> dict:
    """Stop everything this cluster started and undo its machine changes; safe to repeat, and complete
    after any crash (processes are found in /proc, changes by comparison with the first up's record)."""
    if os.geteuid() != 0:
        raise ClusterError("must run as root: sudo scripts/cluster down")
    t0 = time.monotonic()
    state = load_state()
    before = {}
    with contextlib.suppress(OSError, ValueError):
        before = json.loads((STATE / "machine-before.json").read_text())
    rec = {p.name: p for p in recorded_procs(state)}
    # Graceful where possible: the kubelet first (no restarts), then containers via runc, then the rest.
    for name in ("kube-router", "coredns", "kube-proxy", "kubelet"):
        if name in rec and alive(rec[name]):
            _stop(rec[name], grace=3)
    kill_containers()
    for name in reversed(COMPONENTS):
        if name in rec and alive(rec[name]):
            _stop(rec[name], grace=5)
    for p in our_processes(state):  # shims, strays, anything of ours an earlier crash left
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
    kill_containers()
    unmount_ours()
    undo_network(before)
    if not before:
        # No record of the machine before (never up, or removed by hand): only our own named changes
        # can be undone safely; never guess about other chains, ipsets or sysctls.
        for ipt in ("iptables", "ip6tables"):
            if _has_jump(ipt):
                quiet(ipt, "-t", "mangle", "-D", "FORWARD", "-j", GUARD_CHAIN)
            quiet(ipt, "-t", "mangle", "-F", GUARD_CHAIN)
            quiet(ipt, "-t", "mangle", "-X", GUARD_CHAIN)
        shutil.rmtree(VARLIB / "kubelet", ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)
        return {"seconds": round(time.monotonic() - t0, 1)}
    remove_netns(before.get("netns", []))
    nb = None
    with contextlib.suppress(Exception):
        nb = node_bin_dir()
    if nb and os.access(nb / "kube-proxy", os.X_OK):
        for mode in ("iptables",):
            subprocess.run(
                [str(nb / "kube-proxy"), "--cleanup", f"--proxy-mode={mode}"],
                capture_output=True,
                env={**os.environ, "PATH": ENV_PATH},
                timeout=60,
            )
    undo_netfilter(before)
    for k, v in (before.get("sysctls") or {}).items():
        if v is not None and read_sysctl(k) != v:
            write_sysctl(k, v)
    for leftover in (VARLIB / "kubelet", VARLIB / "pod-logs", VARLIB / "hub-db"):
        shutil.rmtree(leftover, ignore_errors=True)
    remove_log_links()
    for name in os.listdir("/var/lib/cni/results") if os.path.isdir("/var/lib/cni/results") else []:
        if name.startswith(CNI_NET + "-"):
            with contextlib.suppress(OSError):
                os.unlink(f"/var/lib/cni/results/{name}")
    shutil.rmtree(STATE, ignore_errors=True)
    return {"seconds": round(time.monotonic() - t0, 1)}


def _stop(p: Proc, grace: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive(p) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(p):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        for _ in range(50):
            if not alive(p):
                break
            time.sleep(0.1)


def kill_containers() -> None:
    """Every container runc knows under our root, even when containerd and the shims are gone."""
    root = STATE / "runc"
    if not root.is_dir():
        return
    for ns_root in [root, *[d for d in root.iterdir() if d.is_dir()]]:
        try:
            listing = json.loads(
                run("runc", "--root", str(ns_root), "list", "-f", "json", check=False) or "null"
            )
        except ValueError:
            continue
        for c in listing or []:
            quiet("runc", "--root", str(ns_root), "kill", "-a", c["id"], "KILL")
        time.sleep(0.2 if listing else 0)
        for c in listing or []:
            quiet("runc", "--root", str(ns_root), "delete", "-f", c["id"])


def unmount_ours() -> None:
    """Every mount under the cluster's directories (overlay rootfs, shm, netns, the kubelet's bind mount,
    projected volumes), deepest first."""
    prefixes = (str(STATE) + "/", str(VARLIB) + "/")
    for _ in range(3):
        points = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            mp = line.split()[4].replace("\\040", " ")
            if mp.startswith(prefixes) or mp in (str(STATE), str(VARLIB)):
                points.append(mp)
        if not points:
            return
        for mp in sorted(set(points), key=len, reverse=True):
            if subprocess.run(["umount", mp], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", mp], capture_output=True)


def remove_log_links() -> None:
    """The kubelet's /var/log/containers symlinks (a fixed path) into our pod log dir."""
    d = Path("/var/log/containers")
    for link in d.glob("*.log") if d.is_dir() else []:
        with contextlib.suppress(OSError):
            if os.readlink(link).startswith(str(VARLIB)):
                link.unlink()


def remove_netns(before: list[str]) -> None:
    if not os.path.isdir("/run/netns"):
        return
    for name in os.listdir("/run/netns"):
        if name.startswith("cni-") and name not in before:
            quiet("ip", "netns", "delete", name)


def undo_network(before: dict) -> None:
    quiet("ip", "route", "del", SERVICE_CIDR, "dev", NODE_BRIDGE)
    links_before = set(before.get("links", []))
    for link in os.listdir("/sys/class/net"):
        master = Path(f"/sys/class/net/{link}/master")
        if link.startswith("veth") and link not in links_before and master.exists():
            if Path(os.readlink(master)).name == POD_BRIDGE:
                quiet("ip", "link", "delete", link)
    for br in (POD_BRIDGE, NODE_BRIDGE):
        if br not in links_before and os.path.exists(f"/sys/class/net/{br}"):
            quiet("ip", "link", "delete", br)


def undo_netfilter(before: dict) -> None:
    """Remove every iptables chain, ipset and nftables table that was not there before the first up."""
    for fam in ("iptables", "ip6tables"):
        old = before.get(fam) or {}
        now = iptables_chains(f"{fam}-save")
        for table, chains in now.items():
            new = [c for c in chains if c not in old.get(table, []) and c not in BUILTIN_CHAINS]
            if not new:
                continue
            # Drop rules in the remaining chains that jump to a new chain, then flush and delete the new ones.
            rules = run(f"{fam}-save", "-t", table, check=False).splitlines()
            for line in rules:
                parts = line.split()
                if (
                    line.startswith("-A ")
                    and parts[1] not in new
                    and any(parts[i] in ("-j", "-g") and parts[i + 1] in new for i in range(len(parts) - 1))
                ):
                    # iptables-save quotes comments; let iptables re-parse the rule through a shell-free split
                    quiet(fam, "-t", table, "-D", *_unquote(line)[1:])
            for c in new:
                quiet(fam, "-t", table, "-F", c)
            for c in new:
                quiet(fam, "-t", table, "-X", c)
    old_sets = set(before.get("ipsets") or [])
    if shutil.which("ipset", path=ENV_PATH):
        for _ in range(2):  # list:set members first
            for s in run("ipset", "list", "-n", check=False).split():
                if s not in old_sets:
                    quiet("ipset", "destroy", s)
    old_tables = set(before.get("nft") or [])
    for t in nft_tables():
        if t not in old_tables:
            quiet("nft", "delete", "table", *t.split())


BUILTIN_CHAINS = ("INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING")


def _unquote(line: str) -> list[str]:
    import shlex

    return shlex.split(line)


def leftovers() -> dict:
    """What of a cluster is on this machine now (empty lists = nothing): for the teardown test and status."""
    before = {}
    with contextlib.suppress(OSError, ValueError):
        before = json.loads((STATE / "machine-before.json").read_text())
    out: dict[str, list] = {}
    out["processes"] = [f"{p.name}:{p.pid}" for p in our_processes(load_state())]
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4]
        if mp.startswith((str(STATE), str(VARLIB))) or mp.startswith("/run/netns/cni-"):
            mounts.append(mp)
    out["mounts"] = mounts
    out["links"] = [lk for lk in (NODE_BRIDGE, POD_BRIDGE) if os.path.exists(f"/sys/class/net/{lk}")]
    chains = []
    for fam in ("iptables", "ip6tables"):
        for table, cs in iptables_chains(f"{fam}-save").items():
            chains += [f"{fam}/{table}/{c}" for c in cs if c.startswith(("KUBE-", "TFDIST-"))]
    out["chains"] = chains
    out["ipsets"] = (
        [
            s
            for s in run("ipset", "list", "-n", check=False).split()
            if s not in set(before.get("ipsets") or [])
        ]
        if shutil.which("ipset", path=ENV_PATH)
        else []
    )
    logs = Path("/var/log/containers")
    out["log_links"] = [
        str(lk) for lk in (logs.glob("*.log") if logs.is_dir() else []) if str(VARLIB) in os.readlink(lk)
    ]
    out["routes"] = [r for r in run("ip", "route", "show", SERVICE_CIDR).splitlines() if r.strip()]
    return out


# ----------------------------------------------------------------------------------------------- user

# NAME becomes a namespace (tfdist-user-NAME): a DNS-1123 label of at most 63 characters
USER_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,49}[a-z0-9])?")
USER_NS_PREFIX = "tfdist-user-"
ADMISSION_POLICY = REPO / "hub_config" / "admission-policy.yaml"
_VAP = "/apis/admissionregistration.k8s.io/v1/"


class UsageError(ClusterError):
    """Bad input or nothing to act on: the caller's mistake (exit 2), and nothing was created."""


def user_namespace(name: str) -> str:
    return USER_NS_PREFIX + name


def _running_api(state: dict) -> kube_plane.ControlPlane:
    """A client for the cluster `state` names, once its API server answers; else UsageError."""
    hint = 'no cluster is up: start one with  eval "$(sudo scripts/cluster up)"'
    if not state.get("server"):
        raise UsageError(hint)
    try:
        c = _client(state)
    except (OSError, KeyError) as e:  # the state of a cluster that is gone, or a broken one
        raise UsageError(f"{hint} (its record in {STATE} is unusable: {e!r})") from e
    try:
        if c.request("GET", "/readyz", timeout=5) != "ok":
            raise UsageError(f"{hint} (the API server at {state['server']} is not ready)")
    except (OSError, urllib.error.URLError) as e:
        raise UsageError(f"{hint} (the API server at {state['server']} does not answer: {e})") from e
    return c


def apply_admission_policy(c: kube_plane.ControlPlane) -> None:
    """hub_config/admission-policy.yaml, applied server-side (as `kubectl apply --server-side` would):
    without it a user namespace's policy parameters bind nothing. Server-side apply has no
    read-modify-write, so two `cluster user` runs at once (two tests on two workers) do not conflict,
    where a GET then PUT lost the race with 409 Conflict in CI."""
    for doc in yaml.safe_load_all(ADMISSION_POLICY.read_text()):
        if not doc:
            continue
        plural = {"ValidatingAdmissionPolicy": "validatingadmissionpolicies"}.get(
            doc["kind"], "validatingadmissionpolicybindings"
        )
        item = f"{_VAP}{plural}/{doc['metadata']['name']}?fieldManager=tfdist-cluster&force=true"
        c.request("PATCH", item, doc, content_type="application/apply-patch+yaml")


def user(name: str) -> str:
    """NAME's namespace prepared by the spawner's own code (tfdist.kube.apply.setup_user, a CPU-only
    profile), and a kubeconfig, as YAML, acting as NAME's notebook service account (a TokenRequest)."""
    import asyncio
    import base64

    if not USER_NAME.fullmatch(name):
        raise UsageError(
            f"invalid user name {name!r}: 1 to 51 characters of a-z, 0-9 and '-', starting and ending "
            "with a letter or digit (it becomes the namespace " + user_namespace("NAME") + ")"
        )
    if os.geteuid() != 0:
        raise ClusterError(
            "must run as root (the cluster's admin credentials are root's): sudo scripts/cluster user"
        )
    state = load_state()
    c = _running_api(state)
    apply_admission_policy(c)
    ca = base64.b64encode(Path(state["ca_file"]).read_bytes()).decode()

    async def prepare() -> dict:
        from kubernetes_asyncio import client, config

        from tfdist.kube.apply import setup_user

        cfg = client.Configuration()
        await config.load_kube_config(config_file=state["kubeconfig"], client_configuration=cfg)
        async with client.ApiClient(cfg) as api:
            return await setup_user(api, name, user_namespace(name), server=state["server"], ca_data_b64=ca)

    kubeconfig = asyncio.run(prepare())
    log(f"namespace {user_namespace(name)} ready; the kubeconfig acts as {name}'s notebook for an hour")
    return yaml.safe_dump(kubeconfig, sort_keys=False)


# ------------------------------------------------------------------------------------------------ CLI


def private_stdout() -> None:
    """`scripts/cluster user NAME > NAME.kubeconfig`: the caller's shell made that file with the caller's
    umask (often 0644, 0666 under umask 000), and the kubeconfig holds a bearer token. A regular file on
    stdout is narrowed to 0600 before anything is written to it; one that cannot be narrowed gets nothing."""
    import stat

    try:
        fd = sys.stdout.fileno()
        st = os.fstat(fd)
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture): nothing to narrow
        return
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o077:
        return
    try:
        os.fchmod(fd, 0o600)
    except OSError as e:
        raise ClusterError(
            f"the kubeconfig holds a token, and the file it would go to is readable by others and cannot "
            f"be made private ({e.strerror}): redirect it to a new file of your own"
        ) from e


USAGE = "usage: scripts/cluster up|down|status|hub (up --kueue: with Kueue), or scripts/cluster user NAME"


def main(argv: list[str]) -> int:
    if argv[:1] == ["user"]:
        if len(argv) != 2:
            print(f"{USAGE}\n  user takes one NAME", file=sys.stderr)
            return 2
        try:
            private_stdout()
            sys.stdout.write(user(argv[1]))
        except UsageError as e:
            print(f"cluster: {e}", file=sys.stderr)
            return 2
        except ClusterError as e:
            print(f"cluster: {e}", file=sys.stderr)
            return 1
        return 0
    if argv == ["hub"]:  # the z2jh chart on the running cluster (tests/realnode_z2jh.py)
        # its errors are tests.realnode's classes (this file may run as __main__)
        from tests import realnode, realnode_z2jh

        try:
            with locked():
                sys.stdout.write(realnode_z2jh.hub_cli())
        except realnode.UsageError as e:
            print(f"cluster: {e}", file=sys.stderr)
            return 2
        except realnode.ClusterError as e:
            print(f"cluster: {e}", file=sys.stderr)
            return 1
        return 0
    kueue = argv == ["up", "--kueue"]
    if kueue:
        argv = ["up"]
    if len(argv) != 1 or argv[0] not in ("up", "down", "status"):
        print(f"{USAGE}\n  unknown or missing verb: {' '.join(argv) or '(none)'}", file=sys.stderr)
        return 2
    verb = argv[0]
    try:
        if os.geteuid() != 0:
            raise ClusterError(f"must run as root (containerd, the kubelet and iptables need it): {verb}")
        with locked():
            if verb == "up":
                state = up(kueue=kueue)
                sys.stdout.write(eval_lines(state))
            elif verb == "down":
                r = down()
                log(f"down in {r['seconds']} s; nothing of the cluster is left")
            else:
                st = status()
                for name, ok in st["components"].items():
                    print(f"{name:24} {'running' if ok else 'not running'}")
                print(f"{'node ' + NODE_NAME:24} {'Ready' if st['node_ready'] else 'not ready'}")
                if st["healthy"]:
                    overall = "up"
                elif not any(st["components"].values()):
                    overall = "down"
                else:
                    overall = "half-started (run scripts/cluster down, or up again)"
                print(f"{'cluster':24} {overall}")
                return 0 if st["healthy"] else 3
    except ClusterError as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
