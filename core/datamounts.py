"""Shared data volumes: the profile's claims mounted at the same path in the notebook and in every pod of its
`%%tfdist` jobs, so that ``tf.data.TFRecordDataset("/data/...")`` reads the same files in both and the data
never travels through the payload.

Typed records and pure functions only: the profiles' schema checks a mount path here (`check_mount_path`),
the settings carry `DataMount` records from the spawner to the kernel, the manifests mount them
(tfdist.kube.manifests), and the kernel decides here whether a failed job read a path the notebook has but
the job's processes do not (`missing_data_path`), to say so in one sentence instead of TensorFlow's bare
NotFoundError. Locally the job's processes share the notebook's file system: there is nothing to mount.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .errors import JobFailed

__all__ = [
    "HOME_ROOT",
    "SYSTEM_DIRS",
    "DataMount",
    "DataPathMissing",
    "MissingDataPath",
    "check_mount_path",
    "dump",
    "load",
    "missing_data_path",
    "under",
]

#: where notebook images keep the users' homes: a data volume over it would hide the home
HOME_ROOT = "/home"
#: what the image and the container runtime own: a data volume there would hide or replace them
SYSTEM_DIRS = frozenset(
    "bin boot dev etc lib lib32 lib64 libx32 opt proc root run sbin srv sys tmp usr var".split()
)
_PATH_CHARS = re.compile(r"[A-Za-z0-9._/-]+")


@dataclass(frozen=True)
class DataMount:
    """One shared data volume: an existing PersistentVolumeClaim of the user's namespace, and where it is
    mounted (the same path in the notebook pod and in every pod of its jobs)."""

    claim: str
    mount: str
    read_only: bool = True


def check_mount_path(path: str) -> str:
    """`path` if a data volume may be mounted there, else ValueError with the sentence the admin reads."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"mount {path!r} must be an absolute path, such as /data/imagenet")
    if not _PATH_CHARS.fullmatch(path):
        raise ValueError(f"mount {path!r} may hold only letters, digits, '.', '_', '-' and '/'")
    if posixpath.normpath(path) != path or path.startswith("//"):
        raise ValueError(
            f"mount {path!r} must be written plainly (no '.', '..', '//' or trailing '/'): "
            f"{posixpath.normpath(path)!r}?"
        )
    if path == "/":
        raise ValueError("mount '/' would hide the whole image: mount data at a path such as /data/imagenet")
    top = path.split("/")[1]
    if path == HOME_ROOT or path.startswith(HOME_ROOT + "/"):
        raise ValueError(
            f"mount {path!r} is over the users' home ({HOME_ROOT}): it would hide or split the home "
            "directory; mount data at a path such as /data/imagenet"
        )
    if top in SYSTEM_DIRS:
        raise ValueError(
            f"mount {path!r} is in the system directory /{top}: it would hide what the image needs there; "
            "mount data at a path such as /data/imagenet"
        )
    return path


def under(path: str, mount: str) -> bool:
    """Whether `path` (absolute, normalised) is `mount` or inside it."""
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def dump(mounts: Iterable[DataMount]) -> str:
    """The records as the spawner writes them into the server's environment (TFDIST_DATA_VOLUMES)."""
    return json.dumps([asdict(m) for m in mounts], sort_keys=True)


def load(raw: str | Sequence[dict[str, Any]]) -> tuple[DataMount, ...]:
    """The records back from `dump` (tests; the settings parse the same JSON with pydantic)."""
    items = json.loads(raw) if isinstance(raw, str) else raw
    return tuple(DataMount(**i) for i in items)


@dataclass(frozen=True)
class MissingDataPath:
    """A failed job read a path that exists in the notebook but not where the job ran."""

    path: str
    #: where the job's pods mount data (the profile's data volumes)
    mounts: tuple[str, ...]

    def sentence(self) -> str:
        where = (
            f"they mount only {', '.join(self.mounts)} (the data volumes of your profile)"
            if self.mounts
            else "they mount no data volume (your profile has none)"
        )
        hint = "" if self.path.startswith("/") else " (a relative path is read from the pod's own directory)"
        return (
            f"{self.path} exists in this notebook but not in the job's pods{hint}: {where}. Put the data on "
            "a data volume and read it by its absolute path, or ask your admin to add one to your profile"
        )


class DataPathMissing(JobFailed):
    """A job failed reading a path only the notebook has (the record says which, and what the pods mount)."""

    def __init__(self, record: MissingDataPath, job: str, remote_traceback: str = ""):
        self.record = record
        super().__init__(f"job {job} failed: {record.sentence()}", remote_traceback, job)


# where TensorFlow's NotFoundError and Python's FileNotFoundError name the path they could not open (only
# there: a message or traceback names many other paths, source files the notebook has too)
_NAMED = (
    re.compile(r"(\S+); No such file or directory"),
    re.compile(r"No such file or directory: '([^']+)'"),
)


def _named_paths(message: str) -> list[str]:
    out: list[str] = []
    for pattern in _NAMED:
        for m in pattern.finditer(message):
            p = m.group(1).strip("'\"")
            if p and p not in out:
                out.append(p)
    return out


def missing_data_path(
    error: dict[str, Any] | None,
    *,
    exists: Callable[[str], bool],
    mounts: Sequence[DataMount],
    backend: str,
    cwd: str = "/",
) -> MissingDataPath | None:
    """The path a failed job could not find although the notebook has it (``exists``: the kernel's own
    check, relative paths from ``cwd``), when the job's error is "not found"; None for any other failure.

    Only Kubernetes: locally the job's processes share the notebook's files and directory, so a path they
    could not read is missing for the notebook too. A path inside one of the pods' mounts is on the shared
    volume for both: missing there (or written after the job read it), not a path only the notebook has."""
    if not error or backend != "kubernetes":
        return None
    kind, message = str(error.get("type", "")), str(error.get("message", ""))
    if "NotFound" not in kind and "No such file or directory" not in message:
        return None
    # the message may be cut short on its way: the traceback's last line names the path too
    for path in _named_paths(message) or _named_paths(str(error.get("traceback", ""))):
        absolute = path.startswith("/")
        if not exists(posixpath.normpath(posixpath.join(cwd, path))):
            continue
        if absolute and any(under(path, m.mount) for m in mounts):
            continue
        return MissingDataPath(path=path, mounts=tuple(m.mount for m in mounts))
    return None
