"""The unit run's guard (tests/unitguard.py): in a test marked `unit`, starting a process, forking or
listening on a network port fails the test, even when the test catches the refusal; other tests may."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

INNER = """
import asyncio, os, socket, subprocess, sys
import pytest

unit = pytest.mark.unit

@unit
def test_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@unit
def test_caught():
    try:
        subprocess.run(["true"])
    except Exception:
        pass

@unit
def test_fork():
    if os.fork() == 0:
        os._exit(0)

@unit
def test_asyncio_subprocess():
    async def main():
        await asyncio.create_subprocess_exec("true")
    asyncio.run(main())

@unit
def test_listen():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()

@unit
def test_bind_a_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 45931))

@pytest.fixture(scope="module")
def server():
    subprocess.run(["true"])

@unit
def test_module_fixture(server):
    pass

@unit
def test_pure():
    path = f"/tmp/unitguard-{os.getpid()}"  # short: AF_UNIX's 107 bytes
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        s.listen()
    os.unlink(path)
    a, b = socket.socketpair()
    a.close(), b.close()

def test_not_unit():
    subprocess.run(["true"], check=True)

@pytest.fixture(scope="session")
def cluster():
    yield
    subprocess.run(["true"], check=True)  # ends in the last test's teardown, whichever test that is

def test_uses_the_cluster(cluster):
    pass

@unit
def test_last_unit():
    pass
"""


def test_the_guard_fails_every_way_out_of_the_process(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("pytest_plugins = ['tests.unitguard']")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-q")
    outcomes = {
        r.nodeid.split("::")[-1]: r.outcome
        for r in result.reprec.getreports("pytest_runtest_logreport")
        if r.when == "call" or r.failed
    }
    failed = {name for name, outcome in outcomes.items() if outcome == "failed"}
    assert failed == {
        "test_subprocess",
        "test_caught",
        "test_fork",
        "test_asyncio_subprocess",
        "test_listen",
        "test_bind_a_port",
        "test_module_fixture",
    }, outcomes
    assert outcomes["test_pure"] == outcomes["test_not_unit"] == "passed"
    # the session's fixtures of other tests end in the last test's teardown: not the unit test's doing
    assert outcomes["test_last_unit"] == "passed", outcomes
    result.stdout.fnmatch_lines(["*the unit run refused: started a process*"])  # the caught one


def test_every_listed_module_exists() -> None:
    from pathlib import Path

    from tests.unitguard import UNIT_MODULES, unit_paths

    root = Path(__file__).resolve().parents[1]
    assert len(unit_paths()) == len(UNIT_MODULES), sorted(
        m for m in UNIT_MODULES if not (root / "tests" / f"{m}.py").is_file()
    )  # a renamed module would leave the unit run silently
