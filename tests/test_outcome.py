"""One reading of how a coordinator ended, shared by the local supervisor and the coordinator pod."""

from __future__ import annotations

import json
from pathlib import Path

from tfdist.runtime.outcome import coordinator_outcome


def test_success_needs_both_exit_zero_and_results(tmp_path: Path) -> None:
    assert coordinator_outcome(str(tmp_path), 0).state == "failed"  # exit 0 without results is no success
    (tmp_path / "result.bin").write_bytes(b"x")
    assert coordinator_outcome(str(tmp_path), 0).state == "succeeded"


def test_the_cells_error_is_the_message(tmp_path: Path) -> None:
    err = {"type": "ValueError", "message": "bad shape " + "x" * 500, "traceback": "tb"}
    (tmp_path / "error.json").write_text(json.dumps(err))
    out = coordinator_outcome(str(tmp_path), 1)
    assert out.state == "failed" and out.message.startswith("ValueError: bad shape")
    assert len(out.message) <= 320 and out.error == err


def test_a_death_without_a_word_is_said_by_the_caller(tmp_path: Path) -> None:
    (tmp_path / "error.json").write_text("{truncated")
    out = coordinator_outcome(str(tmp_path), -9, "was killed (SIGKILL: most often the server's memory limit)")
    assert out.message == "the coordinator was killed (SIGKILL: most often the server's memory limit)"
    assert out.error and out.error["type"] == "CoordinatorExit"
    assert coordinator_outcome(str(tmp_path), 3).message == "the coordinator exited with code 3"


def test_a_local_allreduce_chief_that_lost_a_peer_names_it(tmp_path):
    """The local supervisor's environment names no strategy: the job's does (the raw TF error was shown)."""
    err = {
        "type": "UnavailableError",
        "message": "Graph execution error: Collective ops is aborted by: recvmsg:Connection reset by peer\n"
        "Additional GRPC error information from remote target /job:worker/replica:0/task:0",
        "traceback": "",
    }
    (tmp_path / "error.json").write_text(json.dumps(err))
    out = coordinator_outcome(str(tmp_path), 1, strategy="allreduce")
    assert out.message.startswith("WorkerLost: all-reduce worker worker-0 stopped"), out.message
