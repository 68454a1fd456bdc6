"""Shared fixtures, the xdist grouping and the unit run. Test doubles live in tests/doubles/ and are named for
what they stand in for."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest

from tests import groupend, runrecord
from tests.groupend import GROUP
from tests.kernels import Kernel, job_processes, product_kernel_env
from tests.unitguard import (  # the unit run's hooks: registered by being names of this conftest
    UNIT_MODULES,
    is_unit,
    pytest_runtest_call,  # noqa: F401
    pytest_runtest_makereport,  # noqa: F401
    pytest_runtest_setup,  # noqa: F401
    pytest_runtest_teardown,  # noqa: F401
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


KWOK_FIXTURES = {"k8s_plane"}
REALNODE_FIXTURES = {"real_cluster"}
# Each test's last duration (setup + call + teardown), kept outside the checkout like the other caches, so
# that the next run hands the longest groups out first (longest-first keeps both workers busy to the end).
DURATIONS = Path(os.environ.get("TFDIST_CACHE") or Path.home() / ".cache" / "tfdist") / "test-durations.json"
_UNKNOWN_S = 3.0  # a test never timed here yet


def _group(item: pytest.Item) -> str:
    names = set(getattr(item, "fixturenames", ()))
    if REALNODE_FIXTURES & names or item.get_closest_marker("realnode"):
        return "realnode"  # one machine-wide real cluster: all its tests on one worker
    if KWOK_FIXTURES & names or item.get_closest_marker("k8s"):
        # one kwok plane per run; its ports come from a block of their own (tests/kube_plane.py), so it
        # runs beside the real cluster, up or down
        return "kwok"
    return item.module.__name__ if item.module else item.nodeid.split("::")[0]


def _durations() -> dict[str, float]:
    try:
        d = json.loads(DURATIONS.read_text())
        return {k: float(v) for k, v in d.items()} if isinstance(d, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def pytest_configure(config: pytest.Config) -> None:
    # the planes of the kwok group stop when that group ends on its worker
    config.pluginmanager.register(groupend, "tfdist-groupend")
    config.addinivalue_line(
        "markers",
        "unit: a process-free test (tests/unitguard.py: its module is in UNIT_MODULES); `-m unit` runs them, "
        "and there starting a process, forking or listening on a network port fails the test",
    )
    config.addinivalue_line(
        "markers",
        "not_unit(why): a test of a unit module that needs a process or a port: not in the unit run",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Group tests for pytest-xdist (scripts/test runs ``--dist loadgroup``) and hand out the longest first.

    A module stays on one worker so its module-scoped fixtures (a trained job, a hub) are built once; the
    kwok-plane tests share one worker (one plane per run) and the real-node tests another (the real cluster
    is machine-wide). Groups go out longest first by the last run's durations (on a machine that has none,
    the two cluster groups first); within the real-node group the tests that leave the cluster down come
    last (a later test would wait for a fresh `up`).
    """
    known = _durations()
    weight: dict[str, float] = {}
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in UNIT_MODULES:
            if not item.get_closest_marker("not_unit"):
                item.add_marker(pytest.mark.unit)
        group = _group(item)
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[GROUP] = group
        weight[group] = weight.get(group, 0.0) + known.get(item.nodeid, _UNKNOWN_S)
    if not known:
        for g in ("realnode", "kwok"):
            weight[g] = weight.get(g, 0.0) + 1e6

    def order(it: pytest.Item) -> tuple[float, str, bool]:
        g = it.stash[GROUP]
        return -weight[g], g, it.get_closest_marker("takes_cluster_down") is not None

    items.sort(key=order)


_timed: dict[str, float] = {}
_failed: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    runrecord.pytest_runtest_logreport(report)
    nodeid = re.sub(r"@[\w.]+$", "", report.nodeid)  # xdist's loadgroup adds "@<group>"
    _timed[nodeid] = _timed.get(nodeid, 0.0) + report.duration
    if report.failed:
        _failed.add(nodeid)


def pytest_sessionstart(session: pytest.Session) -> None:
    runrecord.pytest_sessionstart(session)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    runrecord.write(session, exitstatus)
    if hasattr(session.config, "workerinput") or not _timed:  # the controller (or a serial run) writes it
        return
    # a test that failed or errored keeps its last good time: a cluster that did not come up ends its
    # group in seconds, and that group would then be handed out last the next time
    merged = _durations() | {k: round(v, 2) for k, v in _timed.items() if k not in _failed}
    with contextlib.suppress(OSError):
        DURATIONS.parent.mkdir(parents=True, exist_ok=True)
        tmp = DURATIONS.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, sort_keys=True))
        tmp.replace(DURATIONS)


@pytest.fixture(scope="session")
def examples_dir() -> str:
    return os.path.join(ROOT, "examples")


@pytest.fixture(scope="module")
def tf_kernel(tmp_path_factory):
    """A real kernel with TF imported, the extension loaded and a small digits model + dataset defined; with
    the product's defaults (a warm pool, TensorFlow's log level 2): the magic tests run the user's path."""
    state = str(tmp_path_factory.mktemp("tfdist-state"))
    k = Kernel(product_kernel_env(state), cwd=str(tmp_path_factory.mktemp("nb")))
    k.state_dir = state  # type: ignore[attr-defined]
    r = k.execute(SETUP_CODE, timeout=180)
    assert r.error is None, r.error_text
    yield k
    k.shutdown()


@pytest.fixture(autouse=True)
def no_job_left_behind(request: pytest.FixtureRequest):
    """Every test must leave no job process running (the product's promise, checked everywhere; a unit test
    cannot start one, so it is spared the walk over every process)."""
    if is_unit(request.node):
        yield
        return
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
