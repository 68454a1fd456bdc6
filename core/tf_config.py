"""TF_CONFIG for every task of a parameter-server job. Pure functions; backends supply the addresses."""

from __future__ import annotations

import json
from typing import NamedTuple

ROLES = ("chief", "worker", "ps")  # "chief" is the coordinator (TF's name for it, kept for legacy reasons)


def task_names(workers: int, ps: int, strategy: str = "ps") -> list[str]:
    """Stable task ids used in logs, metrics and pod names: chief-0, worker-0.., ps-0..

    All-reduce: `workers` replicas, the first of them chief-0 (it runs the cell like every worker and is
    the one that returns results), then worker-0..worker-(workers-2); no PS."""
    if strategy == "allreduce":
        return ["chief-0"] + [f"worker-{i}" for i in range(workers - 1)]
    return ["chief-0"] + [f"worker-{i}" for i in range(workers)] + [f"ps-{i}" for i in range(ps)]


class TaskId(NamedTuple):
    """A task's identity: its TF role and index. Its text form ("worker-0") names logs, metrics and pods;
    code asks `.role`, never the string again."""

    role: str
    index: int

    def __str__(self) -> str:
        return f"{self.role}-{self.index}"

    @classmethod
    def parse(cls, name: str) -> TaskId:
        role, sep, idx = name.rpartition("-")
        if not sep or role not in ROLES or not idx.isdigit():
            raise ValueError(f"{name!r} is not a task name (chief-0, worker-N, ps-N)")
        return cls(role, int(idx))

    @property
    def is_coordinator(self) -> bool:
        return self.role == "chief"


def split_task(task: str) -> TaskId:
    return TaskId.parse(task)


def cluster(addresses: dict[str, list[str]], strategy: str = "ps") -> dict[str, list[str]]:
    """The cluster dict TF expects, checked: a coordinator, at least one worker and one PS (all-reduce:
    one chief, any number of further workers, no PS)."""
    if strategy == "allreduce":
        if len(addresses.get("chief") or []) != 1 or addresses.get("ps"):
            raise ValueError("an all-reduce cluster needs exactly one chief and no PS")
        out = {"chief": list(addresses["chief"])}
        if addresses.get("worker"):
            out["worker"] = list(addresses["worker"])
        return out
    for role in ROLES:
        if not addresses.get(role):
            raise ValueError(f"a parameter-server cluster needs at least one {role!r} address")
    if len(addresses["chief"]) != 1:
        raise ValueError("exactly one coordinator (chief) address is needed")
    extra = set(addresses) - set(ROLES)
    if extra:
        raise ValueError(f"unknown task types: {sorted(extra)}")
    return {role: list(addresses[role]) for role in ROLES}


def local_addresses(
    workers: int, ps: int, ports: list[int], host: str = "127.0.0.1", strategy: str = "ps"
) -> dict[str, list[str]]:
    """Addresses on one host, ports in task_names() order."""
    names = task_names(workers, ps, strategy)
    if len(ports) != len(names):
        raise ValueError(f"{len(names)} ports needed, got {len(ports)}")
    out: dict[str, list[str]] = {r: [] for r in ROLES}
    for name, port in zip(names, ports, strict=True):
        out[split_task(name)[0]].append(f"{host}:{port}")
    return out


def tf_config(cluster_spec: dict[str, list[str]], task: str) -> str:
    role, index = split_task(task)
    if role not in cluster_spec or index >= len(cluster_spec[role]):
        raise ValueError(f"task {task} is not in the cluster")
    return json.dumps({"cluster": cluster_spec, "task": {"type": role, "index": index}}, sort_keys=True)
