"""benchmarks/bare_pods.py: the bare TF_CONFIG launch's manifests (pure, no cluster)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bare_pods

FILES = {"server.py": "print('server')\n", "coordinator.py": "print('coordinator')\n"}


def objects(**kw):
    return bare_pods.bare_objects("b1", image="job:1", files=FILES, launch_t0=123.5, **kw)


def test_objects_in_creation_order_with_the_coordinator_last():
    objs = objects(workers=2, ps=1)
    assert [o["kind"] for o in objs] == ["ConfigMap", "Service", "Pod", "Pod", "Pod", "Pod"]
    assert [o["metadata"]["name"] for o in objs[2:]] == [
        "b1-worker-0",
        "b1-worker-1",
        "b1-ps-0",
        "b1-chief-0",
    ]
    assert all(o["metadata"]["labels"][bare_pods.LABEL] == "b1" for o in objs)


def test_files_are_mounted_unmodified_from_the_config_map():
    cm, _, *pods = objects()
    assert cm["data"] == FILES
    for p in pods:
        assert p["spec"]["volumes"] == [{"name": "bare", "configMap": {"name": "b1"}}]
        c = p["spec"]["containers"][0]
        assert c["volumeMounts"][0]["mountPath"] == bare_pods.MOUNT
        role = p["metadata"]["labels"]["task"].split("-")[0]
        script = "coordinator.py" if role == "chief" else "server.py"
        assert c["command"][:4] == ["python", "-u", "-c", bare_pods.WRAPPER]
        assert c["command"][4] == f"{bare_pods.MOUNT}/{script}"


def test_tf_config_names_every_pod_under_the_headless_service():
    _, svc, *pods = objects(workers=2, ps=2, epochs=3, steps=50)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {bare_pods.LABEL: "b1"}
    for p in pods:
        env = {e["name"]: e["value"] for e in p["spec"]["containers"][0]["env"]}
        cfg = json.loads(env["TF_CONFIG"])
        assert cfg["cluster"] == {
            "chief": ["b1-chief-0.b1:2222"],
            "worker": ["b1-worker-0.b1:2222", "b1-worker-1.b1:2222"],
            "ps": ["b1-ps-0.b1:2222", "b1-ps-1.b1:2222"],
        }
        assert f"{cfg['task']['type']}-{cfg['task']['index']}" == p["metadata"]["labels"]["task"]
        assert p["spec"]["hostname"] == p["metadata"]["name"] and p["spec"]["subdomain"] == "b1"
        assert env["LAUNCH_T0"] == "123.500000"
    chief = pods[-1]["spec"]["containers"][0]["command"]
    assert chief[-2:] == ["3", "50"]  # epochs, steps


def test_same_limits_as_requests():
    for p in objects(cpu="450m", memory="1536Mi")[2:]:
        res = p["spec"]["containers"][0]["resources"]
        assert res == {
            "requests": {"cpu": "450m", "memory": "1536Mi"},
            "limits": {"cpu": "450m", "memory": "1536Mi"},
        }


@pytest.mark.parametrize(
    ("kw", "says"),
    [({"files": {"server.py": ""}}, "coordinator.py"), ({"files": FILES, "ps": 0}, "at least one")],
)
def test_bad_input_is_refused_with_a_sentence(kw, says):
    with pytest.raises(ValueError, match=says):
        bare_pods.bare_objects("b1", image="job:1", **kw)


def test_marks_and_result_read_from_a_log():
    log = "\n".join(
        [
            'BARE {"mark": "tf_imported", "t": 10.0}',
            "some TensorFlow warning",
            'BARE {"mark": "servers", "t": 12.5}',
            '{"launch_to_first_epoch_s": 8.1, "steps_per_s_after_first_epoch": 90.0, "loss": [1.0]}',
        ]
    )
    assert bare_pods.marks(log) == {"tf_imported": 10.0, "servers": 12.5}
    assert bare_pods.result(log)["launch_to_first_epoch_s"] == 8.1
    assert bare_pods.result("no json here") is None
