"""Things that live as long as their xdist group on this worker, not as long as the session.

The kwok plane and the Kueue plane serve one group (`kwok`, tests/conftest.py), which a worker runs in one
stretch; kept until the session's end, their API servers, etcd, controllers and Kueue kept ~0.15 of a
core busy through the rest of the run (measured during a CI run: the Kueue plane's API server alone
spent 33 s of CPU in the 8 min after its last test). A fixture registers how to stop what it started
(`at_group_end`); the hook below runs it after the group's last test here, and the session's own
teardown stops it again, which is then a no-op.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

GROUP = pytest.StashKey[str]()  # each test's group, set by tests/conftest.py
_closers: dict[str, list[Callable[[], None]]] = {}
_current: list[pytest.Item] = []  # the test being set up (fixtures of any scope are made then)
_while: list[tuple[Callable[[pytest.Item], bool], Callable[[], None]]] = []


def at_group_end(close: Callable[[], None]) -> None:
    """Run `close` once the group of the test being set up is over on this worker. Outside a test (or in
    a run without groups) nothing is registered: the session's end does it."""
    group = _current[0].stash.get(GROUP, None) if _current else None
    if group is not None:
        _closers.setdefault(group, []).append(close)


def while_next(keep: Callable[[pytest.Item], bool], close: Callable[[], None]) -> None:
    """Run `close` after the first test whose next test is not one `keep` says still needs it (or after
    the last test): for what serves a few adjacent modules, kept across them and stopped after them."""
    _while.append((keep, close))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    _current[:] = [item]
    try:
        yield
    finally:
        _current.clear()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # after the test's own teardown (trylast): its module's fixtures are gone by now
    try:
        for entry in list(_while):
            if nextitem is None or not entry[0](nextitem):
                _while.remove(entry)
                entry[1]()
    finally:
        group = item.stash.get(GROUP, None)
        if group is not None and (nextitem is None or nextitem.stash.get(GROUP, None) != group):
            for close in reversed(_closers.pop(group, [])):
                close()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """A run cut short between tests (Ctrl-C, pytest.exit) still closes what `while_next` kept."""
    while _while:
        _keep, close = _while.pop()
        try:
            close()
        except Exception as exc:  # the session is ending: say it, stop the others too
            print(f"groupend: closing failed: {exc!r}")
