"""Processes named by PID and start time: what makes a record name one process, and only that one."""

from __future__ import annotations

import json
import os
import subprocess
import time

from tfdist.procid import ProcessId, boot_id, start_time


def test_a_process_is_named_by_its_start_since_boot_not_by_the_wall_clock() -> None:
    me = ProcessId.current()
    ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
    assert me.started == ticks / os.sysconf("SC_CLK_TCK")
    assert me.boot == boot_id() != ""
    # psutil's create_time adds /proc/stat's btime, which a clock step or slew moves; this one never moves
    assert ProcessId.loads(me.dumps()) == me and ProcessId.loads(me.dumps()).alive()


def test_records_of_another_process_another_boot_or_an_older_format_name_nothing_alive() -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        ident = ProcessId.of(sleeper.pid)
        assert ident is not None and ident.alive()
        assert not ProcessId(sleeper.pid, ident.started - 1).alive()  # an earlier process with this PID
        assert not ProcessId(sleeper.pid, ident.started, "another-boot").alive()
        assert ProcessId.loads(json.dumps({"pid": sleeper.pid, "started": ident.started})) is None
        assert ProcessId.loads(str(sleeper.pid)) is None
    finally:
        sleeper.kill()
    time.sleep(0.2)
    assert start_time(sleeper.pid) is None  # a zombie is not alive
    assert not ident.alive() and ident.signal() is False
    sleeper.wait()
