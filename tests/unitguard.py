"""The unit run: the test modules that start no process, and the guard that keeps them so.

`python -m pytest -m unit` (`scripts/test-unit`) runs the tests of `UNIT_MODULES` (tests/conftest.py marks
them `unit`) in well under a minute. While a unit test and its fixtures run, starting a process (subprocess,
asyncio, multiprocessing, os.system, posix_spawn), forking, listening on an IPv4/IPv6 socket or binding one
to a port raises `UnitRunRefusal`, and a test that caught it fails anyway: a module that needs a process
cannot stay in the list. Unix sockets and socketpairs stay allowed (in-process, no port to collide on).

A test of a listed module that needs one carries ``@pytest.mark.not_unit("why")`` and runs only in the
full suite.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Modules whose every test runs in this process: pure functions, records, parsers, manifests, the
# settings, in-process servers on Unix sockets. Checked: each passes under the guard.
UNIT_MODULES = frozenset(
    {
        "test_advisor",
        "test_submit_checks",
        "test_advisor_choice",
        "test_agent_log",
        "test_build_images_cache",
        "test_data_volumes",
        "test_fitcheck",
        "test_gpu_activity",
        "test_gpu_admin_page",
        "test_gpu_admin_report",
        "test_history",
        "test_import_direction",
        "test_job_detach",
        "test_lifeline_renewal",
        "test_job_reasons",
        "test_job_vocab",
        "test_jobrecords",
        "test_jobspec",
        "test_kube_allreduce",
        "test_kueue_queueing",
        "test_memfit",
        "test_nvml_mig",
        "test_outcome",
        "test_podfold",
        "test_quantity",
        "test_queuepace",
        "test_restart_policy",
        "test_settings_reference",
        "test_spawner_availability",
        "test_spawner_kube",
        "test_spawner_profiles",
        "test_spawner_validation",
        "test_stall",
        "test_strategy_spec",
        "test_taskenv",
        "test_tasklog",
    }
)

_REFUSED = pytest.StashKey[list[str]]()
_INET = (socket.AF_INET, socket.AF_INET6)


class UnitRunRefusal(RuntimeError):
    """A unit test tried to start a process, fork or open a network listener."""


def unit_paths() -> list[str]:
    """The unit modules' files, relative to the checkout (scripts/test-unit collects only these)."""
    here = Path(__file__).parent
    return [f"tests/{m}.py" for m in sorted(UNIT_MODULES) if (here / f"{m}.py").is_file()]


def is_unit(node: pytest.Item | pytest.Collector) -> bool:
    return node.get_closest_marker("unit") is not None


def refusals(item: pytest.Item) -> list[str]:
    """What the guard refused `item` since the last call (each refusal fails one report)."""
    found = item.stash.get(_REFUSED, [])
    item.stash[_REFUSED] = []
    return found


@contextlib.contextmanager
def install_unit_guard(item: pytest.Item) -> Iterator[None]:
    """Refuse process starts, forks and network listeners while `item` (setup, call, teardown) runs."""
    item.stash[_REFUSED] = []

    def refuse(what: str) -> UnitRunRefusal:
        item.stash[_REFUSED].append(what)
        return UnitRunRefusal(
            f"a unit test {what}: move its module out of UNIT_MODULES (tests/unitguard.py), or mark the "
            'test @pytest.mark.not_unit("why")'
        )

    def refusing(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise refuse(what)

        return refused

    real_bind, real_listen = socket.socket.bind, socket.socket.listen

    def bind(sock: socket.socket, address: Any) -> None:
        # port 0 is no claim on a port: libraries probe for IPv6 that way at import, free_port() asks for one
        if sock.family in _INET and address[1] != 0:
            raise refuse(f"bound a network socket to {address!r}")
        real_bind(sock, address)

    def listen(sock: socket.socket, *backlog: int) -> None:
        if sock.family in _INET:
            raise refuse("listened on a network socket")
        real_listen(sock, *backlog)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", refusing("started a process"))  # also asyncio's
        mp.setattr(_posixsubprocess, "fork_exec", refusing("started a process"))  # multiprocessing
        for name in ("posix_spawn", "posix_spawnp", "system"):
            mp.setattr(os, name, refusing(f"started a process (os.{name})"))
        for name in ("fork", "forkpty"):
            mp.setattr(os, name, refusing(f"forked (os.{name})"))
        mp.setattr(socket.socket, "bind", bind)
        mp.setattr(socket.socket, "listen", listen)
        yield


# ---- the hooks (tests/conftest.py imports them) ------------------------------------------------------------


@contextlib.contextmanager
def _guarded(item: pytest.Item, on: bool = True) -> Iterator[None]:
    if on and is_unit(item):
        with install_unit_guard(item):
            yield
    else:
        yield


# A unit test's setup, call and teardown (its fixtures, module-scoped ones included) run with process
# starts, forks and network listeners refused; not the last test's teardown on a worker, where pytest also
# ends the session's fixtures of other modules (a cluster the real-node tests brought up).


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _guarded(item, on=nextitem is not None):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    refused = refusals(item) if is_unit(item) else []
    if refused and not report.failed:  # the test caught the refusal and went on: it still fails
        report.outcome = "failed"
        report.longrepr = "the unit run refused: " + "; ".join(refused)
