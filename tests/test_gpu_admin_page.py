"""The admin page's rows from the service's records alone (tfdist.hubadmin.page.page_view): busy and free
GPUs per model, a server whose reports stopped says so and is not counted busy, and a refused report stays
visible after the next good one."""

from __future__ import annotations

import json

from tfdist.hubadmin.page import page_view
from tfdist.hubadmin.report import GpuRecord
from tfdist.hubadmin.servers import ServerRecord

NOW = 1_800_000_000.0
A100 = "NVIDIA A100-SXM4-40GB"


def server(user: str, utils: list[float | None], seen_ago: float) -> ServerRecord:
    rec = ServerRecord(user=user, name="", profile="gpu", gpu_model="a100", url=f"/user/{user}/")
    rec.gpus = [GpuRecord(index=i, name=A100, uuid=f"GPU-{user}-{i}") for i in range(len(utils))]
    rec.add(NOW - seen_ago, utils, [1000.0] * len(utils))
    rec.seen = NOW - seen_ago
    return rec


def view(*records: ServerRecord, machine: list[str] | None = None) -> dict:
    return page_view(records, lambda rec: 10.0, {"a100": "A100 40GB"}, machine, NOW - 5, NOW)


def test_busy_held_and_free_per_model_from_fresh_reports_only():
    busy, idle, gone = server("ann", [80.0, 3.0], 5), server("bob", [0.0], 10), server("cy", [90.0], 900)
    page = view(busy, idle, gone, machine=[A100] * 6)
    assert page["totals"] == [{"model": A100, "held": 4, "busy": 1, "free": 2}]  # cy's stale 90 % is not busy
    rows = {r["user"]: r for r in page["servers"]}
    assert rows["ann"]["util_text"] == ["80%", "3%"] and rows["ann"]["gpu_model"] == "A100 40GB"
    assert rows["cy"]["action"] == "no-data" and rows["cy"]["error"].startswith(
        "no data (no report for 900 s"
    )
    assert rows["cy"]["util"] == [None] and rows["ann"]["error"] is None


def test_unknown_machine_gpus_give_no_free_count():
    assert view(server("ann", [50.0], 1))["totals"][0]["free"] is None


def test_a_refusal_stays_on_the_row_after_a_good_report():
    rec = server("mallory", [20.0], 1)
    rec.refused, rec.refusals, rec.last_refusal = None, 3, (NOW - 30, "'idle_s' must be at least 0")
    [row] = view(rec)["servers"]
    assert row["error"] is None  # her last report was good
    assert row["refusals"] == {"count": 3, "at": NOW - 30, "why": "'idle_s' must be at least 0"}


async def test_a_server_started_again_at_the_same_url_is_a_new_record(monkeypatch):
    """Stopped on a GPU profile and started on another before the service's next read: same URL, new
    start time. Its record (profile, GPU count, warning, history) is the new server's, not the old one's."""
    from tfdist.hubadmin.service import GpuAdminState

    state = GpuAdminState(api_url="http://hub.invalid/hub/api", api_token="t", culling=None)
    reads = [
        {"profile": "gpu", "gpus": 1, "gpu_model": "a100", "started": "2026-12-04T10:00:00Z"},
        {"profile": "gpu-large", "gpus": 2, "gpu_model": "a100", "started": "2026-12-04T10:00:40Z"},
    ]

    async def active_users():
        r = reads[0]
        opts = {k: r[k] for k in ("profile", "gpus", "gpu_model")}
        server = {"ready": True, "url": "/user/ann/", "started": r["started"], "user_options": opts}
        return [{"name": "ann", "servers": {"": server}}]

    monkeypatch.setattr(state, "active_users", active_users)
    await state.refresh()
    first = state.servers["ann/"]
    assert (first.profile, first.gpus_given) == ("gpu", 1)
    first.warned_cull_at = NOW + 60
    first.add(NOW, [2.0], [10.0])
    await state.refresh()
    assert state.servers["ann/"] is first  # the same server read again keeps its record
    reads.pop(0)
    await state.refresh()
    now = state.servers["ann/"]
    assert (now.profile, now.gpus_given, now.warned_cull_at, len(now.history)) == ("gpu-large", 2, None, 0)


def test_a_report_of_more_gpus_than_the_server_was_given_is_refused_saying_so():
    from tfdist.hubadmin.report import parse_report

    rec = ServerRecord(user="eve", name="", profile="cpu", gpu_model=None, url="/user/eve/", gpus_given=0)
    one = json.dumps({"gpus": [{"index": 0, "name": A100, "uuid": "GPU-x"}]}).encode()
    assert rec.overclaim(parse_report(b"{}", NOW)) is None
    assert rec.overclaim(parse_report(one, NOW)) == "reports 1 GPUs, but the server was given 0"
    rec.gpus_given = None  # not known (an admin's own apply_user_options): not checked
    assert rec.overclaim(parse_report(one, NOW)) is None


async def test_a_server_missing_from_one_read_of_the_hub_keeps_its_record(monkeypatch):
    """Pages shift when a server starts or stops between two of them, and one user is missed: their record
    (history, warning) survives one read without them and goes after the second."""
    from tfdist.hubadmin.service import GpuAdminState

    state = GpuAdminState(api_url="http://hub.invalid/hub/api", api_token="t", culling=None)
    server = {"ready": True, "url": "/user/ann/", "started": "2026-12-04T10:00:00Z", "user_options": {}}
    reads = [[{"name": "ann", "servers": {"": server}}], [], []]

    async def active_users():
        return reads.pop(0)

    monkeypatch.setattr(state, "active_users", active_users)
    await state.refresh()
    rec = state.servers["ann/"]
    rec.warned_cull_at = NOW + 60
    await state.refresh()
    assert state.servers.get("ann/") is rec and rec.warned_cull_at == NOW + 60
    await state.refresh()
    assert "ann/" not in state.servers
