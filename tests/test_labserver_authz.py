"""The server extension asks jupyter_server's Authorizer, as jupyter_server's own routes do.

An admin who gives some identities less than everything (a read-only guest of a shared server, through
a custom Authorizer or JupyterHub's granular scopes) expects that to hold on every route of the server.
Before the extension asked, such a guest could stop the owner's jobs and post or withdraw the hub's
notice: `tornado.web.authenticated` only asks whether anyone is logged in.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from jupyter_server.auth.authorizer import Authorizer
from tornado.httpclient import HTTPClientError

from tests.test_labserver import ME, fake_job, get_json, state_dir  # noqa: F401 (state_dir: a fixture)

pytest_plugins = ["pytest_jupyter.jupyter_server"]


class ReadOnlyGuest(Authorizer):
    """What an admin might grant a guest: read anything, change nothing."""

    def is_authorized(self, handler, user, action, resource) -> bool:
        return action == "read"


@pytest.fixture
def jp_server_config(state_dir):  # noqa: F811
    return {"ServerApp": {"jpserver_extensions": {"tfdist": True}, "authorizer_class": ReadOnlyGuest}}


async def _a_read_only_guest_reads_and_changes_nothing(jp_fetch, state_dir) -> None:  # noqa: F811
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        fake_job(state_dir, "mine", ME, pid=sleeper.pid)
        # reading is the guest's: the panel's list, a job, the GPU status item, the activity report
        assert [j["name"] for j in (await get_json(jp_fetch, "jobs"))["jobs"]] == ["mine"]
        assert (await get_json(jp_fetch, "jobs", "mine"))["state"] == "running"
        await get_json(jp_fetch, "gpus")
        await get_json(jp_fetch, "activity")
        # changing is not: stopping the owner's job, posting or withdrawing the hub's notice
        for path, method in [("jobs/mine/stop", "POST"), ("notice", "POST"), ("notice", "DELETE")]:
            body = {"body": b'{"message": "hello"}'} if method == "POST" else {}
            with pytest.raises(HTTPClientError) as e:
                await jp_fetch("tfdist", "api", *path.split("/"), method=method, **body)
            assert e.value.code == 403, (path, method, e.value.code)
        assert sleeper.poll() is None, "the refused stop ended the job's process"
        assert (await get_json(jp_fetch, "jobs", "mine"))["state"] == "running"
        assert (await get_json(jp_fetch, "notice"))["notice"] is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_read_only_guest_reads_and_changes_nothing(jp_fetch, state_dir, jp_asyncio_loop) -> None:  # noqa: F811
    jp_asyncio_loop.run_until_complete(_a_read_only_guest_reads_and_changes_nothing(jp_fetch, state_dir))
