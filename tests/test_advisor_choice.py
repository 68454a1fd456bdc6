"""The advisor's choice on cases whose answer is known, from given measured costs (no process): a model
whose one variable dwarfs the others, compute-bound models, the batch each layout runs at, and which
costs count as measured where."""

from __future__ import annotations

import pytest

from tfdist import advisor
from tfdist.advisor import GBIT, Hardware, Measured

# Costs as the probe measures them on a 2-core server (loopback gRPC; CPU collectives are slow)
LOCAL_COSTS = {
    "ps_overhead_s": 0.005,
    "ps_dispatch_s": 0.003,
    "ps_dispatch_per_ps_s": 0.001,
    "allreduce_overhead_s": 0.003,
    "allreduce_bandwidth": 0.3e9,
    "link_bandwidth": 1.5e9,
}
LOCAL = advisor.with_costs(Hardware(nodes=1, shared_cpu_cores=2), LOCAL_COSTS)


def dwarfing(step_s: float = 0.05) -> Measured:
    """One 400 MB variable and a few small ones (VGG's fc6 in miniature)."""
    return Measured(step_s=step_s, batch=64, var_bytes=(400_000_000, 4096, 16384, 40), cores_used=1.0)


def choice(m: Measured, hw: Hardware, workers: int) -> advisor.Prediction:
    return advisor.recommend(advisor.plan(m, hw, workers, split=True))[0]


def test_one_dwarfing_variable_on_a_network_no_ps_layout_pays():
    """Two GPU nodes on 10 GbE, the cell's batch 64: the 400 MB variable loads one PS however many there
    are (a second PS gains nothing), each remote step moves 800 MB over one NIC (0.64 s against a 0.05 s
    step), and all-reduce at the cell's global batch moves 400 MB per 64 examples: one worker it is."""
    hw = advisor.with_costs(Hardware(nodes=2, bandwidth=10 * GBIT), LOCAL_COSTS, local=False)
    preds = {p.label: p for p in advisor.plan(dwarfing(), hw, 2, split=True)}
    assert preds["2 workers, 2 PS"].examples_per_s == pytest.approx(
        preds["2 workers, 1 PS"].examples_per_s, rel=0.01
    )
    assert preds["2 workers, 1 PS"].bound in ("PS bandwidth", "network")
    assert preds["all-reduce, 2 workers"].bound == "all-reduce bandwidth"
    best, why = advisor.recommend(list(preds.values()))
    assert best.strategy == "single", why
    assert "the busiest holds 400 MB" in why, why


def test_one_dwarfing_variable_on_slow_cpu_collectives_ps_beats_all_reduce():
    """The same model on this server: its collectives (measured 0.3 GB/s) are slower than the PS link
    (1.5 GB/s), so all-reduce must not be recommended over a PS layout."""
    best = choice(dwarfing(), LOCAL, 2)
    assert best.strategy in ("ps", "single"), best.label
    allreduce = advisor.predict_allreduce(dwarfing(), LOCAL, 2, split=True)
    assert allreduce.bound == "all-reduce bandwidth"
    assert allreduce.examples_per_s < best.examples_per_s


def test_a_compute_bound_model_that_fills_the_cores_stays_on_one_worker():
    m = Measured(step_s=0.5, batch=64, var_bytes=(16384, 256, 2560, 40), cores_used=2.0)
    best, why = advisor.recommend(advisor.plan(m, LOCAL, 2, split=True))
    assert best.run_line() == "%%tfdist run --workers 1 --ps 1", why
    assert "distributing does not pay" in why


def test_a_compute_bound_model_on_gpus_is_spread_over_them():
    """Four GPUs of one node, small variables, a long step that shrinks with the batch: every worker
    counts, and the plan does not stay on one."""
    m = Measured(step_s=0.4, batch=64, var_bytes=(16384, 256, 2560, 40), split_step_s=((16, 0.1),))
    hw = advisor.with_costs(Hardware(nodes=1, devices_per_node=4, bandwidth=10 * GBIT), LOCAL_COSTS)
    preds = advisor.plan(m, hw, 4, split=True)
    best, _ = advisor.recommend(preds)
    assert best.strategy != "single"
    assert best.examples_per_s > 3 * preds[0].examples_per_s
    assert best.bound == "compute"


def test_all_reduce_runs_the_cells_batch_split_and_is_compared_by_examples():
    """The cell's batch 64 is all-reduce's global batch: 32 per replica, timed at 32 where measured."""
    m = Measured(step_s=0.010, batch=64, var_bytes=(4000,), split_step_s=((32, 0.008),), steps_per_epoch=100)
    hw = Hardware(
        nodes=1, devices_per_node=2, bandwidth=1e12, local_bandwidth=1e12, allreduce_overhead_s=0.002
    )
    split = advisor.predict_allreduce(m, hw, 2, split=True)
    assert split.replica_batch == 32 and split.phases["compute"] == pytest.approx(0.008)
    assert split.examples_per_s == pytest.approx(64 / (0.008 + 0.002), rel=1e-3)
    scaled = advisor.predict_allreduce(m, hw, 2, split=False)
    assert scaled.replica_batch == 64 and scaled.examples_per_s == pytest.approx(128 / 0.012, rel=1e-3)
    # time to the same epochs: each epoch is 100 x 64 examples whatever the layout
    assert split.train_s(3) == pytest.approx(3 * 100 * 64 / split.examples_per_s)
    ps = advisor.predict_ps(m, hw, 2, 1)
    assert ps.replica_batch == 64
    assert ps.train_s(3) == pytest.approx(3 * 100 * 64 / ps.examples_per_s)


def test_step_time_between_measured_batches():
    m = Measured(step_s=0.010, batch=64, var_bytes=(1,), split_step_s=((16, 0.004),))
    assert m.step_at(64) == 0.010 and m.step_at(16) == 0.004
    assert m.step_at(32) == pytest.approx(0.006)  # linear between them: a fixed part and a per-example one
    assert 0 < m.step_at(8) <= 0.004
    only = Measured(step_s=0.010, batch=64, var_bytes=(1,))
    assert only.step_at(32) == pytest.approx(0.005)  # one point: proportional


def test_measured_costs_replace_the_assumed_ones_and_say_so():
    hw = advisor.with_costs(Hardware(), LOCAL_COSTS | {"bogus": 1.0, "ps_overhead_s": -1.0})
    assert hw.ps_dispatch_s == 0.003 and hw.bandwidth == hw.local_bandwidth == 1.5e9
    assert hw.ps_overhead_s == advisor.PS_STEP_LATENCY_S  # a nonsense figure stays assumed
    assert "ps_overhead_s" not in hw.measured and "link_bandwidth" in hw.measured
    zero = advisor.with_costs(Hardware(), {"ps_dispatch_per_ps_s": 0.0, "link_bandwidth": 0.0})
    assert zero.measured == ("ps_dispatch_per_ps_s",)  # no extra cost is a measurement; no rate is not
    assert zero.ps_dispatch_per_ps_s == 0.0 and zero.bandwidth == advisor.DEFAULT_BANDWIDTH["kubernetes"]
    remote = advisor.with_costs(Hardware(nodes=2), LOCAL_COSTS, local=False)
    assert remote.measured == ("ps_dispatch_s", "ps_dispatch_per_ps_s")
    assert remote.bandwidth == advisor.DEFAULT_BANDWIDTH["kubernetes"]
    assert remote.allreduce_bandwidth is None


def test_the_recommendation_follows_the_measured_collective_rate():
    """The same model and machine: all-reduce wins with fast collectives, PS with slow ones."""
    m = Measured(
        step_s=0.02, batch=64, var_bytes=(8_000_000, 4000), split_step_s=((32, 0.012),), cores_used=1.0
    )
    fast = advisor.with_costs(
        Hardware(nodes=1, shared_cpu_cores=2), LOCAL_COSTS | {"allreduce_bandwidth": 20e9}
    )
    slow = advisor.with_costs(
        Hardware(nodes=1, shared_cpu_cores=2), LOCAL_COSTS | {"allreduce_bandwidth": 0.05e9}
    )
    assert choice(m, fast, 2).strategy == "allreduce"
    assert choice(m, slow, 2).strategy != "allreduce"
