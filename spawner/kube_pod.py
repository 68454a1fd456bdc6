"""The Kubernetes spawner's pod options: what a valid choice becomes on the notebook pod.

`apply_choice` sets ``cpu_guarantee``/``cpu_limit`` (floats, limit = choice x the profile's limit_factor),
``mem_guarantee``/``mem_limit`` (int bytes: JupyterHub's ByteSpecification rejects "4Gi"),
``extra_resource_limits``/``extra_resource_guarantees`` with the model's GPU resource (equal, as Kubernetes
requires for extended resources), the model's node selector and tolerations on top of the admin's base ones,
and the image. Every spawn starts again from the admin's base values, so one spawn's GPU request or node
selector never sticks to the next (kubespawner#546, #691). `get_env` gives ``%%tfdist`` its defaults
(tfdist.settings), the pod's own name/UID through the downward API.
"""

from __future__ import annotations

import json
from typing import Any

from tfdist import datamounts, settings
from tfdist.kube import preemption
from tfdist.kube.datavolumes import data_volume_parts
from tfdist.kube.names import notebook_pod_labels
from tfdist.kube.queueing import L_QUEUE

from .profiles import Profile, ProfilesConfig
from .validation import Choice

__all__ = ["KubePodMixin"]


def _listed(value: Any) -> list[Any]:
    """KubeSpawner's volumes and volume_mounts: a list, or a dict whose keys only order the entries."""
    return [value[k] for k in sorted(value)] if isinstance(value, dict) else list(value)


class KubePodMixin:
    """`apply_choice` and `get_env`; mixed into TfdistKubeSpawner before GpuFormMixin (traits live there)."""

    _tfdist_base: dict[str, Any] | None = None

    def _base(self) -> dict[str, Any]:
        """The admin's own resources, node selector and tolerations, as first configured."""
        if self._tfdist_base is None:
            tol = self.tolerations
            self._tfdist_base = {
                "volumes": _listed(self.volumes),
                "volume_mounts": _listed(self.volume_mounts),
                "extra_resource_limits": dict(self.extra_resource_limits),
                "extra_resource_guarantees": dict(self.extra_resource_guarantees),
                "node_selector": dict(self.node_selector),
                "tolerations": [tol[k] for k in sorted(tol)] if isinstance(tol, dict) else list(tol),
            }
        return self._tfdist_base

    def apply_choice(self, choice: Choice, profile: Profile, cfg: ProfilesConfig) -> None:
        base = self._base()
        gpu_resources = {m.resource for m in cfg.gpu_models.values()}
        self.cpu_guarantee = choice.cpu
        self.cpu_limit = round(choice.cpu * profile.cpu.limit_factor, 3)
        self.mem_guarantee = choice.memory_bytes
        self.mem_limit = int(choice.memory_bytes * profile.memory_gib.limit_factor)
        limits = {k: v for k, v in base["extra_resource_limits"].items() if k not in gpu_resources}
        guarantees = {k: v for k, v in base["extra_resource_guarantees"].items() if k not in gpu_resources}
        node_selector = dict(base["node_selector"])
        tolerations = list(base["tolerations"])
        if choice.gpus and choice.gpu_model:
            model = cfg.gpu_models[choice.gpu_model]
            limits[model.resource] = str(choice.gpus)
            guarantees[model.resource] = str(choice.gpus)
            node_selector.update(model.node_selector)
            tolerations += [t.as_k8s() for t in model.tolerations if t.as_k8s() not in tolerations]
        self.extra_resource_limits = limits
        self.extra_resource_guarantees = guarantees
        self.node_selector = node_selector
        self.tolerations = tolerations
        self.image = choice.image
        # the profile's data volumes, where every pod of this server's jobs mounts them too (get_env)
        volumes, mounts = data_volume_parts(profile.data_mounts)
        self.volumes = [*base["volumes"], *volumes]
        self.volume_mounts = [*base["volume_mounts"], *mounts]
        # the label the NetworkPolicy of this user's %%tfdist jobs admits to the coordinator's agent
        labels = {k: v for k, v in self.extra_labels.items() if k not in (L_QUEUE, preemption.L_PRIORITY)}
        if choice.gpus and profile.kueue_queue and cfg.kueue is not None and self.enable_user_namespaces:
            # a GPU server waits its turn in the profile's queue like a job (a Workload of one pod, gated
            # until admitted), with the notebooks' priority: a queue that takes its lent GPUs back evicts
            # jobs, not servers (tfdist.kube.preemption; the hub converges the class with the queues)
            labels[L_QUEUE] = profile.kueue_queue
            labels.update(preemption.notebook_labels())
        self.extra_labels = {**labels, **notebook_pod_labels(self.user.name)}

    def get_env(self) -> dict[str, Any]:
        env: dict[str, Any] = super().get_env()
        choice = self.tfdist_choice
        env[settings.ENV_BACKEND] = "kubernetes"
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's start-up chatter is not an error in the cell
        env[settings.ENV_NAMESPACE] = self.namespace
        env[settings.ENV_WORKER_IMAGE] = self.worker_image or self.image
        env[settings.ENV_USER] = self.user.name
        env[settings.ENV_LIFELINE_GRACE_S] = str(self.lifeline_grace_seconds)
        env[settings.ENV_POD_NAME] = {"valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
        env[settings.ENV_POD_UID] = {"valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}
        identity = self.known_pod_identity()
        if identity is not None:  # every job pod runs as this notebook
            env[settings.ENV_POD_IDENTITY] = identity.dump()
        gpus = choice.gpus if choice is not None else 0
        env[settings.ENV_GPUS] = str(gpus)
        if choice is not None and choice.gpu_model:
            env[settings.ENV_GPU_MODEL] = choice.gpu_model
            # %%tfdist puts its GPU workers on the same model as this server
            model = self.tfdist_profiles().gpu_models[choice.gpu_model]
            env[settings.ENV_GPU_NODE_SELECTOR] = json.dumps(model.node_selector)
            env[settings.ENV_GPU_TOLERATIONS] = json.dumps([t.as_k8s() for t in model.tolerations])
            # and asks for the model's resource: a MIG profile's, not nvidia.com/gpu (the admission
            # policy refuses any other)
            env[settings.ENV_GPU_RESOURCE] = model.resource
        if choice is not None:
            profile = self.tfdist_profiles().profile(choice.profile)
            if profile is not None and profile.kueue_queue:
                env[settings.ENV_KUEUE_QUEUE] = profile.kueue_queue
            if profile is not None and profile.data_volumes:
                env[settings.ENV_DATA_VOLUMES] = datamounts.dump(profile.data_mounts)
        if gpus == 0:
            # with the NVIDIA runtime as the node default, a CUDA image (NVIDIA_VISIBLE_DEVICES=all) would
            # otherwise see every GPU of the node without having requested one
            env["NVIDIA_VISIBLE_DEVICES"] = "void"
        return env
