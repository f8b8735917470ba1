"""The waterlevel policy (policies/waterlevel.py): the trigger w <= C_R - C_e and the serial move order, the
after-burst rule for the core, exact timelines on hand-built workloads, and its invariants checked from the log."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.policies.waterlevel import Waterlevel
from gyre.workload import GroupSpec
from tests.logcheck import check_staleness
from tests.simkit import ROUND_COSTS, cluster, spec
from tests.test_log_invariants import SLOW_OK, _groups

# decode 100 tokens/s per sequence, training 0.01 s per token on one GPU, onload 0.5 s, engine sleep 1 s and wake
# 2 + sync 1 s; a 1-GPU satellite's snapshot pull 1 s; a reduction over k 1-GPU cells 2 (k - 1) / k s
COSTS = replace(ROUND_COSTS, train_weight_bytes=100.0, link_bytes_s=100.0)


def _group(gid: int, first: int, gens: list[int]) -> GroupSpec:
    return GroupSpec(group_id=gid, task_id=gid, step=0, executions=[spec(first + i, gid, [n]) for i, n in enumerate(gens)])


def _run(groups, gpus: int, steps: int, eta: int, window: int = 10**9, capacity="share"):
    """Cells of one GPU; the window makes each engine's admission limit floor(1e9 / window) executions."""
    c = cluster(groups, gpus, 1, costs=COSTS, window=window)
    c._cell_gpus = 1
    c.run(Waterlevel(eta=eta, capacity=capacity), steps)
    return c


def _moves(c):
    return [(r[1], r[3]["cell"], r[3]["outstanding"], r[3]["capacity_left"]) for r in c.log
            if r[0] == "note" and r[2] == "waterlevel_move"]


def test_cells_move_in_order_once_the_capacity_left_holds_the_outstanding_work():
    """Four 1-GPU cells of one engine each holding one execution (C_e = 1); one group of four executions of 100,
    200, 300 and 800 tokens dispatched at 3 s. w falls to 3 at 4 s: cell 0 (the core) may move (3 <= 4 - 1); at 5 s
    w = 2 <= 3 - 1: cell 1; at 6 s cell 2; cell 3 only at 11 s when w = 0. The group is due (eta 0), so the core
    opens the step once it is down (5 s, trainer up 5.5); satellites join as they come down (pull 1 s); the four
    micro-steps (200, 200, 300, 800 tokens) train from 11 s, the core taking the last; three cells reduce (4/3 s)."""
    c = _run([_group(0, 0, [100, 200, 300, 800]), _group(1, 4, [100] * 4)], gpus=4, steps=1, eta=0)
    moves = _moves(c)
    assert moves == [(4.0, 0, 3, 3), (5.0, 1, 2, 2), (6.0, 2, 1, 1), (11.0, 3, 0, 0)], moves
    timeline = [r for r in c.log if r[0] in ("step_open", "cell_join", "micro", "step")]
    assert timeline == [
        ("step_open", 5.0, 0, (0,), 1), ("cell_join", 5.5, 0, (0,)), ("cell_join", 7.5, 0, (1,)),
        ("cell_join", 8.5, 0, (2,)), ("micro", 13.0, 0, 0, 11.0, 0, 200), ("micro", 13.0, 0, 1, 11.0, 1, 200),
        ("cell_join", 13.5, 0, (3,)), ("micro", 14.0, 0, 2, 11.0, 2, 300), ("micro", 21.0, 0, 3, 13.0, 0, 800),
        ("step", 21.0 + 4 / 3, 1, 4, 1500)], timeline


@pytest.mark.parametrize("capacity", ["share", "limit"])
def test_capacity_counts_an_engines_share_of_the_dispatch_or_its_admission_limit(capacity):
    """The first test's workload on engines that may each hold two executions (window 5e8). Counted at their share
    of the dispatch (4 executions over 4 engines: 1 each) the moves are the first test's. Counted at the admission
    limit (2 each), the core moves at dispatch (3 s: w = 4 <= 8 - 2); moves are serial, and the core's execution
    (100 tokens) ends at 4 s and its engine takes 1 s to stop, so cell 1 follows at 5 s (w = 2 <= 4, cells 2 and 3),
    cell 2 at 6 s (w = 1 <= 2), cell 3 at 11 s."""
    c = _run([_group(0, 0, [100, 200, 300, 800]), _group(1, 4, [100] * 4)], gpus=4, steps=1, eta=0, window=5 * 10**8,
             capacity=capacity)
    shares = [r[3] for r in c.log if r[0] == "note" and r[2] == "waterlevel_capacity"]
    if capacity == "share":
        assert shares == [{"per_engine": 1, "engines": 4}]
        assert _moves(c) == [(4.0, 0, 3, 3), (5.0, 1, 2, 2), (6.0, 2, 1, 1), (11.0, 3, 0, 0)]
    else:
        assert shares == []
        assert _moves(c) == [(3.0, 0, 4, 6), (5.0, 1, 2, 4), (6.0, 2, 1, 2), (11.0, 3, 0, 0)]
    assert [r[2] for r in c.log if r[0] == "step"] == [1], "the step trained"


def test_bad_capacity_is_refused_naming_the_field():
    for bad in ("most", 0, -1, True, 1.5):
        with pytest.raises(ValueError, match="waterlevel: capacity must be"):
            Waterlevel(capacity=bad)


@pytest.mark.parametrize("slow, core_stays", [(False, True), (True, False)])
def test_after_a_burst_the_core_stays_only_if_the_next_batch_is_ready(slow, core_stays):
    """Two steps of one group of two, eta 1: both groups dispatched at once to four one-execution engines, the first
    on cells 0-1. Cells 0 and 1 move once the first group ends and train it. When the second group has finished by
    the end of that step, the core keeps training (no engine starts on GPU 0 again); when it still rolls out, the
    core returns to rollout at the burst's end."""
    second = [3000] * 2 if slow else [100] * 2
    c = _run([_group(0, 0, [100] * 2), _group(1, 2, second), _group(2, 4, [100] * 2)], gpus=4, steps=2, eta=1)
    first_step = next(r[1] for r in c.log if r[0] == "step")
    restarted = [r for r in c.log if r[0] == "engine_up" and r[1] >= first_step and 0 in r[3]]
    assert (not restarted) == core_stays, (first_step, restarted)
    assert [r[2] for r in c.log if r[0] == "step"] == [1, 2], "both steps trained"


@pytest.mark.invariants
@SLOW_OK
@given(seed=st.integers(0, 2**32 - 1), eta=st.integers(0, 2), gpus=st.sampled_from([3, 4, 6]),
       gps=st.integers(1, 2), size=st.integers(1, 3), mu=st.integers(1, 2), window=st.sampled_from([10**9, 5 * 10**8]))
def test_waterlevel_invariants_from_the_log(seed, eta, gpus, gps, size, mu, window):
    """Random multi-turn workloads, cells of one GPU, bursts of 1-2: GPUs conserved (checked run), each group trained
    once and each execution by one micro-step, staleness within eta (rebuilt from the log), no execution lost (every
    dispatched one finishes), and a cell moves only while the capacity left holds the outstanding work."""
    eta = max(eta, mu - 1)
    steps = 3
    groups = _groups(np.random.default_rng(seed), (steps * mu + eta + 3) * gps, size, turns=3, gen=(20, 300),
                     prompt=(50, 200))
    c = cluster(groups, gpus, gps, costs=COSTS, window=window)
    c._cell_gpus, c._mu = 1, mu
    c.run(Waterlevel(eta=eta), steps)
    check_staleness(c.log, eta, exact=True, mu=mu)
    trained = [r for r in c.log if r[0] == "trained"]
    assert len({r[3] for r in trained}) == steps * gps and len(trained) == len({r[2] for r in trained})
    assert sorted(r[3] for r in c.log if r[0] == "micro") == sorted(r[2] for r in trained), "one micro-step each"
    admitted = {r[2] for r in c.log if r[0] == "admit"}
    finished = {r[2] for r in c.log if r[0] == "finish"}
    assert {r[2] for r in trained} <= finished and admitted <= finished | {x for x in admitted if x not in finished
                                                                           and c.executions[x].phase != 4}, "lost"
    for r in c.log:
        if r[0] == "note" and r[2] == "waterlevel_move":
            assert r[3]["outstanding"] <= r[3]["capacity_left"], r
