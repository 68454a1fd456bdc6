"""The coordinator pod's checkpoint as one bundle (tfdist.job.checkpoint): packed for the kernel from the
job's checkpoint directory, unpacked there again in the readmitted job's pod before its fit starts.

Why files and not memory: a checkpoint is the model and its optimizer (hundreds of MB for a large model),
and the coordinator pod's memory is the job's --memory. Packing reads the files of the step that
psrecovery's progress.json names; the CheckpointManager keeps two, and writes progress.json after the
checkpoint's files, so those files are complete; one deleted meanwhile (two more saves) is a
CheckpointError, and the kernel asks again later.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile

from ..job import checkpoint as ck

CHUNK = 1 << 20


def _sha256(path: str) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def progress(ckpt_dir: str) -> ck.Progress | None:
    """The fit's progress at the newest checkpoint, or None (none written yet, or unreadable)."""
    try:
        with open(os.path.join(ckpt_dir, ck.PROGRESS), "rb") as f:
            return ck.Progress.model_validate_json(f.read(ck.MAX_HEADER + 1))
    except (OSError, ValueError):
        return None


def pack(ckpt_dir: str, dest: str) -> ck.CheckpointInfo:
    """Write the newest checkpoint of `ckpt_dir` to `dest` (atomically) and say what it holds."""
    prog = progress(ckpt_dir)
    if prog is None:
        raise ck.CheckpointError("no checkpoint has been written yet")
    try:
        names = ck.files_of(prog.step, os.listdir(ckpt_dir))
        entries = []
        for name in names:
            size, digest = _sha256(os.path.join(ckpt_dir, name))
            entries.append(ck.FileEntry(name=name, size=size, sha256=digest))
        lead = ck.encode_header(ck.Header(progress=prog, files=entries))
        total = len(lead) + sum(e.size for e in entries)
        if total > ck.MAX_BYTES:
            raise ck.CheckpointError(f"the checkpoint is {total} bytes, over the {ck.MAX_BYTES} bytes kept")
        tmp = f"{dest}.part"
        with open(tmp, "wb") as out:
            out.write(lead)
            for e in entries:
                with open(os.path.join(ckpt_dir, e.name), "rb") as f:
                    shutil.copyfileobj(f, out, CHUNK)
        if os.path.getsize(tmp) != total:  # a file changed under us (the manager rotated it)
            raise ck.CheckpointError(f"checkpoint {ck.prefix(prog.step)} changed while it was packed")
        os.replace(tmp, dest)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError):
            os.unlink(f"{dest}.part")
        if isinstance(exc, ck.CheckpointError):
            raise
        raise ck.CheckpointError(f"checkpoint {ck.prefix(prog.step)} could not be packed: {exc}") from None
    return ck.CheckpointInfo(step=prog.step, epoch=prog.epoch, bytes=total)


def read_header(path: str) -> ck.Header:
    """A bundle's checked header (its files not read)."""
    total = os.path.getsize(path)
    with open(path, "rb") as f:
        n = ck.header_span(f.read(ck.LEAD))
        return ck.decode_header(f.read(n), total)


def unpack(path: str, ckpt_dir: str) -> ck.Progress:
    """Check the bundle at `path` whole (header, every file's size and digest), then make it the newest
    checkpoint of `ckpt_dir` for psrecovery: its files, progress.json and the state file written here.
    A bad bundle raises CheckpointError and leaves `ckpt_dir` as it was."""
    header = read_header(path)
    parent = os.path.dirname(os.path.abspath(ckpt_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".ckpt-in-", dir=parent)
    try:
        with open(path, "rb") as f:
            f.seek(ck.LEAD + ck.header_span(f.read(ck.LEAD)))
            for e in header.files:
                h, left = hashlib.sha256(), e.size
                fd = os.open(os.path.join(staging, e.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as out:
                    while left:
                        chunk = f.read(min(CHUNK, left))
                        if not chunk:
                            raise ck.CheckpointError("the checkpoint ends before its files do")
                        h.update(chunk)
                        out.write(chunk)
                        left -= len(chunk)
                if h.hexdigest() != e.sha256:
                    raise ck.CheckpointError(f"{e.name} is not the file the checkpoint's header describes")
        step = header.progress.step
        with open(os.path.join(staging, ck.STATE_FILE), "w") as f:
            f.write(ck.state_file(step))
        with open(os.path.join(staging, ck.PROGRESS), "w") as f:
            f.write(header.progress.model_dump_json())
        if os.path.isdir(ckpt_dir):
            shutil.rmtree(ckpt_dir)
        os.replace(staging, ckpt_dir)
        return header.progress
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
