"""`%tfdist plan`'s layout trials (tfdist.runtime.probetrials): their shape and reading (pure), and a
trial that cannot run says why and leaves no process behind."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from tfdist.runtime.probetrials import Layout, Trial, Trials, pace_of, trial_shape


@pytest.mark.parametrize(
    ("key", "workers", "ps", "processes"), [("1x1", 1, 1, 1), ("2x2", 2, 2, 1), ("ar3", 3, 0, 3)]
)
def test_layout_keys(key, workers, ps, processes):
    layout = Layout.parse(key)
    assert (layout.workers, layout.ps, layout.processes, layout.key) == (workers, ps, processes, key)


def test_trial_shape_takes_the_fits_own_epoch_where_it_is_short_enough():
    # a tiny model: 40 steps (the cap) in epochs of 40, four of them timed
    assert trial_shape(0.0007, 200) == (40, 4)
    # its epoch is shorter than that: epochs of the fit's own 6 steps, more of them (at most 8)
    assert trial_shape(0.0007, 6) == (6, 8)
    # a slow step: the fewest steps that read a pace
    assert trial_shape(0.07, 6) == (5, 4)
    assert trial_shape(2.0, None) == (3, 4)


def test_pace_is_the_median_epoch_over_its_steps():
    # one slow epoch (another process took the core) does not move it
    t = pace_of([0.30, 0.31, 0.90, 0.29], 40)
    assert t.pace_s == pytest.approx(0.305 / 40)
    assert pace_of([0.3, 0.6, 0.33], 30).pace_s == pytest.approx(0.011)


class Recorded:
    """The probe's Trials as run_trials drives them: each round's call and each layout's end, recorded;
    each layout's epochs from `base` (seconds, + `drift` a round)."""

    layouts = [Layout(1, 1), Layout(2, 1), Layout(2, 2), Layout(2, 0)]

    def __init__(self, base: dict[str, float], fails: set[tuple[str, int]] = frozenset(), drift: float = 0.1):
        self.base, self.fails, self.drift = base, fails, drift
        self.calls: list[tuple[str, int, bool]] = []
        self.ended: list[str] = []
        self.events: list[tuple[str, ...]] = []  # runs and ends, in order

    def run(self, layout, steps, epochs, round_no=0, last=True):
        self.calls.append((layout.key, round_no, last))
        self.events.append(("run", layout.key))
        if (layout.key, round_no) in self.fails or (layout.key, -1) in self.fails:
            self.ended.append(layout.key)
            raise RuntimeError("its servers ended")
        return Trial(
            pace_s=0.0, steps=steps, epochs_s=(self.base[layout.key] + self.drift * round_no,) * epochs
        )

    def end(self, layout):
        self.ended.append(layout.key)
        self.events.append(("end", layout.key))


def _result():
    from tfdist.runtime.probe import ProbeResult

    return ProbeResult(
        step_s=0.001,
        steps_timed=10,
        cores_used=1.0,
        batch=64,
        var_bytes=[4, 4, 4],
        var_names=["a", "b", "c"],
        grad_bytes=12,
        params=3,
    )


def test_trials_run_in_two_mirrored_rounds_and_their_epochs_pool():
    """Each layout twice, the second round in reverse order (no layout always first after the probe's own
    timing, or always after the heaviest); the pace is the median of both rounds' epochs; a layout whose
    round failed is not tried again (its processes ended). One layout clearly ahead: no more rounds, and
    every layout's processes end."""
    from tfdist.runtime.probe import run_trials

    trials = Recorded({"1x1": 0.40, "2x1": 0.30, "ar2": 0.50}, fails={("2x2", -1), ("ar2", 1)})
    result = _result()
    run_trials(trials, result)
    assert trials.calls == [
        ("1x1", 0, False),
        ("2x1", 0, False),
        ("2x2", 0, False),
        ("ar2", 0, False),
        ("ar2", 1, False),
        ("2x1", 1, False),
        ("1x1", 1, False),
    ]
    assert {"1x1", "2x1", "2x2", "ar2"} <= set(trials.ended)
    # a layout with no round has no trial (the plan says why); one whose second round failed keeps its first
    assert set(result.trials) == {"1x1", "2x1", "ar2"} and set(result.trial_errors) == {"2x2"}
    assert result.trials["ar2"]["epochs_s"] == (0.5, 0.5)
    steps = result.trials["1x1"]["steps"]
    # a 1 ms step: epochs of 40 steps (the cap), 4 timed in all, so 2 in each round
    assert result.trials["1x1"]["epochs_s"] == (0.4, 0.4, 0.5, 0.5)
    assert result.trials["1x1"]["pace_s"] == pytest.approx(0.45 / steps)  # between the rounds' 0.40 and 0.50


def test_layouts_still_in_contention_get_two_more_mirrored_rounds_and_the_others_end_first():
    """2x1 and 2x2 within CONTEND of each other after two rounds: those two fit twice more (mirrored, the
    last round ending their processes), and 1x1 and ar2, out of the running, end before those rounds."""
    from tfdist.runtime.probe import run_trials
    from tfdist.runtime.probetrials import CONTEND

    trials = Recorded({"1x1": 0.50, "2x1": 0.30, "2x2": 0.30 * (1 + CONTEND / 2), "ar2": 0.60}, drift=0.0)
    result = _result()
    run_trials(trials, result)
    assert trials.calls[8:] == [
        ("2x1", 2, False),
        ("2x2", 2, False),
        ("2x2", 3, True),
        ("2x1", 3, True),
    ]
    first_extra = trials.events.index(("run", "2x1"), 8)
    assert {("end", "1x1"), ("end", "ar2")} <= set(trials.events[:first_extra])
    assert {("end", "2x1"), ("end", "2x2")} <= set(trials.events[first_extra:])
    assert len(result.trials["2x1"]["epochs_s"]) == 2 * len(result.trials["1x1"]["epochs_s"])
    assert result.trials["2x2"]["pace_s"] > result.trials["2x1"]["pace_s"]


def test_a_contender_that_fails_in_an_extra_round_keeps_its_earlier_epochs():
    from tfdist.runtime.probe import run_trials

    trials = Recorded({"1x1": 0.31, "2x1": 0.30, "2x2": 0.6, "ar2": 0.6}, fails={("1x1", 2)}, drift=0.0)
    result = _result()
    run_trials(trials, result)
    assert ("1x1", 3, True) not in trials.calls and ("2x1", 3, True) in trials.calls
    assert len(result.trials["1x1"]["epochs_s"]) == 4 and "1x1" not in result.trial_errors


def test_an_allreduce_rank_done_before_rank_0_has_written_is_not_a_failure(tmp_path):
    """All-reduce's other ranks end (exit 0) after their last round, possibly before rank 0 writes its
    result: the probe waits for rank 0 (it once called such a trial failed and dropped the layout)."""
    import subprocess
    import sys

    out = str(tmp_path / "trial-ar2.json")
    rank0 = (
        "import json, os, sys, time; sys.stdin.readline(); time.sleep(1.0)\n"
        "trial = {'pace_s': 0.01, 'steps': 5, 'epochs_s': [0.05, 0.05]}\n"
        f"json.dump(trial, open({out!r} + '.1.tmp', 'w'))\n"
        f"os.replace({out!r} + '.1.tmp', {out!r} + '.1')\n"
    )
    rank1 = "import sys; sys.stdin.readline()"  # its last round done: it ends at once
    trials = Trials.__new__(Trials)
    trials.failed, trials.out = {}, {"ar2": out}
    trials.procs = {
        "ar2": [
            subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
            for code in (rank0, rank1)
        ]
    }
    try:
        got = trials.run(Layout(2, 0), 5, 2, round_no=1, last=True)
    finally:
        trials.close()
    assert got.epochs_s == (0.05, 0.05)
    assert all(p.poll() is not None for p in trials.procs["ar2"])


@pytest.mark.parametrize(("rank1_exit", "last"), [(1, True), (1, False), (0, False)])
def test_an_allreduce_rank_that_failed_ends_the_wait_at_once(tmp_path, rank1_exit, last):
    """Rank 0 stuck in a collective whose peer failed (exit 1), or ended before its last round: the trial
    is over (no waiting out TRIAL_TIMEOUT_S), and both processes end."""
    import subprocess
    import sys

    rank0 = "import sys, time; sys.stdin.readline(); time.sleep(60)"  # blocked: it never writes
    rank1 = f"import os, sys; sys.stdin.readline(); os._exit({rank1_exit})"
    trials = Trials.__new__(Trials)
    trials.failed, trials.out = {}, {"ar2": str(tmp_path / "trial-ar2.json")}
    trials.procs = {
        "ar2": [
            subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
            for code in (rank0, rank1)
        ]
    }
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"wrote nothing \(its processes' exit codes \[None, "):
            trials.run(Layout(2, 0), 5, 2, round_no=0, last=last)
        # both ended by the failed round itself, before close() (which would kill them anyway)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(p.poll() is None for p in trials.procs["ar2"]):
            time.sleep(0.1)
        assert all(p.poll() is not None for p in trials.procs["ar2"])
    finally:
        trials.close()
    assert time.monotonic() - t0 < 15


@pytest.mark.slow
def test_a_trial_that_cannot_run_says_why_and_ends_its_processes(tmp_path):
    """A bundle that is not one (what a broken payload would be): each layout's trial says why it has
    none, the plan falls back to the costs, and no trial process outlives the probe's handle."""
    bundle = tmp_path / "bundle.bin"
    bundle.write_bytes(b"not a bundle")
    trials = Trials([Layout(1, 1), Layout(2, 0)], str(bundle), str(tmp_path))
    pids = [p.pid for procs in trials.procs.values() for p in procs]
    assert len(pids) == 5  # a worker and a PS server, the 1x1 coordinator, two all-reduce workers
    try:
        trials.wait_ready()
        assert trials.failed == {}
        for layout in trials.layouts:
            with pytest.raises(RuntimeError) as err:
                trials.run(layout, 3, 2)
            assert str(err.value), layout
    finally:
        trials.close()
    alive = [
        pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert alive == []
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))


def test_trial_processes_die_with_the_probe(tmp_path):
    """The probe killed (the kernel's timeout, SIGKILL): its trial processes go with it (PR_SET_PDEATHSIG)."""
    import subprocess
    import sys
    import time

    code = (
        "import sys, time\n"
        "from tfdist.runtime.probetrials import Layout, Trials\n"
        f"t = Trials([Layout(1, 1)], 'nothing', {str(tmp_path)!r})\n"
        "print(t.procs['1x1'][0].pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    probe = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(probe.stdout.readline())
        assert psutil.pid_exists(child)
        probe.kill()
        probe.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the trial process outlived the probe")
    finally:
        probe.kill()


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


FORKED_PROBE = """
import json, sys, time
from tfdist.runtime.probehelpers import ForkedHelper, HelperLauncher, helper_env
from tfdist.runtime.probetrials import Layout, Trials
launcher = HelperLauncher()
launcher.start(helper_env())
t = Trials([Layout(1, 1), Layout(2, 0)], "no-bundle", sys.argv[1], launcher)
t.wait_ready()
procs = [p for ps in t.procs.values() for p in ps]
errors = {}
for layout in t.layouts:
    try:
        t.run(layout, 3, 2)
    except RuntimeError as exc:
        errors[layout.key] = str(exc)
t.close()
left = Trials([Layout(1, 1)], "no-bundle", sys.argv[1], launcher)  # still up when the probe is killed
left.wait_ready()
print(json.dumps({
    "forked": [isinstance(p, ForkedHelper) for p in procs],
    "codes": [p.returncode for p in procs],
    "errors": errors,
    "failed": t.failed,
    "left": [p.pid for ps in left.procs.values() for p in ps],
    "server": launcher._server.pid,
}), flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_the_probes_helpers_are_forked_from_one_import_and_die_with_it(tmp_path):
    """With the probe's fork server (runtime.probehelpers), every trial process is forked from its one
    TensorFlow import, is the probe's own child, reads its word on stdin as a fresh one does (each layout
    runs and says why it has no trial), is reaped by the probe, and dies with it (SIGKILL)."""
    import json
    import subprocess
    import sys
    import time

    probe = subprocess.Popen(
        [sys.executable, "-c", FORKED_PROBE, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        got = json.loads(probe.stdout.readline())
        assert got["forked"] == [True] * 5, got
        assert got["failed"] == {}, got
        assert set(got["errors"]) == {"1x1", "ar2"} and all(got["errors"].values()), got
        assert all(code is not None for code in got["codes"]), got  # reaped, not left as zombies
        left = [psutil.Process(pid) for pid in got["left"]]
        assert len(left) == 3 and all(p.ppid() == probe.pid for p in left)
        assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))
        probe.kill()
        probe.wait()
        deadline = time.monotonic() + 10
        alive = [*left, psutil.Process(got["server"])]
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _running(p)]
            time.sleep(0.05)
        assert alive == [], "a forked helper or the fork server outlived the probe"
    finally:
        probe.kill()


def test_the_plan_says_which_layouts_had_the_extra_rounds():
    """From what run_trials recorded, not from epoch counts: every layout in contention (each with four
    rounds' epochs) still reads as two rounds then two more for them."""
    from tfdist.kernel_magics.plan import trials_text
    from tfdist.runtime.probetrials import CONTEND

    result = _result()
    result.trial_round_epochs = 2
    result.trials = {
        "1x1": {"pace_s": 0.012, "steps": 10, "epochs_s": (0.12,) * 4},
        "2x1": {"pace_s": 0.009, "steps": 10, "epochs_s": (0.09,) * 8},
        "2x2": {"pace_s": 0.0093, "steps": 10, "epochs_s": (0.093,) * 8},
    }
    result.trial_extra = ["2x1", "2x2"]
    text = trials_text(result)
    assert "timed over 4 epochs of 10 steps, in two rounds" in text, text
    assert f"then 2x1 and 2x2 (within {CONTEND * 100:.0f} % of the best pace) in two more (" in text, text
    assert "2x2 9.3 ms/step" in text
    result.trial_extra = ["1x1", "2x1", "2x2"]
    result.trials["1x1"]["epochs_s"] = (0.12,) * 8
    text = trials_text(result)
    assert "timed over 4 epochs" in text and "then 1x1, 2x1 and 2x2 (within" in text, text
    result.trial_extra = []
    assert "two more" not in trials_text(result)


def test_run_trials_records_its_rounds_and_ends_layouts_it_does_not_offer():
    """The contenders and one round's epochs go to the plan; a layout with more PS than the model has
    variables is not tried, and its processes end with the others before the extra rounds."""
    from tfdist.runtime.probe import run_trials
    from tfdist.runtime.probetrials import CONTEND

    trials = Recorded({"1x1": 0.50, "2x1": 0.30, "2x2": 0.30 * (1 + CONTEND / 2), "ar2": 0.60}, drift=0.0)
    trials.layouts = [*Recorded.layouts, Layout(2, 4)]  # 4 PS for a model of 3 variables
    result = _result()
    run_trials(trials, result)
    assert result.trial_extra == ["2x1", "2x2"] and result.trial_round_epochs == 2
    assert "2x4" not in {key for key, *_ in trials.calls}
    first_extra = trials.events.index(("run", "2x1"), 8)
    assert ("end", "2x4") in trials.events[:first_extra]
