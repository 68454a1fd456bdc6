"""Shared data volumes (issue 24, "Shared data"), the pure parts: the profile's schema refuses bad volumes
with a sentence, the spawner mounts them in the notebook pod and hands them to the server
(TFDIST_DATA_VOLUMES), the settings read them back, every Job of a job mounts them (both strategies), the
user namespace's admission parameters allow exactly those claims, and the kernel turns "not found" for a
path only the notebook has into one sentence. Against a real API server: tests/test_data_volumes_plane.py;
on the real node with a real dataset: tests/test_data_volumes_realnode.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tfdist import datamounts, settings
from tfdist.datamounts import DataMount, DataPathMissing, MissingDataPath, missing_data_path
from tfdist.job.vocab import Strategy
from tfdist.jobspec import JobSpec
from tfdist.kube import allreduce, tenancy
from tfdist.kube import datavolumes as dv
from tfdist.kube import manifests as mf
from tfdist.settings import SettingsError, from_environ

sys.path.insert(0, str(Path(__file__).parent))
from test_spawner_kube import _manifest, kubeconfig, make_spawner  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "hub_config" / "profiles.yaml"
IMAGENET = {"claim": "imagenet", "mount": "/data/imagenet", "read_only": True}
SCRATCH = {"claim": "team-scratch", "mount": "/data/scratch", "read_only": False}


def profiles_with(tmp_path: Path, volumes: list[Any], slug: str = "cpu") -> Path:
    """hub_config/profiles.yaml with `volumes` as one profile's data_volumes."""
    data = yaml.safe_load(PROFILES.read_text())
    next(p for p in data["profiles"] if p["slug"] == slug)["data_volumes"] = volumes
    path = tmp_path / "profiles.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# ------------------------------------------------------------------------------------------ the schema
def test_a_profile_names_its_data_volumes(tmp_path: Path) -> None:
    from tfdist.spawner.profiles import load_profiles

    cfg = load_profiles(profiles_with(tmp_path, [IMAGENET, SCRATCH, {"claim": "c", "mount": "/mnt/c"}]))
    profile = cfg.profile("cpu")
    assert profile is not None
    assert profile.data_mounts == (
        DataMount("imagenet", "/data/imagenet", True),
        DataMount("team-scratch", "/data/scratch", False),
        DataMount("c", "/mnt/c", True),  # read-only unless the profile says otherwise
    )
    assert cfg.profile("gpu").data_mounts == ()  # type: ignore[union-attr]
    # the shipped file's example stays a comment: its default deployment has no such claim
    assert all(p.data_volumes == [] for p in load_profiles(PROFILES).profiles)


@pytest.mark.parametrize(
    ("volumes", "words"),
    [
        ([{"claim": "imagenet", "mount": "data/imagenet"}], "must be an absolute path"),
        ([{"claim": "imagenet", "mount": "/"}], "would hide the whole image"),
        ([{"claim": "imagenet", "mount": "/home/jovyan/data"}], "over the users' home (/home)"),
        ([{"claim": "imagenet", "mount": "/home"}], "over the users' home"),
        ([{"claim": "imagenet", "mount": "/etc/data"}], "in the system directory /etc"),
        ([{"claim": "imagenet", "mount": "/usr"}], "in the system directory /usr"),
        ([{"claim": "imagenet", "mount": "/tmp/x"}], "in the system directory /tmp"),
        ([{"claim": "imagenet", "mount": "/data/../etc"}], "must be written plainly"),
        ([{"claim": "imagenet", "mount": "/data/x/"}], "must be written plainly"),
        ([{"claim": "imagenet", "mount": "/data/a b"}], "may hold only letters"),
        ([IMAGENET, {"claim": "imagenet", "mount": "/data/other"}], "names claim 'imagenet' twice"),
        ([IMAGENET, {"claim": "other", "mount": "/data/imagenet"}], "both at /data/imagenet"),
        (
            [{"claim": "all", "mount": "/data"}, IMAGENET],
            "'imagenet' at /data/imagenet, inside 'all' at /data",
        ),
        ([{"claim": "Imagenet_1", "mount": "/data/x"}], "data_volumes[0].claim"),
        ([{"claim": "imagenet", "mount": "/data/x", "readonly": True}], "readonly"),
        ([{"claim": "imagenet", "mount": "/data/x", "read_only": "yes"}], "read_only"),
        ([{"mount": "/data/x"}], "claim"),
    ],
)
def test_bad_data_volumes_are_refused_with_a_sentence(tmp_path: Path, volumes: list, words: str) -> None:
    from tfdist.spawner.profiles import ProfilesFileError, load_profiles

    with pytest.raises(ProfilesFileError) as e:
        load_profiles(profiles_with(tmp_path, volumes))
    assert words in str(e.value), str(e.value)
    assert "profiles[0] (cpu).data_volumes" in str(e.value), str(e.value)


# ------------------------------------------------------ the spawner: the pod, the server's settings, tenancy
@pytest.mark.usefixtures("kubeconfig")
async def test_the_notebook_pod_mounts_them_and_the_server_is_told(tmp_path: Path) -> None:
    sp = make_spawner(
        ["ml-team"],
        volumes=[{"name": "shared-conf", "configMap": {"name": "conf"}}],  # the admin's own stay
        volume_mounts=[{"name": "shared-conf", "mountPath": "/etc/conf"}],
    )
    sp.profiles_file = str(profiles_with(tmp_path, [IMAGENET, SCRATCH]))
    options = {
        "profile": "cpu",
        "cpu": 1,
        "memory": 2,
        "image": "quay.io/jupyter/tensorflow-notebook:2026-06-01",
    }
    pod = await _manifest(sp, options)
    spec = pod["spec"]
    assert spec["volumes"] == [
        {"name": "shared-conf", "configMap": {"name": "conf"}},
        {"name": "tfdist-data-0", "persistentVolumeClaim": {"claimName": "imagenet", "readOnly": True}},
        {"name": "tfdist-data-1", "persistentVolumeClaim": {"claimName": "team-scratch", "readOnly": False}},
    ]
    c = spec["containers"][0]
    assert c["volumeMounts"] == [
        {"name": "shared-conf", "mountPath": "/etc/conf"},
        {"name": "tfdist-data-0", "mountPath": "/data/imagenet", "readOnly": True},
        {"name": "tfdist-data-1", "mountPath": "/data/scratch", "readOnly": False},
    ]
    env = {e["name"]: e.get("value") for e in c["env"]}
    # the server's settings read back exactly the profile's volumes: its jobs mount the same
    got = from_environ({settings.ENV_DATA_VOLUMES: env[settings.ENV_DATA_VOLUMES]}).data_volumes
    assert got == (
        DataMount("imagenet", "/data/imagenet", True),
        DataMount("team-scratch", "/data/scratch", False),
    )
    # the user namespace admits exactly these claims, the read-only one only read-only
    params = tenancy.policy_params(sp.tenant_policy())["data"]
    assert params["dataClaims"] == "imagenet\nteam-scratch" and params["readOnlyClaims"] == "imagenet"

    # the next spawn with a profile without volumes: none stick, the admin's own stay
    options = {"profile": "gpu", "cpu": 2, "memory": 8, "gpus": 0, "gpu_model": "h100"}
    options["image"] = "quay.io/jupyter/tensorflow-notebook:cuda-2026-06-01"
    pod = await _manifest(sp, options)
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["shared-conf"]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert settings.ENV_DATA_VOLUMES not in env
    assert tenancy.policy_params(sp.tenant_policy())["data"]["dataClaims"] == ""


def test_the_settings_refuse_a_broken_list_naming_the_variable() -> None:
    assert from_environ({}).data_volumes == ()
    for raw in ("not json", json.dumps([{"claim": "x"}]), json.dumps({"claim": "x", "mount": "/d"})):
        with pytest.raises(SettingsError) as e:
            from_environ({settings.ENV_DATA_VOLUMES: raw})
        assert settings.ENV_DATA_VOLUMES in str(e.value)


def test_claim_refusals_name_the_claim_and_the_namespace() -> None:
    from tfdist.spawner.kube_data import claim_refusal

    ro, rw = DataMount("imagenet", "/data/imagenet"), DataMount("scratch", "/data/scratch", False)
    why = claim_refusal(ro, "user-alice", None)
    assert why is not None and "'imagenet'" in why and "'user-alice'" in why and "does not exist" in why
    assert claim_refusal(ro, "ns", ["ReadOnlyMany"]) is None
    assert claim_refusal(ro, "ns", ["ReadWriteMany"]) is None
    assert claim_refusal(rw, "ns", ["ReadWriteMany"]) is None
    why = claim_refusal(rw, "ns", ["ReadOnlyMany"])
    assert why is not None and "ReadWriteMany needed" in why
    why = claim_refusal(ro, "ns", ["ReadWriteOnce"])
    assert why is not None and "(ReadWriteOnce)" in why and "'imagenet'" in why


# ------------------------------------------------------------------------ every pod of a job, both strategies
@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_every_pod_of_a_job_mounts_them(strategy: str) -> None:
    mounts = (DataMount("imagenet", "/data/imagenet"), DataMount("scratch", "/data/scratch", False))
    ps = 1 if strategy == "ps" else 0
    spec = JobSpec(name="j", workers=2, ps=ps, strategy=Strategy(strategy), image="img", user="u")
    build: Any = allreduce if strategy == "allreduce" else mf
    objs = [build.root_job(spec, None), *build.job_objects(spec, token="t")]
    objs = [dv.with_data_volumes(o, mounts) for o in objs]
    jobs = [o for o in objs if o["kind"] == "Job"]
    assert len(jobs) == (3 if strategy == "ps" else 2)  # root, workers (, PS)
    for job in jobs:
        pod = job["spec"]["template"]["spec"]
        assert [v["persistentVolumeClaim"] for v in pod["volumes"]] == [
            {"claimName": "imagenet", "readOnly": True},
            {"claimName": "scratch", "readOnly": False},
        ]
        for c in pod["containers"]:
            assert [(m["mountPath"], m["readOnly"]) for m in c["volumeMounts"]] == [
                ("/data/imagenet", True),
                ("/data/scratch", False),
            ]
    assert all("volumes" not in json.dumps(o) for o in objs if o["kind"] != "Job")
    # no volumes: the objects as before
    plain = build.root_job(spec, None)
    assert dv.with_data_volumes(build.root_job(spec, None), ()) == plain


# ---------------------------------------------------------------------- the kernel's sentence (the record)
TF_NOT_FOUND = (
    "{{function_node __wrapped__IteratorGetNext_output_types_1_device_/job:localhost/replica:0/task:0/"
    "device:CPU:0}} /home/jovyan/train.tfrecord; No such file or directory [Op:IteratorGetNext] name: "
)


def test_a_path_only_the_notebook_has_becomes_one_sentence() -> None:
    mounts = (DataMount("imagenet", "/data/imagenet"),)
    here = {"/home/jovyan/train.tfrecord", "/data/imagenet/a.tfrecord", "/home/jovyan/rel.tfrecord"}
    err = {"type": "NotFoundError", "message": TF_NOT_FOUND, "traceback": "..."}

    def decide(e: dict, backend: str = "kubernetes", m: tuple = mounts) -> MissingDataPath | None:
        return missing_data_path(e, exists=here.__contains__, mounts=m, backend=backend, cwd="/home/jovyan")

    rec = decide(err)
    assert rec == MissingDataPath(path="/home/jovyan/train.tfrecord", mounts=("/data/imagenet",))
    assert rec.sentence().startswith(
        "/home/jovyan/train.tfrecord exists in this notebook but not in the job's pods: they mount only "
        "/data/imagenet (the data volumes of your profile)"
    )
    failed = DataPathMissing(rec, "train", "remote tb")
    assert str(failed) == f"job train failed: {rec.sentence()}" and failed.remote_traceback == "remote tb"
    assert "mount no data volume" in decide(err, m=()).sentence()  # type: ignore[union-attr]
    # Python's own FileNotFoundError, and a relative path (read from the pod's own directory)
    py = {"type": "FileNotFoundError", "message": "[Errno 2] No such file or directory: 'rel.tfrecord'"}
    rel = decide(py)
    assert rel is not None and rel.path == "rel.tfrecord" and "relative path" in rel.sentence()
    # a path on the pods' volume is missing for both: TF's own error stays
    on_volume = {"type": "NotFoundError", "message": "/data/imagenet/a.tfrecord; No such file or directory"}
    assert decide(on_volume) is None
    # missing in the notebook too, another error, or the local backend (the same files): TF's own error
    gone = {"type": "NotFoundError", "message": "/home/jovyan/nothere; No such file or directory"}
    assert decide(gone) is None
    assert decide({"type": "ValueError", "message": "/home/jovyan/train.tfrecord is odd"}) is None
    assert decide(err, backend="local") is None
    assert decide({}) is None
    # the message cut short on its way: the traceback names the path; source files a traceback or a graph
    # error names (which the notebook has too) are never taken for the data
    here.add("/usr/lib/python3/dist-packages/keras/trainer.py")
    src = 'File "/usr/lib/python3/dist-packages/keras/trainer.py", line 9, in fit'
    cut = {"type": "NotFoundError", "message": f"Graph execution error: {src} ...", "traceback": src}
    assert decide(cut) is None
    cut["traceback"] += "\nNotFoundError: /home/jovyan/train.tfrecord; No such file or directory"
    assert decide(cut) == rec


def test_the_records_round_trip() -> None:
    mounts = (DataMount("a", "/data/a"), DataMount("b", "/data/b", False))
    assert datamounts.load(datamounts.dump(mounts)) == mounts
