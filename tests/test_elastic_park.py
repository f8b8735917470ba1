"""When no trainer size's migrants all fit (policies.elastic, 1.): park the overflow of the smallest size that
reaches the trainer's minimum, or hold admission until the live executions fit (policies.elastic_plan.park_pays)."""

from __future__ import annotations

import pytest

from gyre.config import override
from gyre.policies.elastic_plan import park_pays
from tests.test_elastic import Ex, _forecast
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate
from gyre.workload import LogNormal
from tests.logcheck import check_staleness


def _pays(parks=(3,), capacity=2, cuts=0.5, **kw):
    """Four live executions finishing at 10, 20, 30 and 40 (1 and 2 of group 1, the next batch; 3 and 4 of
    group 2, the one after), room for 2 on the staying engines; gather 1 s, stop 1 s, training 5 s, an engine
    start 2 s, now 0: holding, two have finished at 20 and the step ends at 27; parking, it ends at 7 and the
    parked executions resume 9 s later than they would have. Returns the answer and the delays the parks'
    extra cuts were asked at (`cuts` each, at that delay and none without)."""
    seen = []
    live = tuple(Ex(i, 0, group_id=g) for i, g in ((1, 1), (2, 1), (3, 2), (4, 2)))

    def risk(x, s=1.0, d=0.0):
        if d:
            seen.append(d)
        return cuts / len(parks) if d else 0.0

    f = _forecast(**{**dict(live=live, finish={1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0}, pending=(1, 2), due=(0, 1),
                            stop_s=1.0, start_s=2.0, risk=risk), **kw})
    got = park_pays(f, [x for x in live if x.id in parks], 1.0, 5.0, capacity, 1.0)
    return got, sorted(set(seen))


def test_park_pays_where_the_next_batch_trains_sooner():
    """Parking an execution of the batch after next: the next batch (group 1, ready at 20) trains at 20 to
    25 instead of 27 to 32 after the held step; its parks are priced at their 9 s delay (7 + 2 - 0)."""
    got, seen = _pays()
    assert got and seen == [9.0]


def test_parking_the_next_batch_past_the_hold_does_not_pay():
    """Parking execution 2 (group 1, the next batch, due at 20) pushes it to 29: the next batch trains at
    29 to 34, later than holding's 27 to 32. Parking execution 1 (due at 10, so at 19) leaves group 1 at 20:
    parking pays."""
    assert _pays(parks=(2,)) == (False, [])
    assert _pays(parks=(1,))[0]


def test_no_park_past_the_cut_tolerance_or_where_they_fit_now():
    assert _pays(cuts=1.5) == (False, [9.0]), "expected cuts above the tolerance: hold"
    assert _pays(capacity=4) == (False, []), "they fit now: holding trains as soon"


def test_a_next_batch_not_started_is_unknown():
    """A group of the next batch that is neither live nor finished (waiting to start) has no predicted end:
    neither way trains it sooner, so nothing is parked; finished, it is ready now."""
    assert _pays(pending=(5, 2)) == (False, [])
    assert _pays(pending=(5, 2), finished=frozenset({5}))[0]


def _tight(seed: int):
    """xlong-swe's shape on 10 one-GPU engines, training needing 8 (tests/test_elastic.py `_small`)."""
    changes = {"steps": 3, "seed": seed, "workload.groups_per_step": 4, "cluster.gpus": 10,
               "workload.turns": LogNormal(median=12, p99_ratio=10.0), "workload.max_turns": 150}
    return override(get_preset("xlong-swe-small"), **changes)


@pytest.mark.parametrize("seed", range(6))
def test_hold_admits_nothing_and_parks_only_in_train_drains(seed):
    """From the log: while a ready batch holds admission (from each `elastic_hold` note to the next
    `elastic_train`), no execution is admitted; executions are parked only by a train drain that says so
    (its `parks`), and each parked one finishes; staleness within eta."""
    r = simulate(_tight(seed), "elastic", {"eta": 2}, check=True)
    holding, admitted_in_hold = False, []
    for rec in r.log:
        if rec[0] == "note" and rec[2] == "elastic_hold":
            holding = True
        elif rec[0] == "note" and rec[2] == "elastic_train":
            holding = False
        elif rec[0] == "admit" and holding:
            admitted_in_hold.append(rec)
    assert not admitted_in_hold, admitted_in_hold[:3]
    drains = [rec[3] for rec in r.log if rec[0] == "note" and rec[2] == "elastic_drain"]
    assert all(d["parks"] == 0 for d in drains if d["why"] != "train")
    parked = {rec[2] for rec in r.log if rec[0] == "park"}
    assert parked <= {rec[2] for rec in r.log if rec[0] == "finish"}
    check_staleness(r.log, 2, exact=False)


def test_both_ways_are_taken_over_seeds():
    """Over these seeds some train drains park and some batches hold: the paths above are exercised."""
    notes = [rec for s in range(6) for rec in simulate(_tight(s), "elastic", {"eta": 2}).log if rec[0] == "note"]
    assert any(n[2] == "elastic_hold" for n in notes)
    assert any(n[2] == "elastic_drain" and n[3]["why"] == "train" and n[3]["parks"] for n in notes)
