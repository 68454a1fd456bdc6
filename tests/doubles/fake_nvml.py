"""FakeNvmlInventory: a GPU inventory listing fake GPU indices, for machines without a GPU (CI).

Named, one behaviour: it answers `gpus()` like tfdist.gpus.NvmlInventory would on a machine with the given
devices. The real hub process picks it up through config
(``c.TfdistLocalSpawner.gpu_inventory = FakeNvmlInventory([...])``), so the exclusivity tests run the
same allocator code as production.
"""

from __future__ import annotations

from collections.abc import Sequence

from tfdist.gpus import GpuInfo


class FakeNvmlInventory:
    """`names[i]` is the model name of fake GPU index i."""

    def __init__(self, names: Sequence[str], memory_total_mib: float = 81559.0) -> None:
        self._gpus = [
            GpuInfo(index=i, name=n, uuid=f"GPU-fake-{i:04d}", memory_total_mib=memory_total_mib)
            for i, n in enumerate(names)
        ]
        self.calls = 0

    def gpus(self) -> list[GpuInfo]:
        self.calls += 1
        return list(self._gpus)
