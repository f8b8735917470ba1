"""The real backend's scheduler-induced cuts (gyre.real.work): hand-checked counts from measured segments."""

from __future__ import annotations

from types import SimpleNamespace

from gyre.real.work import fastest_rates, scheduler_cuts, solo_lower_bound_s

# fastest decode 0.1 s per token (the batch-1 record), fastest prefill 0.01 s per token
PROFILE = {"engine_decode": [(4, 30, 0.4), (1, 10, 0.1), (2, 20, 0.25)],
           "engine_prefill": [(10, 0.5), (20, 0.2), (0, 0.0)]}


def ex(end: int, segs: list[dict], started: float = 10.0, budget: float = 5.0, prompt: int = 10):
    return SimpleNamespace(end=end, started_at=started, deadline_at=(started or 0.0) + budget, segs=segs,
                           group=SimpleNamespace(prompt_tokens=prompt))


def test_rates_are_the_fastest_measured():
    """The least per-token decode and prefill times the engines recorded; an empty prefill record is skipped."""
    assert fastest_rates(PROFILE) == (0.1, 0.01), fastest_rates(PROFILE)
    assert fastest_rates({}) == (0.0, 0.0)


def test_a_cut_counts_unless_its_run_part_alone_already_reaches_the_deadline():
    """Budget 5 s. A: 2 x 3 tokens, a 1 s tool, 4 tool tokens prefilled: alone >= 1 + 0.6 + 0.14 = 1.74 s, counted.
    B: a 4.8 s tool: alone >= 4.8 + 0.6 + 0.14 = 5.54 s, the workload's cut. C: finished, not a cut. D: cut but
    never started (no clock), not counted."""
    a = ex(2, [{"gen": 3, "kv": 10, "tool_s": 1.0}, {"gen": 3, "kv": 17}])
    b = ex(2, [{"gen": 3, "kv": 10, "tool_s": 4.8}, {"gen": 3, "kv": 17}])
    c = ex(0, [{"gen": 3, "kv": 10}])
    d = ex(2, [], started=None)
    assert abs(solo_lower_bound_s(a.segs, 10, 0.1, 0.01) - 1.74) < 1e-9, solo_lower_bound_s(a.segs, 10, 0.1, 0.01)
    assert abs(solo_lower_bound_s(b.segs, 10, 0.1, 0.01) - 5.54) < 1e-9
    assert scheduler_cuts([a, b, c, d], PROFILE) == {"sched_cuts": 1}
    assert scheduler_cuts([ex(2, a.segs, budget=1.7)], PROFILE) == {"sched_cuts": 0}, "1.74 s alone >= a 1.7 s budget"
