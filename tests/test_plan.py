"""`%tfdist plan` / `%%tfdist plan` in a real kernel: the model is measured in a subprocess, a table, a
chart and one recommended run line are shown, and nothing is started; bad input gets a message."""

from __future__ import annotations

import contextlib
import os
import socket
import time

import psutil
import pytest

from tests.kernels import job_processes, jobs_in

pytestmark = pytest.mark.slow

FIT = "history = model.fit(train_ds, epochs=3, steps_per_epoch=40)"
PIPELINE = (
    "def pipeline(batch):\n"
    "    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).repeat().batch(batch)\n"
)


def recommended(text: str) -> str:
    return text.split("recommended: ")[1].split("\n")[0]


LABELS = ("1 worker, 1 PS", "2 workers, 1 PS", "2 workers, 2 PS", "all-reduce, 2 workers")
RUN_LINES = {
    "1 worker, 1 PS": "%%tfdist run --workers 1 --ps 1",
    "2 workers, 1 PS": "%%tfdist run --workers 2 --ps 1",
    "2 workers, 2 PS": "%%tfdist run --workers 2 --ps 2",
    "all-reduce, 2 workers": "%%tfdist run --strategy allreduce --workers 2",
}


def examples(text: str, label: str) -> float:
    """The predicted examples/s in the row of `label` (after its batch column: `64` or `32 x 2`)."""
    cols = row(text, label)
    return float(cols[3] if cols[1] == "x" else cols[1])


def row(text: str, label: str) -> list[str]:
    """The plan table's row of `label`, split into its columns."""
    line = next(ln for ln in text.splitlines() if ln.startswith(label))
    return line[len(label) :].split()


def test_plan_cell_measures_and_recommends(tf_kernel):
    before = jobs_in(tf_kernel.state_dir)
    r = tf_kernel.execute("%%tfdist plan --workers 2\n" + FIT, timeout=240)
    assert r.error is None, r.error_text
    text = r.text
    assert "model: 4,810 parameters" in text  # 64x64 + 64 + 64x10 + 10
    assert "batch 64" in text
    for label in ("1 worker, 1 PS", "2 workers, 1 PS", "2 workers, 2 PS", "all-reduce, 2 workers"):
        assert label in text, text
    assert "recommended: %%tfdist run " in text and "why: " in text
    assert {"text/html", "image/png"} <= r.mimetypes()
    # what was measured here and what assumed, and each layout's batch as it will run
    assert "measured here: model step, PS step round trip" in text, text
    assert "all-reduce step (fit loop, collective)" in text and "per further variable" in text, text
    assert "assumed: " in text
    # on this CPU-only server every layout was tried: its row is its own pace here
    tried = next(ln for ln in text.splitlines() if ln.startswith("tried here: "))
    assert "each layout's fit timed over " in tried and "two rounds" in tried, tried
    for key in ("1x1", "2x1", "2x2", "ar2"):
        assert f"{key} " in tried and "ms/step" in tried, tried
    assert row(text, "2 workers, 1 PS")[:3] == ["64", "x", "2"]
    assert row(text, "all-reduce, 2 workers")[:3] == ["32", "x", "2"]  # the cell's 64, split
    assert "3 epochs" in text  # time to the fit's own epochs
    assert jobs_in(tf_kernel.state_dir) == before
    assert not job_processes()
    # the kernel's model is untouched (measured in a copy, in another process)
    r = tf_kernel.execute("print(model.optimizer.iterations.numpy())", timeout=30)
    assert r.text.strip() == "0"


def test_the_plans_tensorflow_servers_are_out_of_reach_of_this_machines_other_users(tf_kernel):
    """The probe's TensorFlow servers (its fixed costs: a PS round trip, a collective) listen on every
    interface and run any graph sent to them, as a job's do: another user of this machine, or of its
    network, must not reach them while a plan runs. Like a job, the probe gets a network namespace of its
    own. Each port is tried from this (the host's) namespace while the server listens on it."""
    th, box = tf_kernel.execute_in_background("%%tfdist plan --workers 2 --estimate\n" + FIT, timeout=240)
    host_ns = os.readlink("/proc/self/ns/net")
    listened: dict[int, str] = {}  # port -> the namespace it listened in
    reached: list[int] = []
    while th.is_alive():
        for proc in probe_tree(tf_kernel.pid):
            try:
                ns = os.readlink(f"/proc/{proc.pid}/ns/net")
                ports = listening(proc.pid)
            except OSError:
                continue
            for port in ports - set(listened):
                listened[port] = ns
                with socket.socket() as s:
                    s.settimeout(1)
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        reached.append(port)
        time.sleep(0.05)
    th.join()
    assert box and box[0].error is None, box and box[0].error_text
    assert "recommended: %%tfdist run " in box[0].text
    assert len(listened) >= 2, f"the probe's servers were never seen listening: {listened}"
    assert not reached, f"the plan's TF ports {reached} were reachable from the host's network"
    assert host_ns not in listened.values(), listened


def listening(pid: int) -> set[int]:
    """TCP ports `pid` itself listens on, in whichever network namespace it is (/proc/PID/net is that
    namespace's table; psutil reads this one's)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN, and this process's socket
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def probe_tree(kernel_pid: int) -> list[psutil.Process]:
    """The plan's probe process and everything under it."""
    out = []
    for p in psutil.Process(kernel_pid).children(recursive=True):
        try:
            if "tfdist.runtime.probe" in " ".join(p.cmdline()):
                out += [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
    return out


def test_plan_takes_the_cell_as_run_takes_it(tf_kernel):
    """The fit's data is an expression (a call), evaluated where the run would: in the probe, with the
    cell's names shipped as the job ships them; its batch and epochs are the evaluated ones. (--estimate:
    what is asserted is the evaluated fit, not the layouts' trials, which the test above runs.)"""
    r = tf_kernel.execute(PIPELINE, timeout=30)
    assert r.error is None, r.error_text
    r = tf_kernel.execute(
        "%%tfdist plan --workers 2 --estimate\nhist = model.fit(pipeline(batch=32), epochs=1)", timeout=300
    )
    assert r.error is None, r.error_text
    assert "model: 4,810 parameters" in r.text and "batch 32" in r.text, r.text
    assert "1 epoch" in r.text and "tried here" not in r.text, r.text
    assert recommended(r.text).startswith("%%tfdist run"), r.text
    assert "hist" not in tf_kernel.execute("print(sorted(globals()))", timeout=30).text  # nothing ran here
    assert not job_processes()


def test_plan_line_magic_on_a_wide_model_names_its_size(tf_kernel):
    r = tf_kernel.execute(
        "wide = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(4096, "
        "activation='relu'), tf.keras.layers.Dense(4096, activation='relu'), tf.keras.layers.Dense(10)])\n"
        "wide.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.1), "
        "loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n",
        timeout=60,
    )
    assert r.error is None, r.error_text
    # what is asserted is the model's size and its placement, in the model's own reading (--estimate): the
    # probe's shortest timing (5 steps at each batch, not up to 4 s) serves, and no layout is tried
    r = tf_kernel.execute(
        "os.environ['TFDIST_PROBE_SECONDS'] = '0.5'\n"
        "try:\n    %tfdist plan wide train_ds --steps-per-epoch 10 --estimate\n"
        "finally:\n    del os.environ['TFDIST_PROBE_SECONDS']",
        timeout=240,
    )
    assert r.error is None, r.error_text
    assert "tried here" not in r.text, r.text  # --estimate: the model's sum of the measured costs
    # 64x4096 + 4096 + 4096x4096 + 4096 + 4096x10 + 10 parameters, float32
    assert "wide: 17,088,522 parameters (68.4 MB in 6 variables, the largest 67.1 MB)" in r.text, r.text
    # round-robin placement in creation order: every kernel on ps-0, every bias on ps-1
    assert "over 2 PS: 68.3 MB, 32.8 kB" in r.text, r.text
    # the 67.1 MB kernel dwarfs the rest: a second PS gains nothing, and the line is the table's fastest
    one, two = examples(r.text, "2 workers, 1 PS"), examples(r.text, "2 workers, 2 PS")
    assert two == pytest.approx(one, rel=0.05), r.text
    best = max(LABELS, key=lambda label: examples(r.text, label))
    near = [label for label in LABELS if examples(r.text, label) >= 0.95 * examples(r.text, best)]
    assert recommended(r.text) in {RUN_LINES[label] for label in near}, r.text
    assert not job_processes()


def test_plan_spreads_a_compute_bound_model_over_gpus(tf_kernel):
    """A conv net whose step is all compute, planned for 4 GPUs of their own: one worker is not it. Its
    step (tens of ms on 2 cores) stays well above the coordinator's pace per step that the probe measures
    (Keras's fit loop: 4-9 ms here, more under load), so four workers are not held to the coordinator."""
    r = tf_kernel.execute(
        "L = tf.keras.layers\n"
        "convnet = tf.keras.Sequential([L.Input((32, 32, 3)), L.Conv2D(64, 3, activation='relu'),"
        " L.Conv2D(64, 3, activation='relu'), L.GlobalAveragePooling2D(), L.Dense(10)])\n"
        "convnet.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.1), "
        "loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
        "images = tf.data.Dataset.from_tensor_slices((np.random.rand(512, 32, 32, 3).astype('float32'), "
        "y[:512])).repeat().batch(64)\n",
        timeout=60,
    )
    assert r.error is None, r.error_text
    r = tf_kernel.execute("%%tfdist plan --gpus-per-node 4\nconvnet.fit(images, epochs=2)", timeout=300)
    assert r.error is None, r.error_text
    assert "planned for 4 workers" in r.text, r.text
    assert "tried here" not in r.text, r.text  # GPUs of their own: not what this CPU could try
    assert not recommended(r.text).startswith("%%tfdist run --workers 1 "), r.text
    why = r.text.split("why: ")[1]
    assert float(why.split("x one worker")[0].split()[-1]) >= 2.5, r.text
    assert "compute" in why, r.text
    assert not job_processes()


BAD = [
    ("%%tfdist plan\nx = 1\nprint(x)\n", "found no model.fit(...) call in the cell"),
    ("%%tfdist plan\n   \n", "the %%tfdist plan cell is empty"),
    ("%%tfdist plan\nmodel.fit(x=[1, 2], epochs=1)\n", "the model could not be measured"),
    ("%%tfdist plan\nmodel.fit(epochs=1)\n", "the cell's fit is given no data"),
    ("%%tfdist plan\nif False:\n    model.fit(train_ds)\n", "the cell ran to its end without calling fit"),
    ("%%tfdist plan\n%time model.fit(train_ds)\n", "IPython magics and shell escapes"),
    ("%%tfdist plan\nmodel.fit(nope_ds, epochs=1)\n", "name 'nope_ds' is used in the cell but not defined"),
    ("%tfdist plan", "%tfdist plan MODEL DATASET"),
    ("%tfdist plan x train_ds", "'x' is not a tf.keras (tf_keras) model (ndarray)"),
    ("%tfdist plan model x", "'x' is not a tf.data dataset (ndarray)"),
    ("%tfdist plan model train_ds --bandwidth fast", "bandwidth 'fast': use e.g. 10Gbps"),
    ("%tfdist plan model train_ds --nodes 0", "--nodes must be at least 1"),
    ("%tfdist plan model train_ds --workers 0", "--workers must be at least 1"),
    ("%tfdist plan model train_ds --backend slurm", "--backend 'slurm' is unknown"),
    ("%%tfdist plan model train_ds\n" + FIT, "%%tfdist plan takes no names"),
    ("%tfdist plan raw train_ds", "'raw' is not compiled, so it has no optimizer or loss to train with"),
    (
        "%%tfdist plan\nraw.fit(train_ds, epochs=1)\n",
        "run raw.compile(optimizer=..., loss=...) in the notebook",
    ),
]


@pytest.mark.parametrize(("cell", "message"), BAD, ids=[c[1][:40] for c in BAD])
def test_bad_plan_input_starts_nothing(tf_kernel, cell, message):
    r = tf_kernel.execute(
        "raw = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(10)])", timeout=30
    )
    assert r.error is None, r.error_text
    before = jobs_in(tf_kernel.state_dir)
    r = tf_kernel.execute(cell, timeout=240)
    shown = r.error_text + r.text
    assert message in shown, shown
    assert "Traceback (most recent call last)" not in shown
    assert jobs_in(tf_kernel.state_dir) == before
    assert not job_processes()
