"""Kueue on the kwok plane (issue 25): fair share between users, and what queueing costs a job's start.
Run:  python benchmarks/bench_kueue.py [--users 2,3] [--jobs 4] [--run-s 3] [--levels 1,10,100]
(against the installed tfdist; one plane with Kueue, ``ControlPlane(kueue=True)``). Prints JSON and writes
benchmarks/results/kueue_fairshare.json and benchmarks/results/kueue_latency.json, each with the machine.

1. Fair share. N users (``--users``) each submit a burst of ``--jobs`` jobs of 8 GPUs (1 worker, 1 PS) to one
   queue of 8 GPUs, one user after the other (user 1's whole burst first, while a job of another namespace
   holds the queue's GPUs), then that job ends; one job runs at a time. A job "runs" ``--run-s`` seconds once
   all its pods are bound, then the benchmark stops it. Over the first half of
   the jobs (the contended stretch: over all of them every user gets the same), the admitted GPU-seconds
   per user, each user's wait for its first admission, and the admission order; once on a queue with
   fair_sharing off (Kueue's first come, first served) and once on one with it on (Admission Fair Sharing
   between the users' LocalQueues; Kueue's Configuration from tests/kueue_proc.py: usage sampled each
   second, half-life 60 s, GPUs only).
2. Scheduling overhead. Bursts of 1, 10 and 100 jobs (1 worker, 1 PS, 0.1 core each; all fit at once) from
   one user, each job's latency from its submission to all 3 of its pods bound (the backend's submit, and
   with Kueue: the pod group's Workload, its admission, the gates lifted; then the scheduler), with Kueue
   (a LocalQueue) and without (the same jobs without a queue) in the same run on the same plane, the two
   alternating per level; the ratio of the medians (and of the 90th percentiles) Kueue / without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_k8s import H100, IMAGE  # noqa: E402
from bench_k8s_jobs import _private_agent_port  # noqa: E402

from tests.kube_plane import ControlPlane  # noqa: E402

KUEUE_API = "/apis/kueue.x-k8s.io/v1beta2"
SELECTOR = {"nvidia.com/gpu.product": H100}
POD_COUNT = 3  # chief, 1 worker, 1 PS


def profiles(queue: str, *, gpus: int | None, fair: bool, groups: list[str]) -> dict[str, Any]:
    """A profiles document with one queue (a fresh name per phase: Kueue v0.17.0 reads a queue's
    admissionScope once, when it first sees the queue)."""
    return {
        "gpu_models": {"h100": {"display_name": "H100", "node_selector": SELECTOR}},
        "kueue": {
            "cohort": "bench",
            "queues": {queue: {"gpus": {"h100": gpus} if gpus is not None else {}, "fair_sharing": fair}},
        },
        "profiles": [
            {
                "slug": "gpu",
                "display_name": "GPU",
                "groups": groups,
                "cpu": {"min": 1, "max": 8, "default": 1},
                "memory_gib": {"min": 1, "max": 8, "default": 1},
                "gpus": {"max": 8},
                "gpu_models": ["h100"],
                "kueue_queue": queue,
                "images": ["img"],
            }
        ],
    }


async def api_client(plane: ControlPlane) -> Any:
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=plane.kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)


async def converge(plane: ControlPlane, doc: dict[str, Any], namespaces: list[str]) -> None:
    from tfdist.kube import queueing_apply as qa
    from tfdist.spawner.profiles import parse_profiles

    cfg = parse_profiles(doc)
    async with await api_client(plane) as api:
        await qa.converge(api, cfg)
        for ns in namespaces:
            await qa.converge_user(api, cfg, ns, ["bench"])


LIFELINE_GRACE_S = [3600]  # --lifeline-grace


def make_backend(plane: ControlPlane, ns: str, queue: str | None, gpu: bool) -> Any:
    from tfdist.backends.kubernetes import KubernetesBackend
    from tfdist.settings import from_environ

    # the lifeline's longest grace: with 100 jobs on a loaded machine the renewals of the roots' deadlines
    # (60 s ahead) fell behind and the Job controller ended jobs (DeadlineExceeded) before their pods were
    # bound; a detached job has none, but its submit waits for the handover, which a kwok pod never makes
    env = {"TFDIST_NAMESPACE": ns, "TFDIST_WORKER_IMAGE": IMAGE, "USER": ns}
    env["TFDIST_LIFELINE_GRACE_S"] = str(LIFELINE_GRACE_S[0])
    if queue:
        env["TFDIST_KUEUE_QUEUE"] = queue
    b = KubernetesBackend(from_environ(env), kubeconfig=plane.kubeconfig)
    if gpu:
        b.node_selector = SELECTOR
    return b


def job_spec(name: str, ns: str, *, gpus: int) -> Any:
    from tfdist.jobspec import JobSpec

    kw: dict[str, Any] = {"gpus_per_worker": gpus} if gpus else {"cpu": 0.1, "memory_bytes": 128 * 2**20}
    return JobSpec(
        name=name,
        user=ns,
        namespace=ns,
        backend="kubernetes",
        workers=1,
        ps=1,
        timeout_s=600,
        **kw,
    )


class PodTimes:
    """When each job's pods were first seen bound (nodeName set), from one pod watch per namespace: the
    benchmark reads its own clock on each event, not the API server's second-granular timestamps."""

    def __init__(self, plane: ControlPlane, namespaces: list[str]) -> None:
        self.plane = plane
        self.namespaces = namespaces
        self.bound: dict[tuple[str, str], dict[str, float]] = {}  # (ns, job) -> pod -> time bound
        self._tasks: list[asyncio.Task] = []
        self._api: Any = None

    async def __aenter__(self) -> PodTimes:
        self._api = await api_client(self.plane)
        for ns in self.namespaces:
            self._tasks.append(asyncio.ensure_future(self._follow(ns)))
        await asyncio.sleep(0.5)  # the watches are open
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._api.close()

    async def _follow(self, ns: str) -> None:
        from kubernetes_asyncio import client, watch

        from tfdist.kube import names as kn

        v1 = client.CoreV1Api(self._api)
        while True:
            w = watch.Watch()
            try:
                async for ev in w.stream(v1.list_namespaced_pod, ns, timeout_seconds=300):
                    pod = ev["object"]
                    job = (pod.metadata.labels or {}).get(kn.L_JOB)
                    if job and pod.spec.node_name:
                        self.bound.setdefault((ns, job), {}).setdefault(pod.metadata.name, time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception:  # a dropped watch: open it again
                await asyncio.sleep(0.2)
            finally:
                w.stop()

    def all_bound_at(self, ns: str, job: str) -> float | None:
        got = self.bound.get((ns, job), {})
        return max(got.values()) if len(got) >= POD_COUNT else None


def pods_of(plane: ControlPlane, ns: str) -> list[dict]:
    return plane.get(f"/api/v1/namespaces/{ns}/pods")["items"]


async def until(what: str, check: Any, timeout: float, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(every)


def quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]
    return {
        "median_s": round(statistics.median(xs), 3),
        "p90_s": round(p90, 3),
        "max_s": round(xs[-1], 3),
        "mean_s": round(statistics.fmean(xs), 3),
    }


# ------------------------------------------------------------------------------------ 1. fair share


def running(plane: ControlPlane, namespaces: list[str]) -> list[tuple[str, str]]:
    from tfdist.kube import queueline as ql

    out = []
    for ns in namespaces:
        for wl in plane.get(f"{KUEUE_API}/namespaces/{ns}/workloads")["items"]:
            if ql.is_admitted(wl) and not ql.is_finished(wl):
                out.append((ns, wl["metadata"]["name"]))
    return out


def active(plane: ControlPlane, queue: str) -> bool:
    cq = plane.get(f"{KUEUE_API}/clusterqueues/{queue}") or {}
    conds = cq.get("status", {}).get("conditions", [])
    return any(c["type"] == "Active" and c["status"] == "True" for c in conds)


async def fair_share_phase(
    plane: ControlPlane, users: list[str], queue: str, fair: bool, jobs: int, run_s: float
) -> dict[str, Any]:
    # a job of another user (namespace "<queue>-hold") holds the queue's 8 GPUs until every burst is in,
    # then ends. Not Kueue's stopPolicy Hold: a stopped queue's LocalQueues are not sampled, and the first
    # admission after it charges its user's LocalQueue the whole pause as if the job had held its GPUs all
    # along (2.5 GPUs of usage against 0.9 for the next user's three jobs, measured). Not a quota of 0:
    # the backend refuses a job its queue can never hold
    holder = plane.create_namespace(f"{queue}-hold")
    await converge(plane, profiles(queue, gpus=8, fair=fair, groups=["bench"]), [*users, holder])
    await until(f"ClusterQueue {queue} active", lambda: active(plane, queue), 60)
    backends = {u: make_backend(plane, u, queue, gpu=True) for u in [*users, holder]}
    await backends[holder].submit(job_spec("hold", holder, gpus=8), b"p", _launch())
    await until("the holder admitted", lambda: running(plane, [holder]), 120)
    names = {u: [f"{queue}-{i}" for i in range(1, jobs + 1)] for u in users}
    rounds = len(users) * jobs // 2
    order: list[dict[str, Any]] = []
    # every burst queued before anything runs: each admitted job then holds its GPUs run_s, not as long as
    # the other users take to submit
    try:
        async with PodTimes(plane, users) as times:
            for u in users:
                await asyncio.gather(
                    *(backends[u].submit(job_spec(n, u, gpus=8), b"p", _launch()) for n in names[u])
                )
                # a Workload per job before the next user submits: Kueue orders by creation time in
                # whole seconds, so the users' bursts are a second apart
                await until(
                    f"{u}'s burst queued",
                    lambda u=u: len(plane.get(f"{KUEUE_API}/namespaces/{u}/workloads")["items"]) >= jobs,
                    120,
                )
                await asyncio.sleep(1.1)
            t0 = time.monotonic()
            await backends[holder].stop("hold")
            for _ in range(rounds):
                got = await until("a job admitted", lambda: running(plane, users), 120)
                ((ns, job),) = got
                start = await until(
                    f"{job} of {ns} bound", lambda ns=ns, job=job: times.all_bound_at(ns, job), 120
                )
                await asyncio.sleep(run_s)
                end = time.monotonic()
                await backends[ns].stop(job)
                order.append(
                    {"user": ns, "job": job, "bound_at_s": round(start - t0, 3), "ran_s": end - start}
                )
                await until(f"{job} of {ns} over", lambda r=(ns, job): r not in running(plane, users), 120)
    finally:
        await asyncio.gather(
            backends[holder].stop("hold"),
            *(backends[u].stop(n) for u in users for n in names[u]),
            return_exceptions=True,
        )
        for b in backends.values():
            await b.close()
        await until("the bursts gone", lambda: not any(pods_of(plane, u) for u in users), 180, every=0.5)
    gpu_s = {u: round(sum(8 * o["ran_s"] for o in order if o["user"] == u), 2) for u in users}
    total = sum(gpu_s.values()) or 1.0
    share = [v / total for v in gpu_s.values()]
    first_wait = {u: next((o["bound_at_s"] for o in order if o["user"] == u), None) for u in users}
    return {
        "fair_sharing": fair,
        "queue": queue,
        "jobs_admitted": rounds,
        "gpu_seconds_per_user": gpu_s,
        "share_per_user": {u: round(s, 3) for u, s in zip(users, share, strict=True)},
        # Jain's index: 1 = equal shares, 1/N = one user took it all
        "jain_index": round(sum(share) ** 2 / (len(share) * sum(s * s for s in share)), 3),
        "first_bound_after_the_queue_opened_s": first_wait,
        "order": [o["user"] for o in order],
    }


def _launch() -> Any:
    from tfdist.backends.base import Launch

    return Launch()


# ------------------------------------------------------------------------------- 2. scheduling overhead


async def latency_burst(plane: ControlPlane, ns: str, queue: str | None, n: int, tag: str) -> dict[str, Any]:
    b = make_backend(plane, ns, queue, gpu=False)
    names = [f"{tag}-{i}" for i in range(n)]
    created: dict[str, float] = {}
    submit_s: list[float] = []

    async def submit(name: str) -> None:
        created[name] = time.monotonic()
        await b.submit(job_spec(name, ns, gpus=0), b"p", _launch())
        submit_s.append(time.monotonic() - created[name])

    try:
        async with PodTimes(plane, [ns]) as times:
            await asyncio.gather(*(submit(x) for x in names))

            def bound_or_ended() -> bool:
                ended = deadline_ended(plane, ns)
                if ended:  # the lifeline fell behind: say so at once, not after the 900 s wait
                    raise RuntimeError(
                        f"{len(ended)} of {n} jobs ended by their lifeline's deadline: {ended[:5]}"
                    )
                return all(times.all_bound_at(ns, x) for x in names)

            await until(f"{n} jobs bound", bound_or_ended, 900, every=0.5)
            lat = [times.all_bound_at(ns, x) - created[x] for x in names]  # type: ignore[operator]
    finally:
        await asyncio.gather(*(b.stop(x) for x in names), return_exceptions=True)
        await b.close()
        await until(f"{ns} empty", lambda: not pods_of(plane, ns), 300, every=0.5)
    return {"jobs": n, "latency": quantiles(lat), "submit": quantiles(submit_s)}


def deadline_ended(plane: ControlPlane, ns: str) -> list[str]:
    """Jobs the Job controller ended at their activeDeadlineSeconds (a lifeline not renewed in time)."""
    jobs = (plane.get(f"/apis/batch/v1/namespaces/{ns}/jobs") or {}).get("items", [])
    return [
        j["metadata"]["name"]
        for j in jobs
        if any(
            c.get("type") == "Failed" and c.get("reason") == "DeadlineExceeded"
            for c in (j.get("status") or {}).get("conditions") or []
        )
    ]


async def latency(plane: ControlPlane, levels: list[int]) -> dict[str, Any]:
    queue = "lat"
    plain_ns, kueue_ns = "lat-plain", "lat-kueue"
    for ns in (plain_ns, kueue_ns):
        plane.create_namespace(ns)
    await converge(plane, profiles(queue, gpus=None, fair=False, groups=["bench"]), [kueue_ns])
    rows = []
    for i, n in enumerate(levels):
        order = [("kueue", kueue_ns, queue), ("without", plain_ns, None)]
        if i % 2:
            order.reverse()  # neither always goes first on a plane still busy with the last level
        got = {}
        for mode, ns, q in order:
            got[mode] = await latency_burst(plane, ns, q, n, f"l{n}-{mode[0]}")
        k, w = got["kueue"]["latency"], got["without"]["latency"]
        rows.append(
            {
                "queued_jobs": n,
                "with_kueue": got["kueue"],
                "without_kueue": got["without"],
                "ratio_median": round(k["median_s"] / w["median_s"], 2),
                "ratio_p90": round(k["p90_s"] / w["p90_s"], 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return {"levels": rows}


# ----------------------------------------------------------------------------------------------- main


async def run(
    plane: ControlPlane, users: list[int], jobs: int, run_s: float, levels: list[int], write: Any
) -> None:
    """Fair share first (a few minutes), then the latency bursts; each results file written once its
    part is done."""
    fair_rows = []
    for n in users:
        names = [f"u{n}-{i}" for i in range(1, n + 1)]
        for ns in names:
            plane.create_namespace(ns)
        row: dict[str, Any] = {"users": n, "jobs_per_user": jobs, "run_s": run_s}
        for fair in (False, True):
            row["with_fair_sharing" if fair else "without"] = await fair_share_phase(
                plane, names, f"{'fair' if fair else 'fifo'}{n}", fair, jobs, run_s
            )
            print(json.dumps(row), flush=True)
        fair_rows.append(row)
    if fair_rows:
        write("kueue_fairshare.json", {"fair_share": fair_rows})
    if levels:
        write("kueue_latency.json", await latency(plane, levels))


def tables(out_dir: Path) -> str:
    """docs/queueing.md's tables, written from the results files (never typed by hand)."""
    lines = []
    lat_file, fair_file = out_dir / "kueue_latency.json", out_dir / "kueue_fairshare.json"
    if lat_file.exists():
        lat = json.loads(lat_file.read_text())
        m = lat["machine"]
        lines += [
            f"Admission latency per job, submission to all 3 pods bound (`results/kueue_latency.json`, "
            f"{m['measured_utc'][:10]}, load average {m['load_avg_1m_5m'][0]}):",
            "",
            "| jobs at once | with Kueue: median / p90 | without: median / p90 | ratio median | ratio p90 |",
            "|---:|---:|---:|---:|---:|",
        ]
        for r in lat["levels"]:
            k, w = r["with_kueue"]["latency"], r["without_kueue"]["latency"]
            lines.append(
                f"| {r['queued_jobs']} | {k['median_s']:.2f} s / {k['p90_s']:.2f} s | "
                f"{w['median_s']:.2f} s / {w['p90_s']:.2f} s | "
                f"{r['ratio_median']:.2f} | {r['ratio_p90']:.2f} |"
            )
        lines.append("")
    if fair_file.exists():
        fair = json.loads(fair_file.read_text())
        m = fair["machine"]
        lines += [
            f"Admitted GPU-seconds per user over the first half of the jobs (`results/kueue_fairshare.json`, "
            f"{m['measured_utc'][:10]}, load average {m['load_avg_1m_5m'][0]}):",
            "",
            "| users | jobs each | fair sharing | GPU-s per user (share) | Jain's index | admission order |",
            "|---:|---:|---|---|---:|---|",
        ]
        for row in fair["fair_share"]:
            for key in ("without", "with_fair_sharing"):
                ph = row[key]
                users = list(ph["gpu_seconds_per_user"])
                short = {u: f"u{i + 1}" for i, u in enumerate(users)}
                per = ", ".join(
                    f"{short[u]} {ph['gpu_seconds_per_user'][u]:.0f} ({ph['share_per_user'][u]:.0%})"
                    for u in users
                )
                order = " ".join(short[u] for u in ph["order"])
                lines.append(
                    f"| {row['users']} | {row['jobs_per_user']} | {'on' if ph['fair_sharing'] else 'off'} | "
                    f"{per} | {ph['jain_index']:.2f} | {order} |"
                )
    return "\n".join(lines)


def main() -> None:
    _private_agent_port()
    ap = argparse.ArgumentParser()
    ap.add_argument("--tables", action="store_true", help="print the docs' tables from the results files")
    ap.add_argument("--users", default="2,3")
    ap.add_argument("--jobs", type=int, default=4, help="jobs per user's burst")
    ap.add_argument("--run-s", type=float, default=3.0, help="how long each admitted job runs")
    ap.add_argument("--levels", default="1,10,100", help="queued jobs per latency burst")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument(
        "--lifeline-grace",
        type=int,
        default=3600,
        help="the jobs' lifeline grace in seconds (the product's default is 60; the results files' runs "
        "used 3600, see make_backend)",
    )
    args = ap.parse_args()
    LIFELINE_GRACE_S[0] = args.lifeline_grace
    if args.tables:
        print(tables(Path(args.out_dir)))
        return
    users = [int(x) for x in args.users.split(",") if x]
    levels = [int(x) for x in args.levels.split(",") if x]
    plane = ControlPlane(kueue=True)
    out = Path(args.out_dir)
    t0 = time.monotonic()
    started: dict[str, float] = {}

    def write(name: str, doc: dict[str, Any]) -> None:
        common = {
            "lifeline_grace_s": LIFELINE_GRACE_S[0],
            "plane_with_kueue_start_s": round(started["plane_s"], 1),
            "kueue_version": "v0.17.0",
            "machine": machine(),
        }
        text = json.dumps({**doc, **common}, indent=2)
        print(text, flush=True)
        (out / name).write_text(text + "\n")

    try:
        plane.start()
        started["plane_s"] = time.monotonic() - t0
        plane.add_gpu_nodes(1, 8, H100)  # the fair-share queue's 8 GPUs
        # room for 100 jobs of 3 pods at once (110 pods per kwok node), no GPUs used
        plane.add_gpu_nodes(4, 0, "cpu-only", cpu="64", name_prefix="kwok-cpu")
        asyncio.run(run(plane, users, args.jobs, args.run_s, levels, write))
    finally:
        plane.stop()


if __name__ == "__main__":
    main()
