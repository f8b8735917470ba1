"""The calibration report's marks and drift verdict, the bounded tail, and the figures' readability (units, no
overlap, legends outside)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gyre.traces.formats import load_trace
from gyre.traces.readers import Grouping
from gyre.traces.workload_fit import WorkloadFitOptions, fit_workload


def _requests(path, med_start, med_end, n=2400, seed=0):
    """Request JSONL whose median output moves from med_start to med_end (geometrically) across the trace."""
    rng = np.random.default_rng(seed)
    med = med_start * (med_end / med_start) ** np.linspace(0, 1, n)
    out = np.maximum(1, np.round(med * rng.lognormal(0, 0.4, n))).astype(int)
    inp = np.maximum(1, np.round(rng.lognormal(6, 0.5, n))).astype(int)
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": int(a), "output_length": int(b)}) + "\n"
                            for i, (a, b) in enumerate(zip(inp, out))))
    return load_trace(path, grouping=Grouping(group_size=8, groups_per_step=16))


def test_drifting_trace_is_named_drift_not_a_bad_model(tmp_path):
    """A trace whose median output falls from 160 to 17 tokens: the stationarity test says drift, the output length
    misses KS <= 0.10 on held-out data, and the verdict calls that drift, not a bad model."""
    cw = fit_workload(_requests(tmp_path / "d.jsonl", 160, 17), WorkloadFitOptions(split=0.7, model_draws=50_000))
    r = cw.report
    assert r["stationarity"]["verdict"] == "drift", r["stationarity"]
    gen = r["quality"]["gen"]
    assert gen["marks"]["ks_d"] is False and gen["ks_d"] > 0.10, gen
    assert gen["ks_data"] > gen["ks_data_crit"], "the held-out data differ from the fitted data beyond chance"
    assert "gen: the held-out data differ from the fitted data beyond chance" in r["verdict"], r["verdict"]
    assert "drift, not a bad model" in r["verdict"], r["verdict"]


def test_stationary_trace_meets_every_target(tmp_path):
    """A stationary trace: no drift, every mark met, the fit-side KS D near the held-out one, and the perfect-model
    KS D is 0.8687 / sqrt(n held)."""
    cw = fit_workload(_requests(tmp_path / "s.jsonl", 160, 160), WorkloadFitOptions(split=0.7, model_draws=50_000))
    r = cw.report
    assert r["stationarity"]["verdict"] == "stationary", r["stationarity"]
    assert r["verdict"] == "every quantity meets the targets", (r["verdict"], r["quality"])
    for q, m in r["quality"].items():
        assert all(m["marks"].values()), (q, m)
        assert m["ks_perfect"] == pytest.approx(0.8687 / np.sqrt(m["n_test"])), (q, m["ks_perfect"])
        assert m["ks_fit"] < 0.05, (q, m["ks_fit"])


@pytest.mark.parametrize("seed", range(4))
def test_tool_latency_tail_is_bounded_by_the_data(seed):
    """Tool latencies with a Pareto tail (shape 1/1.5 = 0.67, as a real agent trace fitted) and a known maximum of 65 s:
    the fitted distribution never draws past 65 x 1.15 s, its mean max of 200 is within 15% of the data's, and a Pareto
    tail whose max of 200 overshoots the held-out one is rejected."""
    from gyre.traces.tail_dist import fit_tail_dist, mean_max

    rng = np.random.default_rng(seed)
    x = 0.2 * (1 + rng.pareto(1.5, 6000))
    x = x[x <= 65.0][:5000]
    x[rng.integers(len(x))] = 65.0  # the largest observed
    d = fit_tail_dist(x, k=200)
    top = float(d.quantile(np.array([1 - 1e-12]))[0])
    assert top <= 65.0 * 1.15 + 1e-9, f"the model reaches {top:.1f} s past 65 x 1.15"
    assert d.mean_max(200) <= 1.15 * mean_max(x, 200), (d.mean_max(200), mean_max(x, 200))
    if seed in (0, 3):  # here every Pareto candidate overshot the inner held-out max of 200 and was rejected
        assert "overshoots the held-out end" in d.note and d.p_tail == 0, d.note


def test_time_axis_unit():
    """Short runs are plotted in seconds or minutes, long ones in hours."""
    from gyre.plots import time_unit

    assert [time_unit(s)[1] for s in (45.0, 119.0, 600.0, 7199.0, 40_000.0)] == \
        ["seconds", "seconds", "minutes", "minutes", "hours"]


def test_gpu_hours_labels_do_not_overlap_and_utilization_legend_is_outside(tmp_path):
    """Eleven policies: the GPU-hours chart's names do not overlap; the utilization figure draws identical runs as
    one line and puts its legend outside the axes, in minutes for a 3-minute run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from gyre import plots

    rows = [{"policy": f"policy-with-a-long-name-{i}", "gpu_h_rollout_busy": 1.0 + i, "gpu_h_rollout_idle": 0.2,
             "gpu_h_train": 0.5, "gpu_h_switching": 0.1, "gpu_h_idle": 0.3} for i in range(11)]
    captured = {}
    real_savefig = plt.Figure.savefig

    def grab(fig, path, **kw):  # measure the drawn figure before plots closes it
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        ax = fig.axes[0]
        leg = ax.get_legend()
        captured[Path(path).name] = {
            "yticks": [lab.get_window_extent(r) for lab in ax.get_yticklabels()],
            "legend": [t.get_text() for t in leg.get_texts()] if leg else [],
            "legend_x0": leg.get_window_extent(r).x0 if leg else None, "axes_x1": ax.get_window_extent(r).x1,
            "xlabel": fig.axes[-1].get_xlabel()}
        return real_savefig(fig, path, **kw)

    plt.Figure.savefig = grab
    try:
        plots.step_breakdown(rows, tmp_path / "gpu.png")
        t = np.linspace(0, 180, 50)
        a = pd.DataFrame({"t_s": t, "rollout": 32 + 0 * t, "train": 16 + 0 * t})
        b = pd.DataFrame({"t_s": t, "rollout": 16 + 0 * t, "train": 32 + 0 * t})
        plots.utilization([("x", a), ("y", a.copy()), ("z", b)], 64, tmp_path / "u.png")
    finally:
        plt.Figure.savefig = real_savefig
    boxes = captured["gpu.png"]["yticks"]
    assert len(boxes) == 11 and not any(boxes[i].overlaps(boxes[i + 1]) for i in range(10)), "labels overlap"
    u = captured["u.png"]
    assert u["legend"] == ["x = y", "z"], u["legend"]
    assert u["legend_x0"] >= u["axes_x1"], "legend outside the axes"
    assert u["xlabel"] == "minutes", u["xlabel"]


def test_a_gpd_tail_is_truncated_at_its_endpoint():
    """A fitted GPD tail (shape ~0.67) reaches orders of magnitude past the data unbounded; truncated at the
    endpoint (largest seen x 1.15) no quantile passes it, and the tail keeps its mass (the truncation
    renormalizes, it does not pile draws at the bound)."""
    from gyre.traces.tail_dist import _endpoint, _fit_tail

    rng = np.random.default_rng(0)
    x = 0.2 * (1 + rng.pareto(1.5, 5000))
    d = _fit_tail(x, 0.9, None, False)
    assert d is not None and d.p_tail > 0 and d.xi > 0.3, (d and d.xi)
    q = np.array([0.999, 1 - 1e-9])
    assert d.quantile(q)[1] > 100 * x.max(), "unbounded, the tail runs far past the data"
    d.endpoint = _endpoint(x, False)
    top = d.quantile(q)
    assert top[1] <= x.max() * 1.15 + 1e-9, top
    draws = d.sample(np.random.default_rng(1), 200_000)
    assert (draws >= d.endpoint * 0.999).mean() < 1e-3, "no pile-up at the endpoint"


def test_fit_figure_axes_start_at_the_data_not_1e9(tmp_path, monkeypatch):
    """Tool latencies with 30% zeros: the CDF's log axis starts at half the smallest positive latency (not 1e-9),
    its label carries the unit, and the zeros are counted in the legend."""
    import matplotlib.pyplot as plt

    from gyre.traces.heldout import fit_figures

    rng = np.random.default_rng(0)
    lines = []
    for i in range(400):
        tools = [0 if rng.random() < 0.3 else int(rng.lognormal(np.log(5e8), 1.0)) for _ in range(3)]
        reqs = [{"input_toks": 100 + 50 * j, "output_toks": 20, "tool_duration_ns": t} for j, t in enumerate(tools)]
        lines.append(json.dumps({"timestamp": i, "requests": reqs}))
    p = tmp_path / "z.jsonl"
    p.write_text("\n".join(lines) + "\n")
    tr = load_trace(p, grouping=Grouping(group_size=8, groups_per_step=8))
    opts = WorkloadFitOptions(split=0.7, model_draws=20_000)
    cw = fit_workload(tr, opts)
    seen = {}
    real = plt.Figure.savefig

    def grab(fig, path, **kw):
        for ax in fig.axes:
            seen[ax.get_xlabel()] = (ax.get_xlim(), [t.get_text() for t in ax.get_legend().get_texts()]
                                     if ax.get_legend() else [])
        return real(fig, path, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", grab)
    fit_figures(cw, tr, tmp_path / "fig", opts)
    (lo, _), legend = seen["tool_s (s)"]
    positive = min(t for g in tr.groups for e in g.executions for t in e.tool_s if t > 0)
    assert lo == pytest.approx(positive / 2, rel=1e-6) and lo > 1e-3, (lo, positive)
    assert any("zeros at the left edge" in t for t in legend), legend
