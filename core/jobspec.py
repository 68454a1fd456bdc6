"""The job spec: what `%%tfdist run` asked for, validated once, shared by every backend.

Pure data and pure checks; nothing here starts anything, so a bad spec can never leave half a job behind.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields

from .errors import JobSpecError
from .job.vocab import Strategy

NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")  # DNS-1035 label, short enough for pod names
BACKENDS = ("local", "kubernetes")
STRATEGIES = tuple(s.value for s in Strategy)
MAX_TASKS = 256
_MEM_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([KMGT]i?)?$")
_MEM_UNITS = {
    None: 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


@dataclass(frozen=True)
class JobSpec:
    name: str
    user: str
    workers: int = 2
    ps: int = 1
    gpus_per_worker: int = 0
    cpu: float | None = None  # cores per task
    memory_bytes: int | None = None  # per task
    backend: str = "local"
    timeout_s: float = 600.0  # how long start-up (scheduling, servers listening) may take
    base_port: int | None = None  # local backend: fixed ports from here on instead of free ones
    strategy: Strategy | str = Strategy.PS  # a str only when unknown: `validate` refuses it with a sentence
    checkpoint_every: int | None = None  # PS jobs: steps between checkpoints (a lost PS resumes from one)
    # Kubernetes backend fields (ignored locally)
    namespace: str | None = None
    image: str | None = None
    detach: bool = False  # --detach: no kernel holds it; its results wait for `%tfdist attach` (job.detach)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Strategy.parse(self.strategy) or self.strategy)
        # `detach` rode in `extra` before it was a field: a record of then reads as detached, and the copy
        # is not kept (only the kernel's backends and the local supervisor, of this same version, read it)
        if "detach" in self.extra:
            extra = dict(self.extra)
            object.__setattr__(self, "detach", bool(self.detach or extra.pop("detach")))
            object.__setattr__(self, "extra", extra)

    @property
    def task_count(self) -> int:
        if self.strategy == "allreduce":
            return self.workers  # chief-0 is one of the workers
        return self.workers + self.ps + 1  # + the coordinator (chief)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        """A spec as `to_json` wrote it; keys this version does not know (a newer kernel's) are ignored."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> JobSpec:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def parse_memory(text: str) -> int:
    """Bytes from a Kubernetes-style quantity ("512Mi", "2G", "1073741824"). Spaces are refused."""
    m = _MEM_RE.match(text.strip() if text == text.strip() else "\0")
    if not m:
        raise JobSpecError(
            f"--memory {text!r} is not a size: use a number of bytes or a unit like 512Mi, 2Gi or 4G"
        )
    value = float(m.group(1)) * _MEM_UNITS[m.group(2)]
    if value < 64 * 2**20:
        raise JobSpecError(f"--memory {text!r} is too small: a TensorFlow task needs at least 64Mi")
    return int(value)


def validate(spec: JobSpec, available_gpus: int | None) -> JobSpec:
    """Check a spec against itself and this server (`available_gpus`: the local GPUs, None where not
    known: a backend re-checking what the magic checked); raise JobSpecError with a user-facing message."""
    if not NAME_RE.match(spec.name):
        raise JobSpecError(
            f"--name {spec.name!r} is not valid: use 1-40 lowercase letters, digits and '-', "
            "starting with a letter and not ending with '-'"
        )
    if spec.workers < 1:
        raise JobSpecError(f"--workers must be at least 1 (got {spec.workers})")
    if spec.strategy not in STRATEGIES:
        raise JobSpecError(
            f"--strategy {spec.strategy!r} is unknown: choose ps (parameter servers) or allreduce "
            "(MultiWorkerMirroredStrategy, workers only)"
        )
    if spec.strategy == "allreduce":
        if spec.ps:
            raise JobSpecError(
                f"--ps {spec.ps} does not go with --strategy allreduce: all-reduce has no parameter "
                "servers (the workers average gradients among themselves); drop --ps"
            )
        if spec.checkpoint_every is not None:
            raise JobSpecError("--checkpoint-every is for --strategy ps jobs (a lost PS resumes from it)")
        if spec.detach and spec.backend == "kubernetes" and spec.gpus_per_worker > 0:
            # replica 0 is the job's agent pod too, and keeps the results until they are taken: its GPUs
            # would stay allocated after the fit, for up to the retention, with nobody training
            raise JobSpecError(
                "--detach does not go with --strategy allreduce and GPUs on Kubernetes: replica 0 keeps "
                "the results for %tfdist attach and would hold its GPUs until then; run it attached, or "
                "detach a --strategy ps job (its results wait in a pod without GPUs)"
            )
    elif spec.ps < 1:
        raise JobSpecError(f"--ps must be at least 1 (got {spec.ps}): parameter-server training needs one")
    if spec.workers + spec.ps > MAX_TASKS:
        raise JobSpecError(f"{spec.workers + spec.ps} tasks is more than the limit of {MAX_TASKS}")
    if spec.gpus_per_worker < 0:
        raise JobSpecError(f"--gpus-per-worker cannot be negative (got {spec.gpus_per_worker})")
    if spec.backend not in BACKENDS:
        raise JobSpecError(f"--backend {spec.backend!r} is unknown: choose one of {', '.join(BACKENDS)}")
    if spec.cpu is not None and not (math.isfinite(spec.cpu) and 0 < spec.cpu <= 512):
        raise JobSpecError(f"--cpu must be a number of cores above 0 (got {spec.cpu})")
    if spec.checkpoint_every is not None and (
        isinstance(spec.checkpoint_every, bool)
        or not isinstance(spec.checkpoint_every, int)
        or spec.checkpoint_every < 1
    ):
        raise JobSpecError(
            f"--checkpoint-every must be a positive number of steps (got {spec.checkpoint_every!r})"
        )
    if not (math.isfinite(spec.timeout_s) and spec.timeout_s > 0):  # nan: a timeout that never fires
        raise JobSpecError(f"--timeout must be a positive number of seconds (got {spec.timeout_s})")
    if spec.base_port is not None and not (1024 <= spec.base_port <= 65535 - spec.task_count):
        raise JobSpecError(f"--base-port {spec.base_port} is out of range (1024-{65535 - spec.task_count})")
    need = spec.workers * spec.gpus_per_worker
    if need and spec.backend == "local" and available_gpus is not None:  # None: not known to the caller
        have = available_gpus
        if need > have:
            raise JobSpecError(
                f"--gpus-per-worker {spec.gpus_per_worker} x --workers {spec.workers} needs {need} GPUs, "
                f"but this server has {have}" + ("" if have else " (no GPU was given to it)")
            )
    return spec


def default_ps(strategy: str, ps: int | None) -> int:
    """`--ps` as given, else what the strategy needs: one PS, or none for all-reduce (where a given
    `--ps` is refused by validate, not silently dropped)."""
    if strategy == "allreduce" and ps is not None:
        raise JobSpecError(
            f"--ps {ps} does not go with --strategy allreduce: all-reduce has no parameter servers "
            "(the workers average gradients among themselves); drop --ps"
        )
    if ps is not None:
        return ps
    return 0 if strategy == "allreduce" else 1


def split_gpus(gpu_ids: list[str], workers: int, per_worker: int) -> list[list[str]]:
    """Give each worker its own disjoint GPUs, in order; the PS and coordinator get none."""
    return [gpu_ids[i * per_worker : (i + 1) * per_worker] for i in range(workers)]
