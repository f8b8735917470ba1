"""Kaplan-Meier survival of segments and durations (policies.lengths), the remaining times elastic draws from
them, and the per-engine deadline cap (policies.deadline_cap), on hand-computed cases."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.cluster import Phase
from gyre.policies.deadline_cap import DeadlineCaps, deadline_cap
from gyre.policies.elastic_forecast import drawn_remaining_s, remaining_s
from gyre.policies.lengths import Durations, History, level


@dataclass
class Ex:
    id: int
    turns_done: int = 0
    started_at: float | None = 0.0
    phase: Phase = Phase.DECODE
    engine_id: int = 0
    deadline_at: float = float("inf")


def test_durations_quantiles_by_hand():
    """Durations 10, 20, 30, 40 (no live ones): S = 3/4, 1/2, 1/4, 0 after each; a draw at level u is the
    first duration where S falls to (1 - u) x S(age), minus the age."""
    sp = Durations([40, 10, 30, 20], [], unseen_residual=1.0)
    assert sp.survival(15) == 0.75, "one of four ended by 15"
    assert sp.remaining(0, 0.5) == 20, "the median from the start"
    assert sp.remaining(0, 0.1) == 10, "S(10) = 0.75 <= 0.9"
    assert sp.remaining(15, 0.5) == 15, "past 15: S(30) = 0.25 <= 0.75 x 0.5, so 30 - 15"
    assert sp.remaining(0, 0.99) == 40, "the top level takes the longest"


def test_durations_counts_live_ages_as_censored():
    """Durations 10 and 30 with one live execution 20 s in: at 10 one of three ends (S = 2/3), the live one
    leaves the risk set at 20, at 30 the last at risk ends (S = 0)."""
    sp = Durations([10, 30], [20], unseen_residual=1.0)
    assert sp.survival(10) == pytest.approx(2 / 3), "one of three at risk ended at 10"
    assert sp.remaining(20, 0.5) == 10, "20 s in, only the 30 is left"
    assert sp.remaining(0, 0.2) == 10, "S(10) = 2/3 <= 0.8"


def test_durations_tail_past_every_observation_is_its_mean():
    """A level past the largest observation takes the Pareto tail's mean: (1 + unseen_residual) x the age
    the tail is reached at (the largest observation, or the execution's age if older), minus the age."""
    sp = Durations([10], [15], unseen_residual=1.0)  # S = 1/2 after 10; the live one censored at 15
    assert sp.remaining(15, 0.9) == pytest.approx(2 * 15 - 15), "older than every finish: it lasts its age again"
    assert sp.remaining(0, 0.9) == pytest.approx(2 * 10), "from the start, the tail reached at 10"
    assert Durations([10], [15], unseen_residual=0.5).remaining(15, 0.9) == pytest.approx(1.5 * 15 - 15), "residual 0.5"
    assert not Durations([], [5], 1.0), "nothing finished: no distribution to draw from"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), max_size=40), st.lists(st.integers(0, 12), max_size=40))
def test_durations_is_the_kaplan_meier_product_over_distinct_times(durations, ages):
    """The survival just after each event time t equals the textbook estimate: the product, over the distinct
    event times u <= t, of 1 - (events at u) / (at risk at u: durations >= u and live ages >= u, a live
    execution censored at its age still at risk at it). Integer times, so ties of every kind occur."""
    sp = Durations([float(d) for d in durations], [float(a) for a in ages], unseen_residual=1.0)
    assert sp.times == sorted(float(d) for d in durations)
    s = 1.0
    for u in sorted(set(durations)):
        at_risk = sum(d >= u for d in durations) + sum(a >= u for a in ages)
        s *= 1.0 - durations.count(u) / at_risk
        assert sp.survival(float(u)) == pytest.approx(s, rel=1e-12, abs=1e-15), u


def test_draw_segments_by_hand():
    """Segments 1 and 3 finished: S(k) = 1, 1/2, 1/2, 0 for k = 0..3; a draw is T - done for the least T
    with S(T) <= (1 - u) S(done)."""
    h = History(segments=(1, 3))
    assert h.draw_segments(0, 0.25, 1.0) == 1, "S(1) = 1/2 <= 3/4"
    assert h.draw_segments(0, 0.75, 1.0) == 3, "S(3) = 0 is the first <= 1/4"
    assert h.draw_segments(1, 0.5, 1.0) == 2, "past 1, only the 3 is left: 2 more"
    assert h.draw_segments(3, 0.5, 1.0) == 3, "past every observation: the tail's mean, its age again"
    assert h.draw_segments(5, 0.5, 1.0) == 5, "older than every observation"


def test_levels_cover_the_unit_interval_evenly():
    """Any 100 consecutive ids' levels leave no gap in (0, 1) wider than 3 / 100 (golden-ratio sequence)."""
    for start in (0, 1234):
        us = sorted(level(i) for i in range(start, start + 100))
        gaps = [b - a for a, b in zip([0.0] + us, us + [1.0])]
        assert 0 < us[0] and us[-1] < 1, "levels inside (0, 1)"
        assert max(gaps) < 3 / 100, f"largest gap {max(gaps)} from id {start}"
    assert level(7) == level(7), "a level is fixed for an execution's life"


def test_drawn_remaining_uses_own_pace_after_a_segment():
    """After a segment: drawn segments x its own seconds per segment; before: the duration distribution given
    its age, times its engine's load factor; with nothing finished, no draw."""
    h = History(segments=(1, 3), seg_s=4.0)
    sp = Durations([10, 20, 30, 40], [], 1.0)
    x = Ex(id=0, turns_done=1, started_at=0.0)  # 1 segment in 6 s
    u = level(0)
    assert drawn_remaining_s(x, h, sp, 6.0, 1.0) == h.draw_segments(1, u, 1.0) * 6.0, "own pace"
    y = Ex(id=3, turns_done=0, started_at=5.0)
    assert drawn_remaining_s(y, h, sp, 20.0, 1.0, load=2.0) == pytest.approx(sp.remaining(15.0, level(3)) * 2.0), \
        "the duration distribution at its age, times the load factor"
    assert drawn_remaining_s(y, h, Durations([], [], 1.0), 20.0, 1.0) is None, "nothing finished yet"


def test_a_batch_of_draws_is_ready_at_its_last_finish_not_its_mean():
    """1,000 executions started together, durations 1..1000 s observed: the latest of their draws is near
    the longest duration (the batch's last finish), while each one's mean is 500.5."""
    sp = Durations(range(1, 1001), [], 1.0)
    last = max(sp.remaining(0.0, level(i)) for i in range(1000))
    assert last >= 990, f"the batch's predicted last finish {last}"
    mean = sum(sp.remaining(0.0, level(i)) for i in range(1000)) / 1000
    assert 480 <= mean <= 520, f"draws keep the mean: {mean}"


def test_deadline_cap_by_hand():
    """Step time 1 + n s; an engine at 4 sequences (step 5 s) holds one execution 50 s from its end and
    100 s from its deadline: it affords steps of 5 x 100 / 50 = 10 s, so 9 sequences; one that misses even
    alone sets no cap; none at risk: the limit."""
    step = lambda n: 1.0 + n  # noqa: E731
    assert deadline_cap([(50.0, 100.0)], 0.0, step, 4, 60) == 9, "1 + 9 = 10 s per step"
    assert deadline_cap([(50.0, 100.0), (10.0, 12.0)], 0.0, step, 4, 60) == 5, "the tighter one: 5 x 12 / 10 = 6 s"
    assert deadline_cap([(500.0, 100.0)], 0.0, step, 4, 60) == 60, "misses even alone (500 x 2 / 5 > 100): no cap"
    assert deadline_cap([(50.0, math.inf)], 0.0, step, 4, 60) == 60, "no deadline: the limit"
    assert deadline_cap([(50.0, 100.0)], 0.0, step, 4, 7) == 7, "never above the limit"


@dataclass
class _Engine:
    id: int = 0
    admit_limit: int = 60
    n_live: int = 4
    kv_used: float = 0.0


class _Cluster:
    """A stand-in with a clock, live executions and an estimate whose step is 1 + n seconds."""

    def __init__(self, now: float, live: list) -> None:
        self.now, self._live = now, live
        self.estimate = type("E", (), {"step_s": staticmethod(lambda n, kv: 1.0 + n)})()

    def live(self) -> list:
        return self._live


def test_deadline_caps_by_hand():
    """Finished executions of 2, 4 and 10 segments; a live one 1 segment in at 6 s per segment expects 13/3
    more (26 s), 94 s before its deadline, on an engine at 4 sequences (5 s steps): it affords steps of
    5 x 94 / 26 = 18.08 s, so 17 sequences; an engine carrying no execution with a deadline keeps its limit."""
    h = History(segments=(2, 4, 10), seg_s=4.0)
    x = Ex(id=0, turns_done=1, started_at=0.0, deadline_at=100.0)
    cl = _Cluster(6.0, [x])
    assert remaining_s(x, h, 6.0, 1.0) == pytest.approx(26.0), "13/3 segments expected at its own 6 s"
    caps = DeadlineCaps(cl, lambda: (lambda x, load: remaining_s(x, h, 6.0, 1.0, load)), lambda: {})
    assert caps(_Engine()) == 17, "1 + 17 = 18 <= 18.08 s"
    assert caps(_Engine(id=1)) == 60, "nothing with a deadline on engine 1"
