"""A preempted job's checkpoint out of the coordinator pod and back (issue 25), without TensorFlow: the
bundle's checks (tfdist.job.checkpoint, tfdist.runtime.ckptbundle), the agent's checkpoint endpoints
served for real (tfdist.runtime.agent) with the notebook's client, and the kernel's keeper
(tfdist.kube.checkpoints). The files are stand-ins for TensorFlow's (the bundle never reads inside them);
tests/test_pod_runtime_preempt_resume.py restores a real one."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

import pytest

from tests.test_pod_runtime import local_pods
from tfdist.job import checkpoint as ck
from tfdist.job.vocab import Reason
from tfdist.kube import checkpoints, preemption
from tfdist.kube.agent_client import AgentClient, AgentForged
from tfdist.runtime import ckptbundle
from tfdist.runtime.agent import AgentState, serve

LOGS = [{"loss": 2.1, "accuracy": 0.3}, {"loss": 1.4, "accuracy": 0.6}]


def write_checkpoint(d, step: int, epoch: int = 2, data: bytes = b"weights" * 100) -> None:
    """What psrecovery leaves after a save: the step's index and data shard, then progress.json."""
    os.makedirs(d, exist_ok=True)
    (d / f"ckpt-{step}.index").write_bytes(b"index-of-%d" % step)
    (d / f"ckpt-{step}.data-00000-of-00001").write_bytes(data)
    (d / "checkpoint").write_text(f'model_checkpoint_path: "ckpt-{step}"\n')
    (d / "progress.json").write_text(json.dumps({"step": step, "epoch": epoch, "epoch_logs": LOGS[:epoch]}))


def forged(header: dict, files: list[tuple[str, bytes]]) -> bytes:
    """A bundle written by hand: what a hostile sender could send (header unchecked)."""
    body = json.dumps(header).encode()
    return ck.MAGIC + len(body).to_bytes(4, "big") + body + b"".join(data for _, data in files)


def entry(name: str, data: bytes) -> dict:
    return {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_packed_checkpoint_unpacks_as_the_newest_with_its_progress(tmp_path):
    src = tmp_path / "pod-a" / "ckpt"
    write_checkpoint(src, 7)
    write_checkpoint(src, 12)  # the manager keeps two; progress.json names the newest
    got = ckptbundle.pack(str(src), str(tmp_path / "b.bin"))
    assert (got.step, got.epoch) == (12, 2) and got.bytes == os.path.getsize(tmp_path / "b.bin")
    dest = tmp_path / "pod-b" / "ckpt"
    prog = ckptbundle.unpack(str(tmp_path / "b.bin"), str(dest))
    assert (prog.step, prog.epoch, prog.epoch_logs) == (12, 2, LOGS)
    assert sorted(os.listdir(dest)) == [
        "checkpoint",
        "ckpt-12.data-00000-of-00001",
        "ckpt-12.index",
        "progress.json",
    ]
    assert (dest / "ckpt-12.data-00000-of-00001").read_bytes() == b"weights" * 100
    assert (dest / "checkpoint").read_text() == ck.state_file(12)  # written here, relative
    assert json.loads((dest / "progress.json").read_text()) == {"step": 12, "epoch": 2, "epoch_logs": LOGS}


def test_nothing_to_pack_before_the_first_checkpoint(tmp_path):
    with pytest.raises(ck.CheckpointError, match="no checkpoint has been written yet"):
        ckptbundle.pack(str(tmp_path / "ckpt"), str(tmp_path / "b.bin"))
    assert not (tmp_path / "b.bin").exists()


PROG = {"step": 5, "epoch": 1, "epoch_logs": [{"loss": 1.0}]}
IDX, DATA = b"idx", b"data"
GOOD = [("ckpt-5.index", IDX), ("ckpt-5.data-00000-of-00001", DATA)]


def files_of(*entries: dict, progress: dict = PROG, body: list = GOOD) -> bytes:
    return forged({"progress": progress, "files": list(entries)}, body)


IDX_E, DATA_E = entry(*GOOD[0]), entry(*GOOD[1])
HOSTILE = {
    "pickle": (b"\x80\x04\x95pickle" + b"\0" * 40, "not a tfdist checkpoint bundle"),
    "huge-header": (ck.MAGIC + (10 * 2**20).to_bytes(4, "big"), "header claims"),
    "not-json": (ck.MAGIC + (3).to_bytes(4, "big") + b"{x}", "malformed"),
    "traversal": (files_of(entry("../../etc/x", IDX), DATA_E), "files.0"),
    "state-file": (files_of(entry("checkpoint", IDX), DATA_E), "files.0"),
    "absolute": (files_of(entry("/abs/ckpt-5.index", IDX), DATA_E), "files.0"),
    "other-step": (files_of(entry("ckpt-4.index", IDX), DATA_E), "not all of"),
    "twice": (files_of(DATA_E, DATA_E), "twice"),
    "short": (files_of(IDX_E, DATA_E, body=GOOD[:1]), "add up"),
    "trailing": (files_of(IDX_E, DATA_E, body=[*GOOD, ("", b"x")]), "add up"),
    "digest": (files_of(IDX_E, entry("ckpt-5.data-00000-of-00001", b"dat4")), "is not the file"),
    "negative-epoch": (files_of(IDX_E, DATA_E, progress={**PROG, "epoch": -1}), "progress.epoch"),
    "extra-key": (files_of(IDX_E, DATA_E, progress={**PROG, "code": "x"}), "progress.code"),
}


@pytest.mark.parametrize(("blob", "said"), list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_bundle_that_is_not_a_checkpoint_is_refused_and_changes_nothing(tmp_path, blob, said):
    dest = tmp_path / "ckpt"
    write_checkpoint(dest, 3)
    before = {n: (dest / n).read_bytes() for n in os.listdir(dest)}
    (tmp_path / "in.bin").write_bytes(blob)
    with pytest.raises(ck.CheckpointError, match=said):
        ckptbundle.unpack(str(tmp_path / "in.bin"), str(dest))
    assert {n: (dest / n).read_bytes() for n in os.listdir(dest)} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "in.bin"]  # no staging left behind
    assert not (tmp_path.parent / "etc").exists()


def test_a_bundle_over_the_bound_is_refused_before_it_is_read():
    body = ck.Header(progress=ck.Progress(**PROG), files=[ck.FileEntry(**entry(*g)) for g in GOOD])
    with pytest.raises(ck.CheckpointError, match="over the 536870912 bytes kept"):
        ck.decode_header(body.model_dump_json().encode(), ck.MAX_BYTES + 1)


def test_the_resume_and_the_requeued_cell_say_the_epoch():
    resume = ck.Resume(epoch=3, step=120)
    assert resume.reason == Reason.PREEMPTED
    assert resume.sentence() == "resumed from epoch 4 after preemption (the checkpoint at step 120)"
    said = "preempted by Kueue to give queue qb its quota back"
    assert preemption.requeued(said, "qa", 50, resume) == (
        f"{said}; waiting in queue qa again, it resumes from epoch 4 (the checkpoint at step 120) "
        "when admitted"
    )
    assert preemption.requeued(said, "qa", 50).endswith(
        "starts from the beginning when admitted (no checkpoint had reached the notebook yet)"
    )
    assert preemption.requeued(said, "qa", None).endswith(
        "starts from the beginning when admitted (without --checkpoint-every)"
    )


@pytest.fixture
def agent(tmp_path):
    _, _, port, token = local_pods(1, 1)
    state = AgentState(str(tmp_path / "job"), token)
    os.makedirs(state.jobdir)
    srv = serve(state, port, "127.0.0.1")
    yield state, f"http://127.0.0.1:{port}", token
    srv.shutdown()


def test_the_agent_serves_its_newest_checkpoint_to_the_jobs_token_only(agent, tmp_path):
    _, url, token = agent

    async def go():
        client, other = (
            AgentClient(url, token, retry_for=5),
            AgentClient(url, "another-users-token", retry_for=5),
        )
        try:
            assert await client.latest_checkpoint() is None  # none written yet
            write_checkpoint(tmp_path / "job" / "ckpt", 40, epoch=1)
            got = await client.latest_checkpoint()
            assert (got.step, got.epoch) == (40, 1) and got.bytes > 700
            assert await client.fetch_checkpoint(str(tmp_path / "kept.bin"))
            assert os.path.getsize(tmp_path / "kept.bin") == got.bytes
            assert os.stat(tmp_path / "kept.bin").st_mode & 0o077 == 0
            with pytest.raises(AgentForged, match="refused the job's signature"):
                await other.latest_checkpoint()
            with pytest.raises(AgentForged):
                await other.fetch_checkpoint(str(tmp_path / "stolen.bin"))
            assert not (tmp_path / "stolen.bin").exists()
            # a smaller bound than the bundle: nothing is kept
            with pytest.raises(Exception, match="over 10"):
                await client.fetch_checkpoint(str(tmp_path / "small.bin"), max_bytes=10)
            assert not os.path.exists(tmp_path / "small.bin") and not os.path.exists(
                tmp_path / "small.bin.part"
            )
        finally:
            await client.close()
            await other.close()

    asyncio.run(go())


def test_a_checkpoint_handed_back_before_the_payload_becomes_the_coordinators(agent, tmp_path):
    state, url, token = agent
    write_checkpoint(tmp_path / "evicted", 40, epoch=1)
    ckptbundle.pack(str(tmp_path / "evicted"), str(tmp_path / "b.bin"))
    bundle = (tmp_path / "b.bin").read_bytes()

    async def go():
        client = AgentClient(url, token, retry_for=5)
        try:
            bad = forged({"progress": PROG, "files": [entry("../x", IDX), entry(*GOOD[1])]}, GOOD)
            status, data = await client.request("PUT", "/checkpoint", bad)
            assert status == 400 and b"not a checkpoint" in data
            assert not os.path.exists(state.ckpt_dir) and state.resumed is None
            resumed = await client.hand_back_checkpoint(bundle)
            assert resumed == ck.Resume(epoch=1, step=40) == state.resumed
            assert json.loads((tmp_path / "job" / "ckpt" / "progress.json").read_text())["step"] == 40
            _, evs = state.log.read(0, 0)
            lines = [line for e in evs if e["type"] == "log" for _, line in e["lines"]]
            assert lines == ["tfdist: resumed from epoch 2 after preemption (the checkpoint at step 40)"]
            assert [e["epoch"] for e in evs if e["type"] == "progress"] == [1]
            await client.upload(b"the cell")
            status, data = await client.request("PUT", "/checkpoint", bundle)  # the fit may have started
            assert status == 409 and b"payload came first" in data
        finally:
            await client.close()

    asyncio.run(go())


def test_the_kernel_keeps_the_newest_checkpoint_and_hands_it_back_once_resubmitted(agent, tmp_path):
    state, url, token = agent
    kept = checkpoints.kept_path(str(tmp_path / "state"), "ns", "job1", checkpoints.payload_digest(b"p"))
    (tmp_path / "state" / "kubernetes" / "ns").mkdir(parents=True)
    (tmp_path / "state" / "kubernetes" / "ns" / "job1.json").write_text("{}")  # the detach record: stays
    ckpt = tmp_path / "job" / "ckpt"

    async def go():
        client = AgentClient(url, token, retry_for=5)
        try:
            follow = asyncio.ensure_future(checkpoints.follow(client, kept, every_s=0.05))
            write_checkpoint(ckpt, 10, epoch=0)
            for step in (25, 60):
                await asyncio.sleep(0.5)
                write_checkpoint(ckpt, step, epoch=step // 25)
            for _ in range(100):
                if (got := checkpoints.info(kept)) is not None and got.step == 60:
                    break
                await asyncio.sleep(0.05)
            follow.cancel()
            assert (got.step, got.epoch) == (60, 2)
            # preempted: the kept checkpoint becomes the hand-back, which the new run's delivery sends
            assert checkpoints.prepare_resume(kept) == ck.Resume(epoch=2, step=60)
            assert not os.path.exists(kept)
            assert checkpoints.prepare_resume(kept) == ck.Resume(epoch=2, step=60)  # preempted again
            import shutil

            shutil.rmtree(ckpt)
            back = await checkpoints.hand_back(client, kept, 0, 10**9)
            assert back == ck.Resume(epoch=2, step=60) and state.resumed == back
            assert checkpoints.info(kept).step == 60  # still the newest until the new run writes one
        finally:
            await client.close()

    asyncio.run(go())
    checkpoints.drop(str(tmp_path / "state"), "ns", "job1")
    assert os.listdir(tmp_path / "state" / "kubernetes" / "ns") == ["job1.json"]


def test_a_first_submission_hands_nothing_back_and_drops_a_stale_copy(tmp_path):
    kept = checkpoints.kept_path(str(tmp_path), "ns", "job1", "d")
    os.makedirs(os.path.dirname(kept))
    open(kept, "wb").close()

    assert not checkpoints.resuming(kept) and not os.path.exists(kept)
    open(kept, "wb").close()
    os.replace(kept, checkpoints.resume_path(kept))  # what prepare_resume leaves for the new run
    assert checkpoints.resuming(kept) and os.path.exists(checkpoints.resume_path(kept))


def test_a_preempted_job_waiting_again_is_said_so_in_the_view_the_list_and_after_a_snapshot():
    from tfdist.job.events import QueueEvent, StateEvent
    from tfdist.job.view import JobView
    from tfdist.job.vocab import JobState
    from tfdist.jobrecords import JobSummary
    from tfdist.kernel_magics.jobcmds import list_row

    view = JobView(name="big", backend="kubernetes", state=JobState.RUNNING)
    said = preemption.requeued("preempted by Kueue", "qa", 50, ck.Resume(epoch=2, step=90))
    view.apply(StateEvent(state=JobState.PENDING, reason=Reason.PREEMPTED, message=said))
    assert view.state_word == "preempted, waiting to be readmitted" and not view.finished
    view.apply(QueueEvent(position=2, queue="qa"))  # its place in line: still said preempted, not "queued"
    view.apply(StateEvent(state=JobState.STARTING))
    assert view.state_word == "preempted, waiting to be readmitted"
    again = JobView.from_dict(view.to_dict())  # another process's copy (a snapshot, the lab server)
    assert again.state_word == "preempted, waiting to be readmitted"
    row = list_row(JobSummary.model_validate(view.summary()))
    assert "preempted, waiting to be readmitted" in row and "queued" not in row.split("queued:")[0]
    view.apply(StateEvent(state=JobState.RUNNING))  # readmitted
    assert view.state_word == "running" and view.reason == ""
    view.apply(StateEvent(state=JobState.SUCCEEDED))
    assert view.reason == Reason.FINISHED


def test_another_server_reads_a_resubmitted_root_job_as_preempted_until_it_runs():
    from tfdist.kube import status

    marked = {"metadata": {"name": "big", "annotations": {preemption.A_RESUBMITTED: ""}}, "status": {}}
    plain = {"metadata": {"name": "big"}, "status": {}}
    chief = {
        "metadata": {"name": "big-0", "labels": {"tfdist.io/task": "chief-0"}},
        "status": {"phase": "Pending"},
    }
    assert status.view("big", None, [chief], marked, 0.0).state_word == "preempted, waiting to be readmitted"
    assert status.view("big", None, [chief], plain, 0.0).state_word == "starting"
    running = {
        **chief,
        "status": {"phase": "Running", "containerStatuses": [{"ready": True, "state": {"running": {}}}]},
    }
    v = status.view("big", None, [running], marked, 0.0)
    assert v.state_word == "running" and v.reason == ""
