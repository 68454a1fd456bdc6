"""GPU admin service benchmarks: the culler's cost per server per check, and the admin page with 200 servers.

Run:  python benchmarks/bench_gpu_admin.py [--servers 200]   (against the installed tfdist)

Simulated servers (one tornado process beside this one, so the service's side is measured alone): a hub
API answering GET /users with N running GPU servers, and each server's ``tfdist/api/activity`` answering
like the real handler (1 GPU, samples at 10 s). Measured:

* one round of `GpuAdminState.refresh()` with culling due (activity request + decision per server):
  wall time per round, and the service process's CPU time per server per check;
* the admin page in Debian's chromium: time from navigation until all N rows are rendered, and the
  ``api/servers`` JSON size and time (the page's 2 s poll).

Results: benchmarks/results/gpu_admin.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import socket
import statistics
import time
from importlib import resources
from pathlib import Path
from typing import Any

from machine import machine  # benchmarks/machine.py: the script's own folder is on sys.path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fake_cluster(port: int, n: int) -> None:
    """Hub API + N servers' activity routes, in their own process."""
    import tornado.web
    from tornado.ioloop import IOLoop

    start = time.time()

    def report(busy: float, history: float) -> dict[str, Any]:
        now = time.time()
        samples = [[t, [3.0], [1200.0]] for t in range(int(now - min(history, 3600)), int(now), 10)]
        return {
            "now": now,
            "since": start,
            "interval_s": 10,
            "gpus": [
                {"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-x", "memory_total_mib": 81559}
            ],
            "idle_s": now - start + 7200,  # idle for hours: every check takes the warning path
            "samples": samples,
            "jobs_running": [],
            "notice": None,
        }

    class Users(tornado.web.RequestHandler):
        def get(self) -> None:
            users = [
                {
                    "name": f"user{i:03d}",
                    "servers": {
                        "": {
                            "ready": True,
                            "url": f"/user/user{i:03d}/",
                            "user_options": {"profile": "gpu", "gpu_model": "h100"},
                        }
                    },
                }
                for i in range(n)
            ]
            self.finish(json.dumps(users))

    class Activity(tornado.web.RequestHandler):
        def get(self, user: str) -> None:
            busy = float(self.get_argument("busy_percent", "5"))
            hist = float(self.get_argument("history", "0"))
            self.finish(json.dumps(report(busy, hist)))

    class Notice(tornado.web.RequestHandler):
        def post(self, user: str) -> None:
            self.finish("{}")

        def delete(self, user: str) -> None:
            self.finish("{}")

    app = tornado.web.Application(
        [
            (r"/hub/api/users", Users),
            (r"/user/([^/]+)/tfdist/api/activity", Activity),
            (r"/user/([^/]+)/tfdist/api/notice", Notice),
        ]
    )
    app.listen(port, "127.0.0.1")
    IOLoop.current().start()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def bench_rounds(port: int, n: int, rounds: int) -> dict[str, Any]:
    from tfdist.hubadmin.config import CullingConfig, CullingRule
    from tfdist.hubadmin.service import GpuAdminState

    # idle for hours, 60 min limit: every check warns or keeps a warning (the busiest decision path)
    culling = CullingConfig(check_interval_s=0.001, default=CullingRule(idle_minutes=60, warn_minutes=10))
    st = GpuAdminState(
        api_url=f"http://127.0.0.1:{port}/hub/api",
        api_token="x",
        public_url=f"http://127.0.0.1:{port}",
        culling=culling,
    )
    await st.refresh()  # first round: each server's whole hour of history
    walls, cpus = [], []
    for _ in range(rounds):
        await asyncio.sleep(0.01)
        c0, t0 = _cpu(), time.perf_counter()
        await st.refresh()
        walls.append(time.perf_counter() - t0)
        cpus.append(_cpu() - c0)
    return {
        "servers": n,
        "round_wall_ms_median": statistics.median(walls) * 1000,
        "per_server_wall_ms": statistics.median(walls) * 1000 / n,
        "per_server_cpu_ms": statistics.median(cpus) * 1000 / n,
        "warned": st.warned_total,
        "state": st,
    }


def bench_page(state: Any, n: int, loads: int) -> dict[str, Any]:
    """The real page and script, served with the real view JSON (auth left out: one hub token check)."""
    import threading

    import tornado.web
    from playwright.sync_api import sync_playwright
    from tornado.ioloop import IOLoop

    static = resources.files("tfdist.hubadmin") / "static"
    page_html = (static / "admin.html").read_text().replace("{{xsrf}}", "x")
    sizes, api_ms = [], []

    class Page(tornado.web.RequestHandler):
        def get(self) -> None:
            self.finish(page_html)

    class Script(tornado.web.RequestHandler):
        def get(self) -> None:
            self.set_header("Content-Type", "text/javascript")
            self.finish((static / "admin.js").read_text())

    class Servers(tornado.web.RequestHandler):
        def get(self) -> None:
            t0 = time.perf_counter()
            body = state.view_json()
            api_ms.append((time.perf_counter() - t0) * 1000)
            sizes.append(len(body))
            self.set_header("Content-Type", "application/json")
            self.finish(body)

    port = free_port()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def serve() -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())
        app = tornado.web.Application(
            [(r"/a/", Page), (r"/a/admin.js", Script), (r"/a/api/servers", Servers)]
        )
        holder["server"] = app.listen(port, "127.0.0.1")
        holder["loop"] = IOLoop.current()
        ready.set()
        IOLoop.current().start()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    ready.wait()
    times = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            for _ in range(loads):
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                t0 = time.perf_counter()
                page.goto(f"http://127.0.0.1:{port}/a/")
                page.wait_for_function(f"document.querySelectorAll('#servers tbody tr').length === {n}")
                times.append((time.perf_counter() - t0) * 1000)
                page.close()
        finally:
            browser.close()
    holder["loop"].add_callback(holder["loop"].stop)
    return {
        "page_load_ms_median": statistics.median(times),
        "page_load_ms_max": max(times),
        "api_servers_json_kib": statistics.median(sizes) / 1024,
        "api_servers_view_ms_median": statistics.median(api_ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--loads", type=int, default=5)
    args = ap.parse_args()
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(
        target=_fake_cluster, args=(port, args.servers), daemon=True
    )
    proc.start()
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        r = asyncio.run(bench_rounds(port, args.servers, args.rounds))
        state = r.pop("state")
        r.update(bench_page(state, args.servers, args.loads))
    finally:
        proc.terminate()
        proc.join(5)
    r["machine"] = machine()
    out = REPO / "benchmarks" / "results" / "gpu_admin.json"
    out.write_text(json.dumps(r, indent=2) + "\n")
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
