"""Shared data on the one-machine cluster's real node (issue 24, "Shared data"): a dataset larger than a job
pod's memory limit sits on a PersistentVolume the admin made (hostPath: the node is this machine, so the
notebook-equivalent kernel on the host reads the same files at the same path); `%%tfdist run` trains over
``tf.data.TFRecordDataset("/data/...")`` in real pods that mount the claim read-only, and the payload the
kernel ships is measured: the data never travels through it. A second cell reading a path only the notebook
has ends with the sentence saying so, not TensorFlow's bare NotFoundError.

Small on purpose (one worker, one PS, a one-layer model, records of 8 MiB): under two minutes on a quiet
machine, most of it TensorFlow starting in the kernel and the pods.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.kernels import kernel_env
from tests.realnode_jobs import (
    WatchedKernel,
    drop_tenant,
    job_pods,
    make_tenant,
    start_notebook_pod,
    wait_gone,
)
from tfdist import datamounts, settings
from tfdist.datamounts import DataMount

if "tests.realnode_fixtures" not in sys.modules:
    from tests.realnode_fixtures import real_cluster  # noqa: F401

pytestmark = [pytest.mark.k8s, pytest.mark.realnode]

MEMORY_LIMIT = 768 * 2**20  # each job pod's (--memory 768Mi)
RECORD_BYTES = 8 * 2**20  # one record: 2 Mi float32 values
RECORDS = 112  # 896 MiB of records: more than a pod may hold in memory
FLAGS = f"--workers 1 --ps 1 --cpu 0.45 --memory {MEMORY_LIMIT // 2**20}Mi"

# the notebook's first cells: TensorFlow, the shared dataset (a 16-feature summary of each 8 MiB record, so
# the model stays tiny while every byte of the file is read), a one-layer model, and a counter of the
# payload's bytes around what %%tfdist ships (tfdist.payload.pack)
SETUP = """
import os
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import tensorflow as tf
import tfdist.payload as _payload
%load_ext tfdist

PAYLOAD_BYTES = []
_pack = _payload.pack
def _counted(*a, **k):
    blob = _pack(*a, **k)
    PAYLOAD_BYTES.append(len(blob))
    return blob
_payload.pack = _counted

FEATURES = {"x": tf.io.FixedLenFeature([], tf.string), "y": tf.io.FixedLenFeature([], tf.int64)}
def parse(record):
    ex = tf.io.parse_single_example(record, FEATURES)
    x = tf.reshape(tf.io.decode_raw(ex["x"], tf.float32), [16, -1])
    return tf.reduce_mean(x, axis=1), tf.cast(ex["y"], tf.float32)

model = tf.keras.Sequential([tf.keras.layers.Input((16,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=tf.keras.optimizers.legacy.SGD(learning_rate=0.05), loss="mse")
"""

WRITE = """
import numpy as np
rng = np.random.default_rng(0)
base = rng.random({n}, dtype=np.float32)
with tf.io.TFRecordWriter({path!r}) as w:
    for i in range({records}):
        y = i % 2
        x = (base * (1 + y) + np.float32(i) * 1e-3).tobytes()
        feat = {{"x": tf.train.Feature(bytes_list=tf.train.BytesList(value=[x])),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y]))}}
        w.write(tf.train.Example(features=tf.train.Features(feature=feat)).SerializeToString())
print("written", os.path.getsize({path!r}))
"""


def shared_volume(cluster, ns: str, host_dir: str, claim: str) -> None:
    """What the admin does: a PV on the node's directory, and the user's claim bound to it (read-only)."""
    pv = f"dv-{uuid.uuid4().hex[:10]}"
    cluster.request(
        "POST",
        "/api/v1/persistentvolumes",
        {
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "2Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": host_dir, "type": "Directory"},
                "claimRef": {"namespace": ns, "name": claim},
            },
        },
    )
    cluster.request(
        "POST",
        f"/api/v1/namespaces/{ns}/persistentvolumeclaims",
        {
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "2Gi"}},
            },
        },
    )


def drop_volumes(cluster, ns: str) -> None:
    for pv in (cluster.get("/api/v1/persistentvolumes") or {}).get("items", []):
        if (pv["spec"].get("claimRef") or {}).get("namespace") == ns:
            try:
                cluster.request("DELETE", f"/api/v1/persistentvolumes/{pv['metadata']['name']}")
            except Exception:
                pass


@pytest.mark.timeout(900)
def test_a_dataset_larger_than_a_pods_memory_trains_from_the_shared_volume(real_cluster, job_image, tmp_path):
    t0 = time.monotonic()
    host_dir = f"/data/tfdist-test-{uuid.uuid4().hex[:8]}"
    made_root = not Path("/data").exists()  # removed again at the end if this test made it
    Path(host_dir).mkdir(parents=True, mode=0o755)
    Path(host_dir).chmod(0o755)
    mount = DataMount(claim="shared-records", mount=host_dir, read_only=True)  # the same path as the host's
    # the user's namespace from a profile with that data volume (its admission parameters allow the claim)
    k = ann = None
    try:
        ann = make_tenant(real_cluster, "data", tmp_path, data_volumes=(mount,))
        ns = ann.namespace
        shared_volume(real_cluster, ns, host_dir, mount.claim)
        start_notebook_pod(real_cluster, ann)
        env = kernel_env(
            str(tmp_path / "state"),
            KUBECONFIG=ann.kubeconfig,
            TFDIST_BACKEND="kubernetes",
            TFDIST_NAMESPACE=ns,
            TFDIST_WORKER_IMAGE=job_image,
            TFDIST_USER=ann.user,
            TFDIST_POD_NAME=ann.notebook_pod,
            TFDIST_POD_UID=ann.notebook_uid,
            # what the spawner writes for a profile with data volumes
            **{settings.ENV_DATA_VOLUMES: datamounts.dump([mount])},
        )
        env.pop("TFDIST_AGENT_PORT", None)
        k = WatchedKernel(env, cwd=tempfile.mkdtemp(dir=tmp_path))
        r = k.run(SETUP, timeout=300)
        assert r.error is None, r.error_text
        data = f"{host_dir}/train.tfrecord"
        r = k.run(WRITE.format(n=RECORD_BYTES // 4, path=data, records=RECORDS), timeout=300)
        assert r.error is None, r.error_text
        size = Path(data).stat().st_size
        Path(data).chmod(0o644)
        assert size > MEMORY_LIMIT, (size, MEMORY_LIMIT)
        print(
            f"\ndataset {size / 2**20:.0f} MiB on the shared volume; each job pod's memory limit "
            f"{MEMORY_LIMIT / 2**20:.0f} MiB"
        )
        # the notebook builds the dataset over the shared path; the pods read the same path
        r = k.run(f'ds = tf.data.TFRecordDataset("{data}").map(parse).batch(4)', timeout=60)
        assert r.error is None, r.error_text
        t_job = time.monotonic()
        r = k.run(
            f"%%tfdist run --name shared {FLAGS}\n"
            f"history = model.fit(ds, epochs=1, steps_per_epoch={RECORDS // 4})\n",
            timeout=600,
        )
        assert r.error is None, r.error_text
        print(f"the job over the shared volume: {time.monotonic() - t_job:.1f} s")
        r = k.run("print('PAYLOAD', PAYLOAD_BYTES[-1]); print('LOSS', history.history['loss'])")
        assert r.error is None, r.error_text
        payload = int(r.text.split("PAYLOAD ")[1].split()[0])
        print(f"payload shipped to the job: {payload} bytes ({payload / size:.2e} of the dataset); {r.text}")
        assert payload < 1 * 2**20, f"the payload is {payload} bytes: the data travelled through it"
        assert "LOSS [" in r.text and "nan" not in r.text.lower(), r.text
        wait_gone(real_cluster, ns, "shared", 90)

        # a path the notebook has and the pods do not: one sentence, not TF's NotFoundError
        local = tmp_path / "only-here.tfrecord"
        shutil.copyfile(__file__, local)  # any file: the pods never get to read it
        cell = (
            f"%%tfdist run --name notshared {FLAGS}\n"
            f'local_ds = tf.data.TFRecordDataset("{local}").map(parse).batch(4)\n'
            "model.fit(local_ds, epochs=1, steps_per_epoch=2)\n"
        )
        r = k.run(cell, timeout=600)
        assert r.error is not None, r.text
        said = r.error_text
        print(f"\nthe cell reading a path only the notebook has said: {r.error['evalue']}")
        assert r.error["ename"] == "DataPathMissing", said
        assert f"{local} exists in this notebook but not in the job's pods" in said, said
        assert f"they mount only {host_dir}" in said, said
        wait_gone(real_cluster, ns, "notshared", 90)
        assert not job_pods(real_cluster, ns, "notshared")
        print(f"whole test: {time.monotonic() - t0:.1f} s")
    finally:
        if k is not None:
            k.shutdown()
        if ann is not None:
            drop_tenant(real_cluster, ann)
            drop_volumes(real_cluster, ann.namespace)
        shutil.rmtree(host_dir, ignore_errors=True)
        if made_root:
            with contextlib.suppress(OSError):
                Path("/data").rmdir()  # only if empty
