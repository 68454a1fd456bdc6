"""Shared fixtures. Test doubles live in tests/doubles/ and are named for what they stand in for."""

from __future__ import annotations

import os

import pytest

from tests.kernels import Kernel, job_processes, kernel_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


CLUSTER_FIXTURES = {"k8s_plane", "real_cluster"}
_GROUP = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Group tests for pytest-xdist (scripts/test runs ``-n 2 --dist loadgroup``).

    A module stays on one worker so its module-scoped fixtures (a trained job, a hub) are built once, and
    every test that touches a cluster shares one worker: one control plane per run, and the kwok plane's
    host-process pods never overlap the real node's pod network (both use 10.244.0.0/16).
    """
    for item in items:
        uses_cluster = CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ()))
        if uses_cluster or item.get_closest_marker("k8s") or item.get_closest_marker("realnode"):
            group = "cluster"
        else:
            group = item.module.__name__ if item.module else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[_GROUP] = group

    # the cluster group is the longest: it starts first so the other worker's modules fill in around it;
    # within it the tests that leave the cluster down come last (a later test would wait for a fresh `up`)
    def order(it: pytest.Item) -> tuple[bool, bool]:
        return it.stash[_GROUP] != "cluster", it.get_closest_marker("takes_cluster_down") is not None

    items.sort(key=order)


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
from tests.realnode_fixtures import job_image, real_cluster, real_ns, tenants  # noqa: E402, F401
