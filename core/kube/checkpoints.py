"""The kernel's copy of a queued `--checkpoint-every` job's newest checkpoint (issue 25): Kueue may evict the
job whole, and its checkpoints lived in the coordinator pod.

While such a job runs, `follow` asks the job's agent for its newest checkpoint every POLL_S seconds and
fetches it when it is newer than the one kept (signed by the agent, streamed to a 0600 file in the user's
state directory, at most tfdist.job.checkpoint.MAX_BYTES = 512 MiB: a bigger one is not kept, and the job
would start over). One file per job (the newest replaces the last); its name carries the payload's digest,
so only the same cell's resubmission ever reads it. When the kernel submits the preempted job again
(tfdist.backends.kubewatch), the kept file becomes the job's hand-back (`prepare_resume`), which the
delivery sends to the new coordinator before the payload (`hand_back`), and the job's end drops both
(`drop`). Only this kernel holds the job's token, so only it can fetch the checkpoint from the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import logging
import os
import time

from ..errors import TfdistError
from ..job import checkpoint as ck
from .agent_client import AgentClient, AgentForged
from .transport import AGENT_GRACE_S

POLL_S = 5.0
log = logging.getLogger(__name__)


def payload_digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:16]


def kept_path(state_dir: str, namespace: str, name: str, digest: str) -> str:
    """The newest checkpoint kept of job `name` run from the payload of `digest`."""
    return os.path.join(state_dir, "kubernetes", namespace, f"{name}.{digest}.ckpt")


def resume_path(kept: str) -> str:
    """The checkpoint a resubmitted job's delivery hands back (set aside by `prepare_resume`)."""
    return kept.removesuffix(".ckpt") + ".resume"


def drop(state_dir: str, namespace: str, name: str) -> None:
    """The job ended: nothing of its checkpoints stays in the state directory."""
    base = os.path.join(glob.escape(os.path.join(state_dir, "kubernetes", namespace)), glob.escape(name))
    for path in glob.glob(base + ".*.ckpt*") + glob.glob(base + ".*.resume"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def info(path: str) -> ck.CheckpointInfo | None:
    """What a kept bundle holds (its header checked), or None (none, or not a bundle)."""
    try:
        total = os.path.getsize(path)
        with open(path, "rb") as f:
            n = ck.header_span(f.read(ck.LEAD))
            return ck.info(ck.decode_header(f.read(n), total), total)
    except (OSError, ck.CheckpointError):
        return None


def prepare_resume(kept: str) -> ck.Resume | None:
    """Before the preempted job is submitted again: its kept checkpoint becomes the one handed back (or
    stays it: a run preempted again before its coordinator got it)."""
    got = info(kept)
    if got is not None:
        os.replace(kept, resume_path(kept))
    elif (got := info(resume_path(kept))) is None:
        return None
    return ck.Resume(epoch=got.epoch, step=got.step)


def resuming(kept: str) -> bool:
    """As a job's delivery starts: does a checkpoint wait to be handed back (a preempted job's new run)?
    If not, this is a first submission, and a copy an earlier run of the same cell left is dropped."""
    if os.path.exists(resume_path(kept)):
        return True
    with contextlib.suppress(OSError):
        os.unlink(kept)
    return False


async def hand_back(client: AgentClient, kept: str, created: float, timeout_s: float) -> ck.Resume | None:
    """A readmitted job's checkpoint (`prepare_resume`) to its new coordinator, before the payload (None:
    the agent was never reached; the payload's delivery says why). The copy stays the job's newest until
    its new run writes a newer one."""
    back = resume_path(kept)
    while not await client.reachable():
        if time.time() > created + timeout_s + AGENT_GRACE_S:
            return None  # the payload's delivery says why the agent was not reached
        await asyncio.sleep(0.5)
    with open(back, "rb") as f:
        bundle = f.read(ck.MAX_BYTES + 1)
    resumed = await client.hand_back_checkpoint(bundle)
    os.replace(back, kept)
    return resumed


async def follow(client: AgentClient, kept: str, every_s: float = POLL_S) -> None:
    """Keep the job's newest checkpoint while it runs (cancelled with the job's other background work).
    The agent reports only its newest, so any other than the one kept is newer (a resumed fit's step
    counter starts again: steps are not compared)."""
    have = info(kept)
    said_big = False
    os.makedirs(os.path.dirname(kept), mode=0o700, exist_ok=True)
    while True:
        await asyncio.sleep(every_s)
        try:
            latest = await client.latest_checkpoint()
            if latest is None or (
                have is not None and (latest.step, latest.epoch) == (have.step, have.epoch)
            ):
                continue
            if latest.bytes > ck.MAX_BYTES:
                if not said_big:
                    said_big = True
                    log.warning("checkpoint %d bytes is over the %d kept", latest.bytes, ck.MAX_BYTES)
                continue
            if await client.fetch_checkpoint(kept + ".part-in", ck.MAX_BYTES):
                got = info(kept + ".part-in")
                if got is not None:
                    os.replace(kept + ".part-in", kept)
                    have = got
        except asyncio.CancelledError:
            raise
        except AgentForged:
            return  # not the job's agent: nothing from it is kept
        except (TfdistError, OSError, ValueError) as exc:
            log.debug("checkpoint not fetched this time: %s", exc)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(kept + ".part-in")
