"""The server's memory limit covers the kernel and its jobs: a job that cannot fit is refused before it
starts, and one that grows past the limit is stopped by its supervisor, so the kernel (the user's work)
survives. Real kernel, real TensorFlow tasks; the limit is the one the spawner announces (MEM_LIMIT)."""

from __future__ import annotations

import psutil
import pytest

from tests.kernels import job_processes
from tfdist import memfit

pytestmark = pytest.mark.slow

MiB = 2**20


def _server_use() -> int:
    """What the supervisor's guard adds up: the kernel's parent (here this test process) and its tree."""
    return memfit.tree_rss(psutil.Process().pid)


def test_a_job_bigger_than_the_server_is_refused_with_numbers(tf_kernel) -> None:
    limit = _server_use() + 1024 * MiB  # far less than four TensorFlow processes need
    r = tf_kernel.execute(
        f"import os; os.environ['MEM_LIMIT'] = '{limit}'\n"
        "%tfdist list\n"  # the magic reads the limit at each run: nothing to restart
    )
    assert r.error is None, r.error_text
    try:
        r = tf_kernel.execute("%%tfdist run --name toobig\nhistory = model.fit(train_ds, epochs=1)")
        assert r.error is not None
        text = r.error_text
        assert "needs about" in text and "GiB limit" in text and "Nothing was started" in text, text
        assert "Traceback" not in text.split("\n", 1)[0]
        assert not job_processes()
        assert "toobig" not in tf_kernel.execute("%tfdist list").text
    finally:
        tf_kernel.execute("import os; os.environ.pop('MEM_LIMIT', None)")


def test_a_job_that_outgrows_the_server_is_stopped_and_the_kernel_lives(tf_kernel) -> None:
    fp = memfit.Footprint()
    need = memfit.job_need(2, 1, fp) + memfit.MARGIN_BYTES
    # room for the job as estimated, not for the extra GiB its coordinator allocates below
    limit = _server_use() + need + 300 * MiB
    tf_kernel.execute(f"import os; os.environ['MEM_LIMIT'] = '{limit}'")
    try:
        r = tf_kernel.execute(
            "%%tfdist run --name memhog\n"
            "import numpy as np, time\n"
            "history = model.fit(train_ds, epochs=1, steps_per_epoch=5)\n"
            "hog = []\n"
            # 256 MiB more every 0.2 s on the coordinator, until the supervisor stops the job (bounded at
            # 6 GiB: a guard that never acts fails the test by its timeout, not the machine by OOM). The
            # estimate's slack varies (forked tasks share their TensorFlow pages): growth crosses it anyway.
            "for _ in range(24):\n"
            "    hog.append(np.ones(2**25)); time.sleep(0.2)\n"
            "time.sleep(600)\n",
            timeout=400,
        )
        assert r.error is not None, r.text[-2000:]
        text = r.error_text
        assert "memory is nearly full" in text and "so that the kernel survives" in text, text
        alive = tf_kernel.execute("print('kernel alive', len(model.get_weights()))")
        assert alive.error is None and "kernel alive 4" in alive.text
        status = tf_kernel.execute("%tfdist status memhog").text
        assert "failed" in status and "memory" in status, status
    finally:
        tf_kernel.execute("import os; os.environ.pop('MEM_LIMIT', None)")
