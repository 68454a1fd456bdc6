"""hub_config/admission-policy.yaml's generated CEL is what its generator writes (k8s/managed_fields_cel.py):
a hand edit of one level of the nested walk would bound less than it says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location(
        "managed_fields_cel", REPO / "k8s" / "managed_fields_cel.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_managed_fields_walk_is_the_generators():
    gen = _generator()
    docs = [d for d in yaml.safe_load_all((REPO / "hub_config" / "admission-policy.yaml").read_text()) if d]
    policy = next(
        d for d in docs if d["metadata"]["name"] == "tfdist-user-managed-fields" and "variables" in d["spec"]
    )
    walk = next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == "keyBytes")
    assert (
        " ".join(walk.split()) == f"variables.entries.map(e, !has(e.fieldsV1) ? 0 : {gen.key_bytes()}).sum()"
    )
    assert f"nested deeper than {gen.DEPTH} fields" in policy["spec"]["validations"][0]["messageExpression"]


def test_the_walk_counts_every_level_and_a_deeper_tree_as_too_big():
    gen = _generator()
    text = gen.key_bytes("f", 3)
    assert text == (
        "f.map(k1, size(k1) + f[k1].map(k2, size(k2) + f[k1][k2].map(k3, size(k3) + "
        f"size(f[k1][k2][k3]) * {gen.TOO_DEEP}).sum()).sum()).sum()"
    )
