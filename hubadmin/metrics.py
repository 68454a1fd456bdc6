"""Prometheus text exposition for the GPU admin service.

Per-GPU gauges reuse the DCGM exporter's names and labels (``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_FB_USED``
with ``gpu``, ``UUID``, ``modelName``) so an existing DCGM Grafana panel works on them; the hub's own view
(user, server, profile) rides along as extra labels. Our own counts are ``tfdist_*``.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

__all__ = ["render_metrics"]


def _esc(v: Any) -> str:
    return str(v if v is not None else "").replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(d: dict[str, Any]) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in d.items()) + "}"


def render_metrics(state: Any) -> str:
    out: list[str] = []

    def head(name: str, kind: str, help_: str) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")

    held: Counter[tuple[str, str, str]] = Counter()
    busy: Counter[tuple[str, str, str]] = Counter()
    util_lines, mem_lines, idle_lines = [], [], []
    now = time.time()
    no_data = 0
    for rec in sorted(state.servers.values(), key=lambda r: r.key):
        thr = state.threshold(rec)
        fresh = rec.fresh(now)
        no_data += not fresh
        utils, mems = rec.last_utils(now), rec.last_mem(now)
        for i, g in enumerate(rec.gpus):
            lab = {
                "gpu": g.index,
                "UUID": g.uuid,
                "modelName": g.name,
                "hub_user": rec.user,
                "server": rec.name,
                "profile": rec.profile or "",
            }
            u = utils[i] if i < len(utils) else None
            m = mems[i] if i < len(mems) else None
            if u is not None:
                util_lines.append(f"DCGM_FI_DEV_GPU_UTIL{_labels(lab)} {u:g}")
            if m is not None:
                mem_lines.append(f"DCGM_FI_DEV_FB_USED{_labels(lab)} {m:g}")
            key = (rec.user, rec.profile or "", g.name or "")
            held[key] += 1
            if u is not None and u >= thr:
                busy[key] += 1
        if rec.gpus and rec.idle_s is not None and fresh:
            idle_lines.append(
                f"tfdist_server_gpu_idle_seconds{_labels({'hub_user': rec.user, 'server': rec.name})} "
                f"{rec.idle_s:g}"
            )
    head("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %), as the server's NVML sampler read it.")
    out += util_lines
    head("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).")
    out += mem_lines
    for name, counts, what in (
        ("tfdist_gpus_held", held, "GPUs held by running servers"),
        ("tfdist_gpus_busy", busy, "held GPUs at or above the profile's idle threshold"),
        ("tfdist_gpus_idle", {k: held[k] - busy[k] for k in held}, "held GPUs below the idle threshold"),
    ):
        head(name, "gauge", f"{what}, per user, profile and model.")
        for (user, profile, model), n in sorted(counts.items()):
            out.append(f"{name}{_labels({'hub_user': user, 'profile': profile, 'modelName': model})} {n}")
    if state.machine_gpus is not None:
        head("tfdist_gpus_free", "gauge", "GPUs of this machine no server holds, per model.")
        for name in sorted(set(state.machine_gpus)):
            n = max(0, state.machine_gpus.count(name) - sum(v for k, v in held.items() if k[2] == name))
            out.append(f"tfdist_gpus_free{_labels({'modelName': name})} {n}")
    head("tfdist_server_gpu_idle_seconds", "gauge", "Seconds since any of the server's GPUs was busy.")
    out += idle_lines
    head("tfdist_culler_warnings_total", "counter", "Idle warnings sent to users.")
    out.append(f"tfdist_culler_warnings_total {state.warned_total}")
    head("tfdist_culler_culls_total", "counter", "GPU servers stopped for idleness.")
    out.append(f"tfdist_culler_culls_total {state.culled_total}")
    head("tfdist_servers_without_data", "gauge", "Running servers with no recent report (never culled).")
    out.append(f"tfdist_servers_without_data {no_data}")
    head("tfdist_server_checks_total", "counter", "Activity reports accepted from servers.")
    out.append(f"tfdist_server_checks_total {state.checks_total}")
    head("tfdist_server_reports_refused_total", "counter", "Activity reports refused (bad body or token).")
    out.append(f"tfdist_server_reports_refused_total {state.refused_total}")
    head("tfdist_server_check_seconds_total", "counter", "Time spent on reports (seconds).")
    out.append(f"tfdist_server_check_seconds_total {state.check_seconds_total:.6f}")
    return "\n".join(out) + "\n"
