"""Elastic's placement by age (policies.elastic_tiers): exact cases of its pure decisions, and its config."""

from __future__ import annotations

import pytest

from gyre.cluster import Phase
from gyre.policies.elastic import Elastic
from gyre.policies.elastic_config import ElasticConfig
from gyre.policies.elastic_tiers import engine_tiers, sort_moves, tier_of
from gyre.workload import GroupSpec
from tests.test_elastic import Eng, Ex, _cluster, _spec

TIERS = ((0.0, 4), (10.0, 2))


def test_tier_of_steps_down_at_each_age():
    """An execution's tier is the n of the last tier whose age it has reached."""
    t = ((0.0, 8), (2000.0, 5), (6000.0, 3))
    assert [tier_of(a, t) for a in (0.0, 1999.9, 2000.0, 5999.0, 6000.0, 1e9)] == [8, 8, 5, 5, 3, 3]


def test_engine_tiers_take_the_oldest_execution_and_skip_parked():
    """An engine's tier is its oldest live execution's; a parked one (off every engine) counts nowhere, and an
    engine holding nothing has no tier."""
    live = [Ex(0, 0, started_at=0.0), Ex(1, 0, started_at=25.0), Ex(2, 1, started_at=28.0),
            Ex(3, 2, started_at=0.0, phase=Phase.PARKED)]
    assert engine_tiers(live, 30.0, TIERS) == {0: 2, 1: 4}


def test_sort_moves_oldest_first_onto_the_lowest_tier_then_fullest():
    """At 30: engine 0 holds five, two of them old (tier 2). The oldest (id 0, age 30) goes to engine 1, which
    already holds an old one (tier 2, room for one more); the next (id 1, age 20) finds engine 1 at its tier,
    and of engines 2 (tier 4, one young) and 3 (empty) takes the fuller, 2. Engine 0 is then left with three
    young ones, within their tier 4; nothing else moves."""
    engines = [Eng(0, (0,), n_live=5), Eng(1, (1,), n_live=1), Eng(2, (2,), n_live=1), Eng(3, (3,))]
    live = [Ex(0, 0, started_at=0.0), Ex(1, 0, started_at=10.0)] + [Ex(i, 0, started_at=29.0) for i in (2, 3, 4)] \
        + [Ex(5, 1, started_at=15.0), Ex(6, 2, started_at=28.0)]
    got = [(x.id, t.id) for x, t in sort_moves(engines, live, 30.0, TIERS, kv_fill=0.5, incoming={})]
    assert got == [(0, 1), (1, 2)], got
    # one already moving stays; the other takes the best target
    got = [(x.id, t.id) for x, t in sort_moves(engines, live, 30.0, TIERS, kv_fill=0.5, incoming={}, moving={0})]
    assert got == [(1, 1)], got
    # a move in flight to engine 1 fills it; KV: engine 2 cannot take a 60-token context within half of 100
    live[1] = Ex(1, 0, started_at=10.0, context_tokens=60)
    got = [(x.id, t.id) for x, t in sort_moves(engines, live, 30.0, TIERS, kv_fill=0.5, incoming={1: 1})]
    assert got == [(0, 2)], got


def test_sort_moves_nothing_when_the_engine_is_within_the_tier():
    """An old execution on an engine holding no more than its tier stays (a move would only re-prefill it)."""
    engines = [Eng(0, (0,), n_live=2), Eng(1, (1,))]
    live = [Ex(0, 0, started_at=0.0), Ex(1, 0, started_at=29.0)]
    assert sort_moves(engines, live, 30.0, TIERS, kv_fill=0.5, incoming={}) == []


@pytest.mark.parametrize("tiers", [(), ((5.0, 4),), ((0.0, 4), (10.0, 6)), ((0.0, 4), (0.0, 2)), ((0.0, 0),)])
def test_bad_tiers_one_line(tiers):
    """Tiers that do not start at age 0, ascend in age and descend in n (>= 1) are refused, naming the field."""
    with pytest.raises(ValueError, match="tiers"):
        ElasticConfig(tiers=tiers)


def test_old_executions_spread_to_their_tier_timeline():
    """Eight rollouts of one group on four engines, two per engine; the two long ones share engine 0. With
    tiers (2 from age 0, 1 from age 3) the first to be sorted moves to an engine emptied by the short ones, at
    its tool call, and both long ones finish 4 s sooner; without tiers they share engine 0 to the end.

    By hand (eta 0, engine steps of 1 s + 0.5 s per decoding sequence, free prefill, 1 s wakes and sleeps):
    engines up at 1 take ids 0-7 round-robin (0 and 4 on engine 0). The short ones (5 tokens) finish at
    1 + 5 x 2 = 11. The long ones (three 4-token segments, 3 s tool calls) end their first segment at 9 and
    are in their tool call at 11, aged 10 (tier 1) on an engine holding two: id 0 (ties: the lower id)
    moves at once to engine 1, empty and the lowest id (engines 2 and 3 still hold two at that instant),
    which consolidation leaves alone for the move on its way; engines 2 and 3 stop. Alone, each long
    one runs its segments at 1.5 s per token: 12 + 6 + 3 + 6 = 27 (sharing engine 0: 12 + 8 + 3 + 8 = 31).
    Engine 0 stops at 27 (1 s) and the step trains 194 tokens at 0.001 s per token on 3 GPUs after a 1 s
    onload: 28 + 1 + 0.0647 = 29.0647 (without tiers 32.0647)."""
    def long(e):
        return _spec(e, 0, [4, 4, 4], [3.0, 3.0], [10, 10])

    ex = [long(j) if j in (0, 4) else _spec(j, 0, [5]) for j in range(8)]
    cases = ((((0.0, 2), (3.0, 1)), [(11.0, 0, 0, 1)], 27.0, 29.0647), (None, [], 31.0, 32.0647))
    for tiers, moves, ends, step in cases:
        c = _cluster([GroupSpec(group_id=0, task_id=0, step=0, executions=ex)], 0.001, step_b=0.5)
        c.run(Elastic(eta=0, tiers=tiers), 1)
        got = [r[1:5] for r in c.log if r[0] == "migrate"]
        assert got == moves, f"tiers {tiers}: migrations {got}"
        fin = {r[2]: r[1] for r in c.log if r[0] == "finish"}
        assert (fin[0], fin[4], max(v for k, v in fin.items() if k not in (0, 4))) == (ends, ends, 11.0), fin
        steps = [round(r[1], 4) for r in c.log if r[0] == "step"]
        assert steps == [step], f"tiers {tiers}: step ends {steps}"
        assert not [r for r in c.log if r[0] == "park"], "nothing parks"
