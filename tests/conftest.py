"""Shared fixtures. Test doubles live in tests/doubles/ and are named for what they stand in for."""

from __future__ import annotations

import os

import pytest

from tests.kernels import Kernel, job_processes, kernel_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


_GROUP = pytest.StashKey[str]()
# the longest groups start first (scripts/test keeps this order: --no-loadscope-reorder), then modules with
# TensorFlow jobs or a browser, so the short ones fill in at the end
_FIRST = {"realnode": 0, "kwok": 1}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Group and order tests for pytest-xdist (scripts/test runs ``-n 2 --dist loadgroup``).

    A module stays on one worker so its module-scoped fixtures (a trained job, a hub) are built once.
    Every test on the one-machine cluster with a real node shares one worker: some take that cluster down
    and up again. Every test on the kwok plane shares another: one plane per run.
    """
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if "real_cluster" in names or item.get_closest_marker("realnode"):
            group = "realnode"
        elif "k8s_plane" in names or item.get_closest_marker("k8s"):
            group = "kwok"
        else:
            group = item.module.__name__ if item.module else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[_GROUP] = group
    slow = {it.stash[_GROUP] for it in items if any(it.get_closest_marker(m) for m in ("slow", "browser"))}
    items.sort(key=lambda it: _FIRST.get(it.stash[_GROUP], 2 if it.stash[_GROUP] in slow else 3))


@pytest.fixture(scope="session")
def examples_dir() -> str:
    return os.path.join(ROOT, "examples")


@pytest.fixture(scope="module")
def tf_kernel(tmp_path_factory):
    """A real kernel with TF imported, the extension loaded and a small digits model + dataset defined."""
    state = str(tmp_path_factory.mktemp("tfdist-state"))
    k = Kernel(kernel_env(state), cwd=str(tmp_path_factory.mktemp("nb")))
    k.state_dir = state  # type: ignore[attr-defined]
    r = k.execute(SETUP_CODE, timeout=180)
    assert r.error is None, r.error_text
    yield k
    k.shutdown()


@pytest.fixture(autouse=True)
def no_job_left_behind():
    """Every test must leave no job process running (the product's promise, checked everywhere)."""
    before = {p.pid for p in job_processes()}
    yield
    import time

    deadline = time.time() + 15
    left = []
    while time.time() < deadline:
        left = [p for p in job_processes() if p.pid not in before]
        if not left:
            break
        time.sleep(0.2)
    assert not left, f"job processes left behind: {[(p.pid, p.cmdline()) for p in left]}"


SETUP_CODE = """
import os
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np, tensorflow as tf
from sklearn.datasets import load_digits
%load_ext tfdist
_d = load_digits()
x = (_d.data / 16.0).astype("float32"); y = _d.target.astype("int64")
train_ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).repeat().batch(64)
def make_model():
    m = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(64, activation="relu"),
                             tf.keras.layers.Dense(10)])
    m.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.1),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return m
model = make_model()
"""


from tests.k8s_fixtures import k8s_api, k8s_namespace, k8s_plane  # noqa: E402, F401
from tests.realnode_fixtures import real_cluster, real_ns  # noqa: E402, F401
