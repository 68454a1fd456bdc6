"""A `--checkpoint-every` job's checkpoint as it leaves the coordinator pod and comes back (issue 25), pure.

Kueue evicts a preempted job whole, and its checkpoints lived in the coordinator pod. So the pod's agent
hands the newest one to the kernel (`CheckpointInfo`, then the bundle), the kernel keeps only that one,
and when the job is readmitted it sends it to the new coordinator pod, whose fit resumes from it the way a
lost parameter server's does (tfdist.runtime.psrecovery). Nothing here does I/O: the bundle's layout and
its checks; the pod side reads and writes it (tfdist.runtime.ckptbundle), the kernel side keeps it
(tfdist.kube.checkpoints).

A bundle is data, never code: a fixed magic, a length-prefixed JSON header (`Header`: the fit's progress
and each file's name, size and SHA-256), then the files' bytes in that order. No pickle, no archive
format with links, paths or compression: a file name is one of TensorFlow's checkpoint names for the
step the progress names (`ckpt-<step>.index`, `ckpt-<step>.data-NNNNN-of-NNNNN`), the sizes add up to the
bundle exactly and everything is bounded (`MAX_BYTES`). The checkpoint's state file (which names the
latest checkpoint, a path) is never taken from a bundle: the receiver writes it (`state_file`).
"""

from __future__ import annotations

import json
import re
import struct
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StringConstraints, ValidationError

from .vocab import Reason

MAGIC = b"TFDIST-CKPT-1\n"
MAX_BYTES = 512 * 2**20  # one bundle, and all the kernel keeps of a job: the kernel's state dir is the user's
MAX_HEADER = 4 * 2**20  # the JSON header (a fit's epoch logs: 100,000 epochs of a few metrics fit)
MAX_FILES = 256  # a checkpoint's index plus its data shards
MAX_EPOCHS = 100_000
KEYS_MAX = 256
_LEN = struct.Struct(">I")
PROGRESS = "progress.json"  # tfdist.runtime.psrecovery's record of the fit next to the checkpoint
STATE_FILE = "checkpoint"  # TensorFlow's CheckpointManager reads the latest checkpoint's prefix from it
_NAME = re.compile(r"ckpt-(\d{1,19})\.(index|data-\d{5}-of-\d{5})")

Count = Annotated[StrictInt, Field(ge=0)]
Metric = Annotated[str, StringConstraints(strict=True, max_length=256)]


class CheckpointError(ValueError):
    """A bundle that is not one: its sentence says what is wrong; nothing of it is used."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Progress(_Record):
    """Where the fit was at the checkpoint (psrecovery's progress.json): the step, the epoch in progress
    (0-based) and the logs of the epochs finished before it, which the resumed fit's History starts with."""

    step: Count
    epoch: Count
    epoch_logs: Annotated[
        list[Annotated[dict[Metric, StrictFloat | StrictInt | None], Field(max_length=KEYS_MAX)]],
        Field(max_length=MAX_EPOCHS),
    ] = []


class FileEntry(_Record):
    name: Annotated[str, StringConstraints(strict=True, pattern=f"^{_NAME.pattern}$", max_length=64)]
    size: Annotated[StrictInt, Field(ge=0, le=MAX_BYTES)]
    sha256: Annotated[str, StringConstraints(strict=True, pattern=r"^[0-9a-f]{64}$")]


class Header(_Record):
    progress: Progress
    files: Annotated[list[FileEntry], Field(min_length=2, max_length=MAX_FILES)]


class CheckpointInfo(_Record):
    """The newest checkpoint a job's agent has (GET /checkpoint/latest): enough to decide whether to fetch
    it (newer than the one kept, within the kernel's bound)."""

    step: Count
    epoch: Count  # the epoch in progress when it was written (0-based)
    bytes: Annotated[StrictInt, Field(ge=0)]  # the bundle's size


class Resume(_Record):
    """A job started again from a kept checkpoint: what the cell, the events and the job's log say."""

    epoch: Count  # the epoch in progress at the checkpoint (0-based): training continues there
    step: Count
    reason: Reason = Reason.PREEMPTED

    def sentence(self) -> str:
        after = " after preemption" if self.reason == Reason.PREEMPTED else f" after {self.reason.sentence()}"
        return f"resumed from epoch {self.epoch + 1}{after} (the checkpoint at step {self.step})"


def prefix(step: int) -> str:
    """The checkpoint's name for `step` (CheckpointManager.save(checkpoint_number=step))."""
    return f"ckpt-{step}"


def files_of(step: int, names: list[str]) -> list[str]:
    """Of a checkpoint directory's names, the index and data shards of the checkpoint at `step`."""
    return sorted(n for n in names if (m := _NAME.fullmatch(n)) and int(m.group(1)) == step)


def encode_header(header: Header) -> bytes:
    """The bundle's leading bytes: magic, length, JSON header (the files follow in the header's order)."""
    body = header.model_dump_json().encode()
    if len(body) > MAX_HEADER:
        raise CheckpointError(f"the checkpoint's header is {len(body)} bytes, over {MAX_HEADER}")
    return MAGIC + _LEN.pack(len(body)) + body


def header_span(lead: bytes) -> int:
    """From the bundle's first len(MAGIC) + 4 bytes: the header's length (checked)."""
    if len(lead) < len(MAGIC) + _LEN.size or not lead.startswith(MAGIC):
        raise CheckpointError("not a tfdist checkpoint bundle (its first bytes are not the magic)")
    (n,) = _LEN.unpack_from(lead, len(MAGIC))
    if n > MAX_HEADER:
        raise CheckpointError(f"the checkpoint's header claims {n} bytes, over {MAX_HEADER}")
    return n


LEAD = len(MAGIC) + _LEN.size  # bytes before the JSON header


def decode_header(body: bytes, total: int) -> Header:
    """The JSON header of a bundle of `total` bytes, checked: names of one checkpoint (the progress's
    step), no name twice, an index among them, sizes that add up to the bundle exactly, within MAX_BYTES."""
    if total > MAX_BYTES:
        raise CheckpointError(f"the checkpoint is {total} bytes, over the {MAX_BYTES} bytes kept")
    try:
        header = Header.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "header"
        raise CheckpointError(f"the checkpoint's header is malformed at {where}: {first['msg']}") from None
    names = [f.name for f in header.files]
    step = header.progress.step
    if len(set(names)) != len(names):
        raise CheckpointError("the checkpoint names a file twice")
    if files_of(step, names) != sorted(names):
        raise CheckpointError(f"the checkpoint's files are not all of {prefix(step)} (its progress's step)")
    if f"{prefix(step)}.index" not in names:
        raise CheckpointError(f"the checkpoint has no {prefix(step)}.index")
    if LEAD + len(body) + sum(f.size for f in header.files) != total:
        raise CheckpointError("the checkpoint's file sizes do not add up to its length")
    return header


def info(header: Header, total: int) -> CheckpointInfo:
    return CheckpointInfo(step=header.progress.step, epoch=header.progress.epoch, bytes=total)


def state_file(step: int) -> str:
    """TensorFlow's checkpoint state file naming the restored checkpoint (relative: inside its directory)."""
    name = json.dumps(prefix(step))
    return f"model_checkpoint_path: {name}\nall_model_checkpoint_paths: {name}\n"
