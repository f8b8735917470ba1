"""Per-token version lag in the simulator: a sync in the middle of a segment splits its tokens between
versions, and executions parked at tool-call boundaries and resumed elsewhere keep every token counted once
within the staleness bound."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.cluster import Phase
from gyre.sim.harness.runner import simulate
from gyre.workload import GroupSpec
from tests.simkit import cluster, spec, tiny_config


class SyncMidSegment:
    """Group 1's short execution finishes, is trained (version 1) and the engine syncs while group 0's long
    execution decodes: its tokens before the sync are version 0's, after it version 1's."""

    name = "sync-mid-segment"

    def run(self, cluster, steps):
        e = yield cluster.start_engine([0])
        g0, g1 = cluster.next_group(), cluster.next_group()
        long = cluster.admit(g0.executions[0], e)
        yield cluster.admit(g1.executions[0], e)
        yield cluster.train([1], [g1])
        yield cluster.sync([e])
        yield long
        yield cluster.train([1], [g0])


def test_token_lag_splits_a_segment_at_a_mid_segment_sync():
    """Exact per-token lag: tokens decoded before the sync pause (100 tokens/s from the start) lag 1 version."""
    c = cluster([GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, [1000])]),
                 GroupSpec(group_id=1, task_id=1, step=0, executions=[spec(1, 1, [100])])], n_gpus=2, groups_per_step=1)
    c.run(SyncMidSegment(), 2)
    start = next(x[1] for x in c.log if x[0] == "start" and x[2] == 0)
    sync_end = next(x[1] for x in c.log if x[0] == "sync")
    before = (sync_end - 1.0 - start) * 100  # sync_s = 1: the engine pauses for the last second
    rec = {x[2]: x for x in c.log if x[0] == "trained"}
    assert 0 < before < 1000, f"the sync did not fall mid-segment: {before}"
    assert rec[0][4:] == (1, 1, pytest.approx(before), 1000), rec[0]
    assert rec[1][4:] == (0, 0, 0, 100), rec[1]
    counts = Counter(x[0] for x in c.log)
    assert counts["trained"] == 2 and counts["finish"] == 2


# ---------------------------------------------------------------------------- park and resume
@pytest.mark.invariants
@given(seed=st.integers(0, 10_000), eta=st.integers(0, 2), period=st.sampled_from([2.0, 10.0, 40.0]))
@settings(deadline=None)
def test_parking_loses_nothing_and_keeps_every_token_within_the_bound(seed, eta, period):
    """Executions parked at random tool-call boundaries and resumed on random engines: every admitted execution
    finishes and is trained exactly once, parks and resumes pair up, staleness <= eta, every token's lag is
    within [0, its execution's staleness], and the lag counts exactly the tokens it generated."""
    from tests.simkit import ParkingAsync

    cfg = tiny_config(gpus=6, seed=seed, steps=3)
    r = simulate(cfg, ParkingAsync(eta, seed, period), check=True)
    log = r.log
    kinds = Counter(x[0] for x in log)
    admitted = Counter(x[2] for x in log if x[0] == "admit")
    finished = Counter(x[2] for x in log if x[0] == "finish")
    trained = {x[2]: x for x in log if x[0] == "trained"}
    assert max(admitted.values()) == max(finished.values()) == 1, "an execution restarted or finished twice"
    assert set(admitted) == set(finished) == set(trained), "an execution was lost"
    assert kinds["trained"] == len(trained), "an execution was trained twice"
    assert kinds["park"] == kinds["resume"], f"{kinds['park']} parks, {kinds['resume']} resumes"
    assert not r.metrics.extra["trained_other_groups"]
    gen = {x[2]: x[4] for x in log if x[0] == "finish"}
    for x in trained.values():
        assert x[5] <= eta and x[7] == gen[x[2]], x
        assert -1e-6 <= x[6] <= x[5] * x[7] + 1e-6, f"token lag {x[6]} outside [0, {x[5]} x {x[7]}]"


def test_a_parked_execution_resumes_where_it_stopped():
    """Exact timeline: parked during its tool call (KV freed), resumed on the other engine after the tool
    returned, it re-prefills there and decodes its last segment; its tokens are all counted once."""

    class ParkOnce:
        name = "park-once"

        def run(self, cluster, steps):
            from gyre.handles import all_of

            a, b = yield all_of([cluster.start_engine([0]), cluster.start_engine([1])])
            g = cluster.next_group()
            x = g.executions[0]
            done = cluster.admit(x, a)
            yield cluster.timeout(2.0)  # t = 5: its first segment (100 tokens at 100/s) ended at 4, tool until 14
            parked = yield cluster.park(x)
            assert parked and cluster.parked() == [x] and x.phase == Phase.PARKED and a.kv_used == 0
            yield cluster.timeout(20.0)
            yield cluster.resume(x, b)
            yield done
            yield cluster.train([2], [g])

    c = cluster([GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, [100, 300], tool_s=[10.0])])],
                n_gpus=3, groups_per_step=1)
    c.run(ParkOnce(), 1)
    got = [(x[0], x[1], *x[2:4]) for x in c.log if x[0] in ("start", "park", "resume", "finish")]
    assert got == [("start", 3.0, 0, 0), ("park", 5.0, 0, 0), ("resume", 25.0, 0, 1), ("finish", 28.0, 0, 0)], got
    trained = next(x for x in c.log if x[0] == "trained")
    assert trained[4:] == (0, 0, 0, 400), trained
