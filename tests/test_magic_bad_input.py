"""Every bad input to %%tfdist gets a clear message in a real kernel, and starts nothing."""

from __future__ import annotations

import socket

import pytest

from tests.kernels import job_processes, jobs_in

pytestmark = pytest.mark.slow

FIT = "history = model.fit(train_ds, epochs=1, steps_per_epoch=2)"


CASES = [
    ("%%tfdist run --workers 0\n" + FIT, "--workers must be at least 1"),
    ("%%tfdist run --workers -2\n" + FIT, "--workers must be at least 1"),
    ("%%tfdist run --workers 1.5\n" + FIT, "argument --workers: invalid int value: '1.5'"),
    ("%%tfdist run --workers two\n" + FIT, "invalid int value: 'two'"),
    ("%%tfdist run --ps 0\n" + FIT, "--ps must be at least 1"),
    ("%%tfdist run --ps -1\n" + FIT, "--ps must be at least 1"),
    ("%%tfdist run --wrokers 2\n" + FIT, "unrecognized arguments: --wrokers"),
    ("%%tfdist run --gpus-per-worker 1\n" + FIT, "needs 2 GPUs, but this server has 0"),
    ("%%tfdist run --gpus-per-worker -1\n" + FIT, "--gpus-per-worker cannot be negative"),
    ("%%tfdist run --memory '4 G'\n" + FIT, "--memory '4 G' is not a size"),
    ("%%tfdist run --memory 4GB\n" + FIT, "--memory '4GB' is not a size"),
    ("%%tfdist run --cpu 0\n" + FIT, "--cpu must be a number of cores above 0"),
    ("%%tfdist run --name Bad_Name\n" + FIT, "--name 'Bad_Name' is not valid"),
    ("%%tfdist run --backend slurm\n" + FIT, "--backend 'slurm' is unknown"),
    ("%%tfdist run --timeout -5\n" + FIT, "--timeout must be a positive number of seconds; got '-5'"),
    # a start-up timeout that can never fire
    ("%%tfdist run --timeout nan\n" + FIT, "--timeout must be a positive number of seconds; got 'nan'"),
    ("%%tfdist run --timeout inf\n" + FIT, "--timeout must be a positive number of seconds; got 'inf'"),
    ("%%tfdist run --cpu nan\n" + FIT, "--cpu must be a number of cores above 0"),
    (
        "%%tfdist run --stall-timeout 0\n" + FIT,
        "--stall-timeout must be a positive number of seconds; got '0'",
    ),
    ("%%tfdist run --stall-timeout -3\n" + FIT, "--stall-timeout must be a positive number of seconds"),
    ("%%tfdist run --stall-timeout nan\n" + FIT, "--stall-timeout must be a positive number of seconds"),
    ("%%tfdist run --stall-timeout inf\n" + FIT, "--stall-timeout must be a positive number of seconds"),
    ("%%tfdist run --stall-timeout 10m\n" + FIT, "--stall-timeout takes seconds, e.g. 600; got '10m'"),
    ("%%tfdist run --workers x\n" + FIT, "%%tfdist run: argument --workers: invalid int value: 'x'"),
    ("%%tfdist run --workers x\n" + FIT, "usage: %%tfdist run [-h]"),
    ("%tfdist status", "%tfdist status: the following arguments are required: name"),
    ("%%tfdist run\n", "cell body is empty"),
    ("%%tfdist run\n   \n\n", "the %%tfdist run cell is empty"),
    ("%%tfdist run\nx = 1\nhistory = model.fit(train_ds,\n", "SyntaxError in the cell, line 3"),
    (
        "%%tfdist run\nhistory = model.fit(undefined_ds, epochs=1)",
        "name 'undefined_ds' is used in the cell but not defined",
    ),
    ("%%tfdist run\n!ls\n" + FIT, "magics and shell escapes"),
    (
        "%%tfdist run\nhistory = model.fit(epochs=2)",
        "the cell's fit is given no data: pass the training data",
    ),
    ("%%tfdist run\nhistory = raw.fit(train_ds, epochs=1)", "'raw' is not compiled"),
    ("%%tfdist launch\n" + FIT, "unknown %tfdist command 'launch'"),
    ("%tfdist run --workers 2", "run is a cell magic"),
    ("%tfdist", "%%tfdist run [--workers N]"),
    ("%tfdist stop", "takes a job NAME or --all"),
    ("%tfdist status no-such-job", "no tfdist job named 'no-such-job'"),
    ("%tfdist logs no-such-job", "no tfdist job named 'no-such-job'"),
]


@pytest.mark.parametrize(("cell", "message"), CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input_is_refused_and_starts_nothing(tf_kernel, cell, message):
    if "raw." in cell:  # a model never compiled
        r = tf_kernel.execute(
            "raw = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(10)])"
        )
        assert r.error is None, r.error_text
    before = jobs_in(tf_kernel.state_dir)
    r = tf_kernel.execute(cell, timeout=60)
    shown = r.error_text + r.text
    assert message in shown, shown
    assert "Traceback (most recent call last)" not in shown  # a message, not a kernel-side traceback
    assert jobs_in(tf_kernel.state_dir) == before
    assert not job_processes()


def test_unpicklable_variable_is_named(tf_kernel):
    r = tf_kernel.execute("import threading\nlock = threading.Lock()\n", timeout=30)
    assert r.error is None
    r = tf_kernel.execute("%%tfdist run\nwith lock:\n    " + FIT, timeout=60)
    assert "cannot send 'lock' to the job" in r.error_text
    assert "create it inside the %%tfdist cell" in r.error_text
    assert not job_processes()


def test_keras3_model_is_refused_with_the_fix(tf_kernel):
    r = tf_kernel.execute(
        "import keras as _k3\nk3model = _k3.Sequential([_k3.layers.Input((4,)), _k3.layers.Dense(1)])\n",
        timeout=60,
    )
    assert r.error is None, r.error_text
    r = tf_kernel.execute("%%tfdist run\nk3model.fit(train_ds, epochs=1, steps_per_epoch=1)", timeout=60)
    assert "Keras 3 does not support parameter-server training" in r.error_text
    assert "TF_USE_LEGACY_KERAS" in r.error_text


def test_tensorflow_missing_from_the_kernel(tf_kernel):
    r = tf_kernel.execute(
        "import sys\n_saved = sys.modules.pop('tensorflow'), sys.modules.pop('tf_keras')\n"
        "sys.modules['tensorflow'] = None\nsys.modules['tf_keras'] = None\n",
        timeout=30,
    )
    assert r.error is None, r.error_text
    try:
        r = tf_kernel.execute("%%tfdist run\n" + FIT, timeout=60)
        assert "needs TensorFlow and tf_keras in this kernel's environment" in r.error_text
        assert "pip install 'jupyter-tfdist[kernel]'" in r.error_text
    finally:
        tf_kernel.execute("sys.modules['tensorflow'], sys.modules['tf_keras'] = _saved", timeout=30)
    assert not job_processes()


def test_port_already_in_use(tf_kernel, monkeypatch):
    """Without a network namespace (TFDIST_ISOLATION=none) a taken port is reported and nothing runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = tf_kernel.execute(
            "os.environ['TFDIST_ISOLATION'] = 'none'\n"
            "from tfdist.kernel_magics import _magics\n_magics._backends.clear()\n",
            timeout=30,
        )
        assert r.error is None, r.error_text
        before = jobs_in(tf_kernel.state_dir)
        try:
            r = tf_kernel.execute(f"%%tfdist run --base-port {port}\n" + FIT, timeout=120)
        finally:
            tf_kernel.execute("del os.environ['TFDIST_ISOLATION']\n_magics._backends.clear()", timeout=30)
        assert f"port {port} is already in use" in r.error_text, r.error_text
        # nothing runs and nothing is left: no job record, no task process
        assert jobs_in(tf_kernel.state_dir) == before
        assert not job_processes()


def test_a_task_larger_than_the_whole_server_is_refused(tf_kernel):
    """--memory 10Ti on a 4 GiB server: a per-task limit no task could reach, refused with the numbers."""
    tf_kernel.execute(f"import os; os.environ['MEM_LIMIT'] = '{4 * 2**30}'", timeout=30)
    try:
        before = jobs_in(tf_kernel.state_dir)
        r = tf_kernel.execute("%%tfdist run --memory 10Ti\n" + FIT, timeout=60)
        shown = r.error_text + r.text
        said = "--memory 10240.0 GiB per task is more than this server's whole memory limit (4.0 GiB)"
        assert said in shown, shown
        assert "Traceback (most recent call last)" not in shown
        assert jobs_in(tf_kernel.state_dir) == before
        assert not job_processes()
    finally:
        tf_kernel.execute("os.environ.pop('MEM_LIMIT', None)", timeout=30)
