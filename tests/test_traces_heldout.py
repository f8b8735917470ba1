"""Calibration on data it has not seen: drift as a held-out choice and bounded, finite tails clamped at
the context window, the max of K (median and mean, K <= held-out size), per-execution prompts."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from gyre.traces.workload_fit import WorkloadFitOptions, fit_workload
from gyre.traces.calibrated import CalibratedSource, load_workload, sample_quantities
from gyre.traces.tail_dist import fit_quality, fit_tail_dist, mean_max
from gyre.traces.formats import load_trace
from gyre.traces.readers import Grouping
from gyre.traces.schema import Trace
from gyre.workload import ExecutionSpec, GroupSpec


def _dip_requests(path, n=6000, seed=0):
    """A request JSONL whose median output dips from ~210 to ~90 tokens mid-trace and recovers."""
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0, 3600, n))
    med = np.where((t > 1200) & (t < 2200), 90.0, 210.0)
    out = np.maximum(1, np.round(med * rng.lognormal(0, 0.6, n))).astype(int)
    inp = np.maximum(1, np.round(rng.lognormal(7, 1, n))).astype(int)
    path.write_text("".join(json.dumps({"timestamp": float(a), "input_length": int(b), "output_length": int(c)}) + "\n"
                            for a, b, c in zip(t, inp, out)))
    return path


def _rollout(lengths_per_step: list[np.ndarray], group_size=8) -> Trace:
    """An in-memory rollout trace (no arrival times) of one-segment executions, steps in order."""
    groups, eid = [], 0
    for step, xs in enumerate(lengths_per_step):
        for g0 in range(0, len(xs), group_size):
            gid = len(groups)
            ex = []
            for x in xs[g0:g0 + group_size]:
                ex.append(ExecutionSpec(exec_id=eid, group_id=gid, task_id=gid, step=step, prompt=100, gen=[int(x)],
                                        tool_s=[], tool_out=[], kv=[100], branches=[], capped=False,
                                        deadline_s=math.inf))
                eid += 1
            groups.append(GroupSpec(group_id=gid, task_id=gid, step=step, executions=ex))
    return Trace(path="mem", groups=groups)


def test_mean_max_equals_enumeration():
    """The mean of the max of k draws equals the average over all n**k ordered draws (with replacement)."""
    x = np.array([3.0, 1.0, 7.0, 7.0, 2.0])
    for k in (1, 2, 3):
        brute = np.mean([max(c) for c in itertools.product(x, repeat=k)])
        assert mean_max(x, k) == pytest.approx(brute, rel=1e-12), f"k={k}"


def test_k_is_capped_at_the_held_out_size():
    """A max over more draws than were held out is not reported: K becomes the held-out count."""
    rng = np.random.default_rng(0)
    q = fit_quality(rng.lognormal(3, 1, 50_000), rng.lognormal(3, 1, 84), 304)
    assert q["k"] == 84, q["k"]
    assert {"maxk_err", "maxk_mean_err", "maxk_mean_model", "maxk_mean_test"} <= set(q), sorted(q)


def test_infinite_mean_tail_falls_back_to_empirical():
    """Pareto data with shape 1.25 (no finite mean): the fit keeps the data's own tail and says so."""
    rng = np.random.default_rng(1)
    x = np.round(100 * (1 + rng.pareto(0.8, 20_000)))
    d = fit_tail_dist(x, upper=131072.0)
    assert "empirical tail" in d.note, d.note
    s = d.sample(np.random.default_rng(2), 500_000)
    assert s.max() <= min(x.max(), 131072.0), f"drew {s.max()} above the largest seen {x.max()} or the window"
    assert np.isfinite(d.mean_max(512)), "a finite mean of the max"


def test_finite_tail_is_clamped_at_upper():
    """A GPD tail may extrapolate past the data, never past the clamp."""
    rng = np.random.default_rng(3)
    x = np.round(50 * (1 + rng.pareto(1.6, 30_000)))
    d = fit_tail_dist(x, upper=2000.0)
    s = d.sample(np.random.default_rng(4), 1_000_000)
    assert s.max() <= 2000.0, s.max()


def test_request_trace_with_a_dip_keeps_drift_off(tmp_path):
    """A mid-trace dip in a request trace is not extrapolated: auto drift is off, and the report says why."""
    tr = load_trace(_dip_requests(tmp_path / "dip.jsonl"), grouping=Grouping(group_size=8, groups_per_step=16))
    cw = fit_workload(tr, WorkloadFitOptions(split=0.7, model_draws=50_000))
    assert cw.drift_per_step == 0.0, cw.drift_per_step
    assert cw.report["drift"]["chosen"] == "off" and "arrivals" in cw.report["drift"]["why"], cw.report["drift"]


def test_linear_drift_is_bounded(tmp_path):
    """--drift linear on the dip fits a slope, but at step 200 lengths stay within the levels and range seen."""
    tr = load_trace(_dip_requests(tmp_path / "dip.jsonl"), grouping=Grouping(group_size=8, groups_per_step=16))
    cw = fit_workload(tr, WorkloadFitOptions(split=0.7, drift="linear", model_draws=50_000))
    assert cw.drift_per_step < 0, f"the first 70% dips: slope {cw.drift_per_step}"
    lo, hi = cw.drift_range
    assert 0 < lo <= 1 <= hi, cw.drift_range
    x = sample_quantities(cw, np.full(2000, 200.0), seed=0)["length"]
    seen = cw.length_range
    assert x.min() >= seen[0], f"drift drew {x.min()} below the smallest seen {seen[0]}"
    med = np.median(x)
    base = np.median(sample_quantities(cw, np.zeros(2000), seed=0)["length"])
    assert med >= 0.9 * lo * base, f"median at step 200 {med} is below the lowest level seen ({lo} x {base})"
    cw.save(tmp_path / "w.json")
    again = load_workload(tmp_path / "w.json")
    assert (again.drift_range, again.length_range) == (cw.drift_range, cw.length_range), "bounds survive the file"
    src = CalibratedSource(again, seed=0, first_step=200)
    gen = [e.gen[0] for _ in range(40) for e in src.next_group().executions]
    assert min(gen) >= seen[0] and np.median(gen) >= 0.9 * lo * base, (min(gen), np.median(gen))


def test_rollout_drift_kept_only_when_it_helps_held_out():
    """Rollout traces: a steady growth is kept as drift; a dip that recovers is not."""
    rng = np.random.default_rng(5)
    grow = [np.round(50 * 1.03**s * rng.lognormal(0, 0.4, 64)) for s in range(40)]
    cw = fit_workload(_rollout(grow), WorkloadFitOptions(split=0.7, model_draws=20_000))
    assert cw.report["drift"]["chosen"] == "linear", cw.report["drift"]
    assert cw.drift_per_step == pytest.approx(0.03, abs=0.01), cw.drift_per_step
    dip = [np.round((50 if s < 10 or s > 20 else 20) * rng.lognormal(0, 0.4, 64)) for s in range(40)]
    cw = fit_workload(_rollout(dip), WorkloadFitOptions(split=0.7, model_draws=20_000))
    assert cw.report["drift"]["chosen"] == "off", cw.report["drift"]


def test_request_prompts_are_drawn_per_execution(tmp_path):
    """In a calibrated request workload the requests of a group have their own prompts."""
    tr = load_trace(_dip_requests(tmp_path / "r.jsonl", n=2000), grouping=Grouping(group_size=8, groups_per_step=16))
    cw = fit_workload(tr, WorkloadFitOptions(split=0.7, model_draws=20_000))
    g = CalibratedSource(cw, seed=0).next_group()
    assert len({e.prompt for e in g.executions}) > 1, [e.prompt for e in g.executions]
    assert all(e.kv == [e.prompt] for e in g.executions), "one-segment executions hold their own prompt"


def test_no_draw_above_the_context_window(tmp_path):
    """Prompts and outputs from a heavy-tailed request trace are clamped at the context window."""
    rng = np.random.default_rng(6)
    n = 5000
    inp = np.minimum(np.round(500 * (1 + rng.pareto(0.9, n))), 100_000).astype(int)
    out = np.round(20 * (1 + rng.pareto(0.95, n))).astype(int)
    p = tmp_path / "heavy.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": int(a), "output_length": int(b)}) + "\n"
                         for i, (a, b) in enumerate(zip(inp, out))))
    cw = fit_workload(load_trace(p), WorkloadFitOptions(split=0.7, model_draws=20_000))
    window = cw.base.context_window
    x = sample_quantities(cw, np.zeros(200_000), seed=0)
    assert x["prompt"].max() <= window and x["length"].max() <= window, (x["prompt"].max(), x["length"].max(), window)
    for name, t in cw.report["tails"].items():
        assert t["clamp"] == window, f"{name} clamp {t['clamp']}"


def test_quantities_equal_a_plain_loop():
    """The flat per-quantity arrays equal a plain loop over a multi-turn trace's executions."""
    import dataclasses

    from gyre.presets import xlong_swe
    from gyre.traces.heldout import quantities
    from gyre.workload import WorkloadSource

    src = WorkloadSource(dataclasses.replace(xlong_swe(), groups_per_step=2), 7)
    groups = [src.next_group() for _ in range(6)]
    q = quantities(groups, "turns")
    ex = [(gi, e) for gi, g in enumerate(groups) for e in g.executions]
    ref = {"gen": [x for _, e in ex for x in e.gen], "turns": [len(e.gen) for _, e in ex],
           "tool_s": [x for _, e in ex for x in e.tool_s], "tool_out": [x for _, e in ex for x in e.tool_out],
           "prompt": [e.prompt for _, e in ex], "step": [e.step for _, e in ex], "group": [gi for gi, _ in ex],
           "capped": [e.capped for _, e in ex], "length": [len(e.gen) for _, e in ex]}
    for k, v in ref.items():
        assert q[k].tolist() == v, k
    assert quantities(groups, "gen")["length"].tolist() == [e.gen[0] for _, e in ex], "single-turn length"


def test_gpd_fit_covers_the_largest_value_without_warnings():
    """A light body with one far value: the MLE starts where the likelihood is finite, ends with a support
    that holds the largest value, and no numpy/scipy warning reaches the user."""
    import warnings

    from gyre.traces.tail_dist import gpd_mle

    rng = np.random.default_rng(0)
    y = np.concatenate([np.abs(rng.normal(10, 1, 5000)), [100.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xi, sigma = gpd_mle(y)
    assert xi >= 0 or 1 + xi * y.max() / sigma > 0, f"support ends at {-sigma / xi:.1f} < max {y.max()}"


def test_gpd_shape_stays_regular_on_a_bounded_tail():
    """Excesses piled against a limit (uniform: GPD shape -1, where the likelihood is unbounded) give the
    boundary shape -0.5 with a support that still holds the largest value, not a density spiking there."""
    from gyre.traces.tail_dist import XI_MIN, gpd_mle

    y = np.random.default_rng(3).uniform(0, 1000, 4000)
    xi, sigma = gpd_mle(y)
    assert xi == XI_MIN == -0.5, xi
    assert 1 + xi * y.max() / sigma > 0, f"support ends at {sigma / -xi:.1f} < max {y.max():.1f}"


def test_tail_fit_reproduces_data_that_pile_up_at_a_limit():
    """Prompts truncated at a context limit (lognormal, 3% clipped to within 3 tokens of 7,437, as the Azure
    code trace's are): the fitted distribution matches its own data (KS D < 0.01), where the unconstrained
    GPD shape made a 0.046 in-sample misfit on that trace."""
    from gyre.traces.tail_dist import _ecdf_distances, fit_tail_dist

    rng = np.random.default_rng(5)
    x = np.round(rng.lognormal(np.log(2000), 0.9, 6000))
    over = x > 7437
    x[over] = 7437 - rng.integers(0, 3, over.sum())
    d = fit_tail_dist(x, k=512, upper=131072)
    m = d.sample(np.random.default_rng(1), 200_000)
    ks = _ecdf_distances(m, x)[0]
    assert ks < 0.01, (ks, d.kind, d.u, d.p_tail, d.xi)


def _step_requests(path, n=3000, change=1000, seed=0):
    """A request JSONL whose median output drops from 720 to 595 tokens after request `change`, for good."""
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0, 3600, n))
    med = np.where(np.arange(n) < change, 720.0, 595.0)
    out = np.maximum(1, np.round(med * rng.lognormal(0, 0.3, n))).astype(int)
    inp = np.maximum(1, np.round(rng.lognormal(7, 1, n))).astype(int)
    path.write_text("".join(json.dumps({"timestamp": float(a), "input_length": int(b), "output_length": int(c)}) + "\n"
                            for a, b, c in zip(t, inp, out)))
    return path


def test_a_lasting_change_is_fitted_from_the_recent_window(tmp_path):
    """A request mix that changed for good a third into the trace: auto recency fits the most recent quarter of
    the fitted part (the only window wholly after the change), which predicts the held-out end within KS D
    0.07 where all of it misses by > 0.15; a
    stationary trace (and --recent all) keeps every fitted request."""
    tr = load_trace(_step_requests(tmp_path / "step.jsonl"), grouping=Grouping(group_size=8, groups_per_step=16))
    auto = fit_workload(tr, WorkloadFitOptions(split=0.7, model_draws=50_000, recent="auto"))
    every = fit_workload(tr, WorkloadFitOptions(split=0.7, model_draws=50_000, recent="all"))
    assert auto.report["recent"]["chosen"] == 0.25, auto.report["recent"]
    n_all, n_auto = every.report["fitted"], auto.report["fitted"]
    assert n_all >= 2096 and abs(n_auto - n_all / 4) <= 8, (n_all, n_auto)
    assert auto.report["quality"]["gen"]["ks_d"] < 0.07, auto.report["quality"]["gen"]
    assert every.report["quality"]["gen"]["ks_d"] > 0.15, every.report["quality"]["gen"]
    still = load_trace(_step_requests(tmp_path / "flat.jsonl", change=0), grouping=Grouping(group_size=8,
                                                                                             groups_per_step=16))
    flat = fit_workload(still, WorkloadFitOptions(split=0.7, model_draws=50_000, recent="auto"))
    assert flat.report["recent"]["chosen"] == 1.0, flat.report["recent"]
    with pytest.raises(Exception, match="unknown recency mode"):
        WorkloadFitOptions(recent="sometimes")
