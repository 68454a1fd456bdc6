"""The image cache stays bounded (k8s/build_images.py): each project change writes a new job and notebook
archive under a new hash, and before pruning a machine's cache grew by a gigabyte per change."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("build_images", REPO / "k8s" / "build_images.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_all_but_the_newest_archives_of_each_image_go_and_named_ones_stay(tmp_path, monkeypatch):
    mod = _module()
    monkeypatch.setattr(mod, "CACHE", tmp_path)
    archives = tmp_path / "archives"
    archives.mkdir()
    made = {}
    names = ["job-a1", "job-b2", "job-c3", "job-d4", "job-e5", "notebook-f6", "notebook-g7"]
    for i, name in enumerate(names):
        path = archives / f"tfdist-{name}.oci.tar"
        path.write_bytes(b"x")
        os.utime(path, (1000 + i, 1000 + i))  # oldest first
        made[name] = path
    (archives / "tfdist-base-h8.oci.tar").write_bytes(b"x")
    (archives / "notes.txt").write_text("not an archive")

    dropped = mod.prune_archives(keep={str(made["job-a1"])}, per_image=3)

    assert sorted(p.name for p in dropped) == ["tfdist-job-b2.oci.tar"]
    left = sorted(p.name for p in archives.iterdir())
    assert left == [
        "notes.txt",
        "tfdist-base-h8.oci.tar",
        "tfdist-job-a1.oci.tar",  # named in current.json: kept whatever its age
        "tfdist-job-c3.oci.tar",
        "tfdist-job-d4.oci.tar",
        "tfdist-job-e5.oci.tar",
        "tfdist-notebook-f6.oci.tar",
        "tfdist-notebook-g7.oci.tar",
    ]
