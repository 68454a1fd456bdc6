"""The main job on the servers a user can choose: `tfdist-local-hub` as scripts/run-hub starts it, log in,
spawn from the form, and run examples/digits.ipynb cell by cell in that server's kernel through the hub's
proxy. The server is pinned to its cores and held to its memory limit by the hub, which is what made the
example fail before (one core deadlocked TensorFlow; 2 GiB killed the kernel). The form's defaults, exactly
as a new user leaves them, run the example in Debian's chromium: tests/test_new_user_browser.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.hub_fixtures import LocalHubCommand, start_local_hub_command
from tests.hub_user import HubUser, MemoryPeak, form_defaults, job_processes, server_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHECK = """
import json
result = {"changed": bool(changed), "acc": float(acc_after), "epochs": len(history.history["loss"])}
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHubCommand]:
    h = start_local_hub_command(tmp_path_factory.mktemp("mainjob"))
    try:
        yield h
    finally:
        h.stop()


def _code_cells(nb: dict[str, Any]) -> list[str]:
    return [
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb["cells"]
        if c["cell_type"] == "code"
    ]


def _run_example(user: HubUser, magic_line: str | None = None) -> tuple[dict[str, Any], int, int]:
    """Run the user's copy of the example; returns (result, memory peak, the server's limit)."""
    user.wait_server()
    nb = user.notebook("examples/digits.ipynb")
    cells = _code_cells(nb)
    server = server_process(user.name)
    limit = int(server.environ()["MEM_LIMIT"])
    kernel = user.open_kernel("examples/digits.ipynb")
    peak = MemoryPeak(server)
    try:
        for code in cells:
            if magic_line and code.startswith("%%tfdist run"):
                code = magic_line + "\n" + code.split("\n", 1)[1]
            res = kernel.execute(code, timeout=600)
            assert res.error is None, f"cell failed:\n{code}\n{res.error}\nstdout:\n{res.stdout[-3000:]}"
            if "import tensorflow" in code:  # no red box of TensorFlow start-up noise in the first cell
                assert not res.stderr.strip(), res.stderr
            if code.startswith("%%tfdist run"):
                assert "succeeded" in res.stdout, res.stdout[-3000:]
                # the kernel stays busy for the whole cell, as for any cell
                assert res.statuses[0] == "busy" and res.statuses[-1] == "idle", res.statuses
        out = kernel.execute(CHECK, timeout=120)
        assert out.error is None, out.error
    finally:
        high = peak.stop()
        kernel.close()
    import json

    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), high, limit


def _assert_no_job_left(user: str) -> None:
    deadline = time.monotonic() + 15
    while job_processes(user) and time.monotonic() < deadline:
        time.sleep(0.3)
    left = job_processes(user)
    assert not left, [" ".join(p.cmdline()) for p in left]


def test_a_one_core_server_runs_four_workers_and_two_ps(hub: LocalHubCommand) -> None:
    user = HubUser(hub.url, "fourworkers", hub.password)
    user.login()
    fields = dict(form_defaults(user.form()))
    fields.update(cpu="1", memory="6")
    user.spawn_with(list(fields.items()))
    result, peak, limit = _run_example(user, "%%tfdist run --workers 4 --ps 2")
    assert result["changed"] and result["acc"] > 0.85, result
    assert peak < limit
    assert "memory watchdog" not in hub.output()
    _assert_no_job_left(user.name)


def test_a_job_that_cannot_fit_is_refused_with_the_numbers_and_starts_nothing(hub: LocalHubCommand) -> None:
    user = HubUser(hub.url, "smallserver", hub.password)
    user.login()
    fields = dict(form_defaults(user.form()))
    fields.update(cpu="1", memory="1.5")
    user.spawn_with(list(fields.items()))
    user.wait_server()
    cells = _code_cells(user.notebook("examples/digits.ipynb"))
    kernel = user.open_kernel("examples/digits.ipynb")
    try:
        for code in cells[:2]:
            assert kernel.execute(code).error is None
        res = kernel.execute("%%tfdist run --workers 2 --ps 1\nhistory = model.fit(train_ds, epochs=1)")
        assert res.error is not None
        text = res.error["evalue"]
        assert "needs about" in text and "GiB limit" in text and "Nothing was started" in text, text
        assert not job_processes(user.name)
        # the kernel is alive and its model untouched
        assert kernel.execute("print(len(model.get_weights()))").stdout.strip() == "4"
    finally:
        kernel.close()
