"""The module paths job images run stay, as the job protocol's own objects: a newer kernel's job package
moved them to `tfdist.job`, and an image's entry points (and plug-ins written against them) still import
`tfdist.events`, `tfdist.runtime.events`, `tfdist.kube.signing` and `tfdist.jobview`."""

from __future__ import annotations

import json

import tfdist.events
import tfdist.jobview
import tfdist.kube.signing
import tfdist.runtime.events
from tfdist.job import events, signing, view


def test_the_old_paths_are_the_protocols_own_objects() -> None:
    for name in ("StateEvent", "TaskEvent", "SnapshotEvent", "QueueEvent", "parse", "to_wire", "EventError"):
        assert getattr(tfdist.events, name) is getattr(events, name), name
    for name in ("dumps", "loads", "clean_number"):
        assert getattr(tfdist.runtime.events, name) is getattr(events, name), name
    assert tfdist.runtime.events.is_noise("W0000 00:00:1.0 12 cpu_feature_guard.cc:1] x")
    for name in ("sign_request", "verify_request", "sign_response", "verify_response", "ReplayCache"):
        assert getattr(tfdist.kube.signing, name) is getattr(signing, name), name
    assert tfdist.jobview.JobView is view.JobView and tfdist.jobview.Reason is view.Reason


def test_the_wire_line_is_what_older_readers_read() -> None:
    """One JSON object per line, enums as their strings, unset fields left off (as the dict producers
    wrote them): an older image's reader sees the same bytes."""
    line = events.encode(events.StateEvent(state="failed", reason="task-failed", t=1.0))
    assert line == b'{"type":"state","state":"failed","t":1.0,"reason":"task-failed"}\n'
    assert json.loads(line) == tfdist.runtime.events.loads(line)
    assert events.decode(line) == events.StateEvent(state="failed", reason="task-failed", t=1.0)
