"""Task output of any shape: long lines, carriage-return progress bars, floods (tfdist.runtime.tasklog)."""

from __future__ import annotations

from pathlib import Path

from tfdist.runtime.tasklog import LineSplitter, RollingLog


def test_lines_end_at_newline_or_carriage_return_across_chunks() -> None:
    s = LineSplitter()
    assert s.feed(b"epoch 1\nstep 1/3\rstep 2") == ["epoch 1", "step 1/3"]
    assert s.feed(b"/3\rstep 3/3\r\ndone") == ["step 2/3", "step 3/3"]
    assert s.flush() == ["done"]


def test_a_megabyte_line_is_cut_once_and_what_follows_is_kept() -> None:
    s = LineSplitter(max_line=100)
    out: list[str] = []
    for _ in range(16):
        out += s.feed(b"x" * 65536)  # one 1 MiB line without a newline, in pipe-sized chunks
    out += s.feed(b"x" * 10 + b"\nnext line\n")
    assert len(out) == 2
    assert out[0].startswith("x" * 100) and out[0].endswith("[...]") and len(out[0]) <= 106
    assert out[1] == "next line"


def test_undecodable_bytes_do_not_stop_the_reader() -> None:
    assert LineSplitter().feed(b"\xff\xfe bad\n") == ["\ufffd\ufffd bad"]


def test_the_file_rolls_over_and_stays_bounded(tmp_path: Path) -> None:
    log = RollingLog(str(tmp_path / "worker-0.log"), max_bytes=1000)
    for i in range(100):
        log.write(f"{i:04d}".encode() * 10 + b"\n")
    log.close()
    cur, old = tmp_path / "worker-0.log", tmp_path / "worker-0.log.1"
    assert cur.stat().st_size <= 1000 and old.stat().st_size <= 1000
    assert cur.read_text().rstrip().endswith("0099" * 10)  # the newest output is in the current file


async def test_log_tails_read_only_the_end_of_big_files(tmp_path: Path) -> None:
    """The lab panel polls at 1 Hz: it reads the last lines of each task's log, not whole files."""
    from tfdist.backends.local import LocalBackend
    from tfdist.jobspec import JobSpec

    d = tmp_path / "jobs" / "big"
    (d / "logs").mkdir(parents=True)
    (d / "spec.json").write_text(JobSpec(name="big", user="me").to_json())
    with open(d / "logs" / "worker-0.log", "w") as f:
        for i in range(300_000):  # ~ 5 MB
            f.write(f"line {i}\n")
    (d / "logs" / "worker-0.log.1").write_text("rolled over\n")
    backend = LocalBackend(str(tmp_path / "jobs"))
    tails = await backend.logs("big", tail=3)
    assert tails == {"worker-0": "line 299997\nline 299998\nline 299999\n"}
    whole = await backend.logs("big", "worker-0")
    assert whole["worker-0"].count("\n") == 300_000
