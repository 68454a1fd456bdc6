"""The real node's own hardening (issue 22), attacked from inside pods as a tenant would:

- a container that names no seccomp profile runs under the runtime's default one (kubelet
  ``seccompDefault``), not unconfined: /proc/self/status says ``Seccomp: 2`` (an explicit Unconfined pod,
  the control, says 0);
- a pod that sends Ethernet frames with a source MAC address other than its own (ARP spoofing, then spoofed
  sources past NetworkPolicy) does not get them onto the pod bridge (the CNI bridge's ``macspoofchk``): a
  neighbour pod capturing on its interface sees the sender's genuine frames and none of the spoofed ones.
"""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest
import yaml

from tests import realnode

pytestmark = [pytest.mark.k8s, pytest.mark.realnode]

SECCOMP = "print([ln for ln in open('/proc/self/status') if ln.startswith('Seccomp:')][0].strip())"


def _container(real_cluster, script: str, security: dict) -> dict:
    """``extra`` for RealCluster.pod: its one container with a container-level securityContext (this
    kubelet and containerd 1.6 dropped a pod-level runAsUser and seccompProfile: measured)."""
    return {
        "containers": [
            {
                "name": "main",
                "image": real_cluster.base_image,
                "imagePullPolicy": "Never",
                "command": ["python3", "-u", "-c", script],
                "resources": {"limits": {"cpu": "200m", "memory": "128Mi"}},
                "securityContext": security,
            }
        ]
    }


def test_a_pod_without_a_seccomp_profile_runs_under_the_runtime_default(real_cluster, real_ns):
    phase, logs = real_cluster.run_to_end(real_ns, "default-profile", SECCOMP)
    assert phase == "Succeeded", logs
    assert re.search(r"^Seccomp:\s+2$", logs, re.M), logs  # 2 = filter mode
    # the control: the same pod asking for Unconfined reads 0 (so the line above is the profile's doing)
    unconfined = _container(real_cluster, SECCOMP, {"seccompProfile": {"type": "Unconfined"}})
    phase, logs = real_cluster.run_to_end(real_ns, "unconfined", SECCOMP, extra=unconfined)
    assert phase == "Succeeded", logs
    assert re.search(r"^Seccomp:\s+0$", logs, re.M), logs
    # the setting doing it
    assert yaml.safe_load((realnode.STATE / "kubelet-config.yaml").read_text())["seccompDefault"] is True


ETHERTYPE = 0x88B5  # IEEE 802 local experimental: nothing else on the bridge uses it

# Captures frames of ETHERTYPE on its own interface for `seconds`, printing each marker once.
RECEIVER = f"""
import socket, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons({ETHERTYPE}))
s.bind(("eth0", 0))
s.settimeout(0.5)
print("READY", open("/sys/class/net/eth0/address").read().strip(), flush=True)
seen, end = set(), time.monotonic() + 40
while time.monotonic() < end:
    try:
        frame = s.recv(2048)
    except socket.timeout:
        continue
    marker = frame[14:60].split(b"\\0")[0].decode(errors="replace")
    if marker not in seen:
        seen.add(marker)
        print("GOT", frame[6:12].hex(":"), marker, flush=True)
    if any(m.startswith("GENUINE") for m in seen) and "DONE" in seen:
        break
print("END", sorted(seen), flush=True)
"""

# Sends, for a few seconds, frames to `dst` with its own source MAC and with a forged one.
SENDER = """
import socket, sys, time
dst, nonce, forged = bytes.fromhex(sys.argv[1].replace(":", "")), sys.argv[2], sys.argv[3]
own = bytes.fromhex(open("/sys/class/net/eth0/address").read().strip().replace(":", ""))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
etype = (ETHERTYPE).to_bytes(2, "big")
def frame(src, marker):
    return dst + src + etype + marker.encode().ljust(46, b"\\0")
for _ in range(20):
    s.send(frame(bytes.fromhex(forged.replace(":", "")), "SPOOFED-" + nonce))
    s.send(frame(own, "GENUINE-" + nonce))
    time.sleep(0.1)
time.sleep(1)  # the receiver stops at DONE: every spoofed frame had its chance to arrive first
s.send(frame(own, "DONE"))
print("SENT", own.hex(":"), flush=True)
""".replace("ETHERTYPE", str(ETHERTYPE))


def _wait_log(real_cluster, ns: str, pod: str, pattern: str, timeout: float = 60) -> re.Match:
    deadline = time.monotonic() + timeout
    logs = ""
    while time.monotonic() < deadline:
        try:
            logs = real_cluster.logs(ns, pod)
        except Exception:  # the container has not started yet
            logs = ""
        m = re.search(pattern, logs or "", re.M)
        if m:
            return m
        time.sleep(0.3)
    raise AssertionError(f"{pod}: no {pattern!r} in its log after {timeout} s: {logs!r}")


def test_a_pod_cannot_send_frames_with_a_forged_source_mac(real_cluster, real_ns):
    nonce = uuid.uuid4().hex[:8]
    forged = "02:de:ad:be:ef:01"  # a neighbour that does not exist (locally administered)
    # root in the pod (the image's user is 1000; NET_RAW needs it) and no seccomp filter: the bridge's own
    # check is tested alone (Pod Security baseline forbids Unconfined, the node's default profile is another
    # layer; either may be missing on a cluster)
    raw = {"runAsUser": 0, "seccompProfile": {"type": "Unconfined"}}
    real_cluster.pod(real_ns, "receiver", RECEIVER, extra=_container(real_cluster, RECEIVER, raw))
    real_cluster.wait_pod(real_ns, "receiver", ("Running",))
    dst = _wait_log(real_cluster, real_ns, "receiver", r"^READY (\S+)$").group(1)
    rules = realnode.run("nft", "list", "table", "bridge", "nat")  # one chain pair per pod interface
    sender_script = f"import sys; sys.argv[1:] = {[dst, nonce, forged]!r}\n" + SENDER
    phase, sender_log = real_cluster.run_to_end(
        real_ns, "sender", sender_script, extra=_container(real_cluster, sender_script, raw)
    )
    assert phase == "Succeeded", sender_log
    sender_mac = re.search(r"^SENT (\S+)$", sender_log, re.M).group(1)
    got = real_cluster.wait_pod(real_ns, "receiver", ("Succeeded", "Failed"), timeout=60)
    logs = real_cluster.logs(real_ns, "receiver")
    assert got["status"]["phase"] == "Succeeded", logs
    # the sender's own frames cross the bridge (so the capture works and the path is open) ...
    assert f"GOT {sender_mac} GENUINE-{nonce}" in logs, logs
    # ... and not one with the forged source
    assert f"SPOOFED-{nonce}" not in logs and forged not in logs, logs
    # the setting doing it, and (above) the bridge plugin's nftables chains for the running receiver
    conflist = json.loads((realnode.STATE / "cni" / "10-tfdist.conflist").read_text())
    assert conflist["plugins"][0]["macspoofchk"] is True
    assert "macspoofchk-" in rules and "ether saddr" in rules, rules
