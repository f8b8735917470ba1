"""Length caps: an execution is capped exactly when a cap cut it (no spurious caps on single-turn workloads)."""

from __future__ import annotations

from dataclasses import replace

from gyre.presets import short_math, xlong_swe
from gyre.workload import WorkloadSource


def test_short_math_capped_iff_cut_at_the_token_cap():
    """Single turn, 8,192-token cap: capped exactly when the generation sits at the cap (a few %, not half)."""
    src = WorkloadSource(short_math(), seed=5)
    ex = [e for _ in range(40) for e in src.next_group().executions]
    assert all(e.capped == (e.gen[-1] == 8192) for e in ex), "capped must mean cut at the token cap"
    assert all(max(e.gen) <= 8192 for e in ex)
    assert 0 < sum(e.capped for e in ex) < 0.1 * len(ex), sum(e.capped for e in ex)


def test_turn_cap_marks_only_cut_executions():
    """A turn cap of 100 (median draw 120) cuts long executions to 100 turns (capped); shorter ones are not capped."""
    w = replace(xlong_swe(), max_turns=100, group_size=8)
    src = WorkloadSource(w, seed=1)
    ex = [e for _ in range(20) for e in src.next_group().executions]
    assert all(len(e.gen) <= 100 for e in ex)
    assert all(len(e.gen) == 100 for e in ex if e.capped)
    assert any(e.capped for e in ex) and any(not e.capped for e in ex)
