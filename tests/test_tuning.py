"""The tuning searches: the refining search finds the exhaustive grid's best where the makespan is
unimodal in the axis, runs fewer points than the grid, and async's grid is every engine multiple."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.policies import ClusterShape, sweep, tuner
from gyre.policies.async_split import AsyncSplit
from gyre.policies.tuning import drive, exhaustive, refine_axis


def test_async_grid_is_every_engine_multiple_leaving_the_trainer_its_minimum():
    """Async's grid: R = 32, 64, ..., N - minimum (engine multiples), times every eta."""
    shape = ClusterShape(n_gpus=1024, gpus_per_engine=32, min_train_gpus=328)
    rs = AsyncSplit.splits(shape)
    assert rs == list(range(32, 697, 32)), rs
    assert all(1024 - r >= 328 for r in rs)
    grid = sweep("async", shape, (0, 1, 2, 4))
    assert len(grid) == len(rs) * 4
    assert {g["eta"] for g in grid} == {0, 1, 2, 4}


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 120), best=st.integers(0, 119), etas=st.lists(st.integers(0, 6), min_size=1, max_size=4,
                                                                     unique=True),
       slopes=st.lists(st.floats(0.01, 10.0), min_size=2, max_size=2), seed=st.integers(0, 10**6))
def test_refine_finds_the_grid_best_on_unimodal_curves(n, best, etas, slopes, seed):
    """On any curve unimodal in the axis (per eta), the search's best equals the exhaustive grid's."""
    best = best % n
    rng = np.random.default_rng(seed)
    offsets = {e: float(rng.uniform(0, 5)) for e in etas}
    values = [8 * (i + 1) for i in range(n)]

    def f(p):
        i = values.index(p["rollout_gpus"])
        d = i - best
        return offsets[p["eta"]] + (slopes[0] * -d if d < 0 else slopes[1] * d) + 0.001 * i

    grid = [{"rollout_gpus": v, "eta": e} for v in values for e in etas]
    truth = min(f(p) for p in grid)
    tried = drive(refine_axis("rollout_gpus", values, etas), lambda batch: [f(p) for p in batch])
    assert min(m for _, m in tried) == truth, (n, best, etas)
    assert len({(p["rollout_gpus"], p["eta"]) for p, _ in tried}) == len(tried), "a point was run twice"
    if n >= 32:
        assert len(tried) < len(grid) / 2, f"search ran {len(tried)} of {len(grid)}"


def test_exhaustive_is_one_batch_and_tuner_falls_back_to_the_grid():
    """A policy without `search` is tuned over its whole grid in one batch."""
    shape = ClusterShape(n_gpus=8, gpus_per_engine=1, min_train_gpus=2)
    batches = []
    drive(tuner("elastic", shape, (0, 1, 2, 4)), lambda b: batches.append(b) or [1.0] * len(b))
    assert batches == [[{"eta": 0}, {"eta": 1}, {"eta": 2}, {"eta": 4}]]
    assert drive(exhaustive([]), lambda b: []) == []


def test_tune_reports_hindsight_and_pilot_async_and_the_best_baseline_column():
    """`tune` on a small run: async tuned with hindsight (its best tried run) and on a pilot of steps // 6
    steps, each row says how; speedup_vs_best divides by the faster hindsight baseline."""
    from gyre.config import override
    from gyre.presets import get_preset
    from gyre.sim.harness.compare import tune, tuned_table

    cfg = override(get_preset("short-math"), **{"steps": 6, "cluster.gpus": 8, "workload.groups_per_step": 4})
    tuned = tune(cfg, ["colocate", "async"], etas=(0, 4), workers=1)
    assert list(tuned) == ["colocate", "async-eta0", "async-eta4", "async", "async-pilot"], list(tuned)
    hind, pilot = tuned["async"], tuned["async-pilot"]
    assert hind.how.startswith("hindsight") and pilot.how.startswith("pilot (1 of 6 steps)"), (hind.how, pilot.how)
    assert hind.result.makespan_s == min(m for c, _, m in hind.tried if c.steps == 6)
    assert all(c.steps == 1 for c, _, _ in pilot.tried)
    assert pilot.result.config.steps == 6, "the pilot's choice is then run in full"
    _, table, sweep = tuned_table(tuned)
    best = min(tuned["colocate"].result.makespan_s, hind.result.makespan_s)
    for _, r in table.iterrows():
        assert r["speedup_vs_best"] == best / r["makespan_s"], r["policy"]
    assert set(sweep["row"]) == {"colocate", "async-eta0", "async-eta4", "async", "async-pilot"}
    for e in (0, 4):
        at = tuned[f"async-eta{e}"]
        assert at.best.params["eta"] == e and at.result.makespan_s == min(
            m for c, cand, m in hind.tried if cand.params["eta"] == e), f"async-eta{e} is async's best at eta {e}"
    assert tuned["async"].best.label in {tuned["async-eta0"].best.label, tuned["async-eta4"].best.label}


def test_async_search_finds_the_exhaustive_grid_best_on_a_simulated_run():
    """On a small simulated short-math run, async's split search (coarse pass + bisection) comes within 1% of the
    best of every (R, eta) in its grid, in fewer runs than the grid. (Not exactly: near its best split the
    simulated makespan is flat with dips of a fraction of a percent, not unimodal.)"""
    from gyre.config import override
    from gyre.presets import get_preset
    from gyre.sim.harness.compare import shape_of
    from gyre.sim.harness.runner import simulate

    cfg = override(get_preset("short-math"), **{"steps": 3, "cluster.gpus": 16, "workload.groups_per_step": 6,
                                                "workload.group_size": 4})
    shape = replace(shape_of(cfg), admit_limit=None)  # the split axis alone (the caps: tests/test_equal_work.py)
    grid = sweep("async", shape, (0, 1, 2, 4))
    makespan = {tuple(sorted(p.items())): simulate(cfg, "async", p).makespan_s for p in grid}
    tried = drive(tuner("async", shape, (0, 1, 2, 4)), lambda b: [makespan[tuple(sorted(p.items()))] for p in b])
    found, best = min(m for _, m in tried), min(makespan.values())
    assert found <= 1.01 * best, f"the search's best {found:.2f} s is over 1% above the grid's {best:.2f} s"
    assert len(tried) < len(grid), f"the search ran {len(tried)} of {len(grid)}"


def test_compare_table_has_a_row_per_eta_and_divides_by_async_at_the_same_eta():
    """`tune` with elastic and async over eta in {0, 1, 2, 4}: one row per eta for each, async's row tuned
    over eta besides, colocate at eta 0; each row's speedup_vs_async_same_eta is async's best at its eta
    over its makespan, and every row does equal work here (no deadline)."""
    from gyre.sim.harness.compare import tune, tuned_table
    from tests.simkit import tiny_config

    cfg = replace(tiny_config(gpus=4, steps=2), workload=replace(tiny_config().workload, deadline_s=float("inf")))
    tuned = tune(cfg, ["colocate", "async", "elastic"], pilot=False, workers=1)
    _, table, _ = tuned_table(tuned)
    rows = list(table["policy"])
    assert rows == ["colocate", *(f"async-eta{e}" for e in (0, 1, 2, 4)), "async",
                    *(f"elastic-eta{e}" for e in (0, 1, 2, 4))], rows
    t = table.set_index("policy")
    assert list(t["eta"]) == [0, 0, 1, 2, 4, t.loc["async", "eta"], 0, 1, 2, 4], list(t["eta"])
    for e in (0, 1, 2, 4):
        want = t.loc[f"async-eta{e}", "makespan_s"] / t.loc[f"elastic-eta{e}", "makespan_s"]
        assert t.loc[f"elastic-eta{e}", "speedup_vs_async_same_eta"] == want, e
    assert t.loc["colocate", "speedup_vs_async_same_eta"] == t.loc["async-eta0", "makespan_s"] / t.loc["colocate", "makespan_s"]
    assert t["equal_work"].all() and (t["sched_cuts"] == 0).all(), t[["sched_cuts", "equal_work"]]


def test_tune_returns_every_row_with_its_full_run_though_searches_keep_runs_without_logs():
    """A search keeps its runs without their event logs (a long run's log is gigabytes) and only each
    search's best so far in full; every row `tune` returns still carries its run's whole log, equal to a
    fresh run of the same candidate (a row whose log was dropped, or re-run differently, fails)."""
    from gyre.config import override
    from gyre.presets import get_preset
    from gyre.sim.harness.compare import tune
    from gyre.sim.harness.runner import simulate

    cfg = override(get_preset("short-math"), **{"steps": 6, "cluster.gpus": 8, "workload.groups_per_step": 4})
    tuned = tune(cfg, ["colocate", "async", "elastic"], etas=(0, 4), workers=1)
    assert {"async-pilot", "async-eta4", "elastic-eta0"} <= set(tuned), list(tuned)
    for key, t in tuned.items():
        fresh = simulate(cfg, t.best.policy, t.best.params)
        assert t.result.log and t.result.log == fresh.log, f"{key}: its log is not its run's"
        assert t.result.groups == fresh.groups and t.result.makespan_s == fresh.makespan_s, key
