"""A trace cut by time into the part a workload is fitted on and the part held out, the per-execution quantities
both are read as, and a fitted workload judged on the held-out part (gyre.traces.workload_fit fits it).

The held-out groups are compared with groups drawn from the calibrated source for the same steps (at least
`WorkloadFitOptions.model_draws` segments and MIN_MODEL_DRAWS executions): per quantity, tail_dist.fit_quality
with K = the batch size, beside the same KS D against the fitted data (fit vs held out), the KS D a perfect
model would still show at the held-out size (the mean of Kolmogorov's distribution over sqrt(n): 0.8687 /
sqrt(n)) and the KS D of the held-out data against the fitted data themselves (what no stationary model can
beat). Each quantity is marked against TARGETS: KS D <= 0.10, p99 and the mean max of K within 15%.
`stationarity` tests the trace for drift across its time slices, so a changing trace is named as such;
`fit_figures` draws the comparison as CDF and QQ plots.
"""

from __future__ import annotations

import math
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from gyre.traces.calibrated import CalibratedWorkload, sample_quantities
from gyre.traces.schema import Trace
from gyre.traces.tail_dist import fit_quality
from gyre.workload import GroupSpec

if TYPE_CHECKING:
    from gyre.traces.workload_fit import WorkloadFitOptions

MIN_MODEL_DRAWS = 20_000
TARGETS = {"ks_d": 0.10, "p99_err": 0.15, "maxk_mean_err": 0.15}  # the calibration targets (each a maximum)
KS_CRIT_05 = 1.358  # Kolmogorov's distribution at 0.95: the two-sample KS critical value is this x sqrt((n+m)/nm)
KOLMOGOROV_MEAN = 0.8687  # E[sup|B(t)|] of a Brownian bridge: sqrt(n) x the mean KS D of a perfect model
DRIFT_SLICES = 4
DRIFT_ALPHA = 0.01  # family-wise, Bonferroni over the slices
UNITS = {"length": "", "turns": "turns", "gen": "tokens", "tool_s": "s", "tool_out": "tokens", "prompt": "tokens"}


def quantities(groups: list[GroupSpec], target: str) -> dict[str, np.ndarray]:
    """Flat arrays per quantity, plus per-execution step and group index (for drift/difficulty)."""
    ex = [e for g in groups for e in g.executions]
    n = len(ex)
    gens = list(map(attrgetter("gen"), ex))
    turns = np.fromiter(map(len, gens), dtype=np.int64, count=n)
    gen = np.fromiter(chain.from_iterable(gens), dtype=float, count=int(turns.sum()))
    sizes = np.fromiter((len(g.executions) for g in groups), dtype=np.int64, count=len(groups))
    out = {
        "gen": gen, "turns": turns.astype(float),
        "tool_s": np.fromiter(chain.from_iterable(map(attrgetter("tool_s"), ex)), dtype=float),
        "tool_out": np.fromiter(chain.from_iterable(map(attrgetter("tool_out"), ex)), dtype=float),
        "prompt": np.fromiter(map(attrgetter("prompt"), ex), dtype=float, count=n),  # per execution
        "step": np.fromiter(map(attrgetter("step"), ex), dtype=float, count=n),
        "group": np.repeat(np.arange(len(groups), dtype=float), sizes),
        "capped": np.fromiter(map(attrgetter("capped"), ex), dtype=bool, count=n),
    }
    out["length"] = out["turns"] if target == "turns" else gen[np.cumsum(turns) - turns]  # first segment's tokens
    return out


def split_groups(groups: list[GroupSpec], split: float) -> tuple[list[GroupSpec], list[GroupSpec]]:
    total = sum(len(g.executions) for g in groups)
    cum = np.cumsum([len(g.executions) for g in groups])
    cut = int(np.searchsorted(cum, split * total, side="left")) + 1
    return groups[:cut], groups[cut:]


def model_steps(cw: CalibratedWorkload, test: list[GroupSpec], opts: WorkloadFitOptions) -> np.ndarray:
    """The held-out groups' steps, repeated until the draws hold >= model_draws segments and
    >= MIN_MODEL_DRAWS executions (Monte Carlo error well under the held-out data's own)."""
    steps = np.array([g.step for g in test], dtype=float)
    n_exec = max(sum(len(g.executions) for g in test), 1)
    n_seg = max(sum(len(e.gen) for g in test for e in g.executions), 1)
    reps = max(1, math.ceil(opts.model_draws / n_seg), math.ceil(MIN_MODEL_DRAWS / n_exec))
    return np.tile(steps, reps)


def evaluate(cw: CalibratedWorkload, test: list[GroupSpec], k: int, opts: WorkloadFitOptions,
             fitted: dict[str, np.ndarray] | None = None, held: dict[str, np.ndarray] | None = None) -> dict[str, dict]:
    """fit_quality per quantity (the calibrated source's draws vs the held-out groups), with the fit-side KS D
    (against `fitted`, the fitted part's quantities, when given), a perfect model's KS D at the held-out size,
    the data's own fitted-vs-held-out KS D and the target marks. `held`: the test groups' quantities, if known."""
    model = sample_quantities(cw, model_steps(cw, test, opts), opts.seed)
    held = quantities(test, cw.scale_target) if held is None else held
    out = {}
    for name in ("length", "gen", "tool_s", "tool_out", "prompt"):
        if name == cw.scale_target or not (len(held[name]) and len(model[name])):
            continue  # the length *is* that quantity
        m = fit_quality(model[name], held[name], k)
        m["ks_perfect"] = KOLMOGOROV_MEAN / math.sqrt(len(held[name]))
        if fitted is not None and len(fitted[name]):
            nf, nh = len(fitted[name]), len(held[name])
            m["ks_fit"] = ks_d(model[name], fitted[name])
            m["ks_data"] = ks_d(fitted[name], held[name])
            m["n_fit"] = float(nf)
            m["ks_data_crit"] = KS_CRIT_05 * math.sqrt((nf + nh) / (nf * nh))  # two-sample, 5% level
        m["marks"] = {key: bool(m[key] <= t) for key, t in TARGETS.items()}
        out[cw.scale_target if name == "length" else name] = m
    return out


def ks_d(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample KS D."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, side="right") / len(a)
                        - np.searchsorted(b, grid, side="right") / len(b)).max())


def stationarity(x: np.ndarray, slices: int = DRIFT_SLICES) -> dict:
    """Drift test across the trace's time slices: the length x (turns or first-segment tokens, every execution in
    time order) of each slice against the first, by the two-sample KS test. Drift is reported when a slice differs at family-wise level
    DRIFT_ALPHA (Bonferroni) *and* by more than the KS target (a change smaller than the target does not
    matter to the fit)."""
    from scipy import stats

    n = len(x)
    if n < 8 * slices:
        return {"verdict": "untested", "why": f"{n} executions: too few for {slices} slices of 8 or more"}
    edges = np.linspace(0, n, slices + 1).astype(int)
    parts = [x[a:b] for a, b in zip(edges[:-1], edges[1:])]
    rows = []
    for i, p in enumerate(parts):
        row = {"slice": i + 1, "n": len(p), "median": float(np.median(p))}
        if i:
            r = stats.ks_2samp(parts[0], p)
            row.update(ks=float(r.statistic), p=float(r.pvalue))
        rows.append(row)
    alpha = DRIFT_ALPHA / (slices - 1)
    moved = [r for r in rows[1:] if r["p"] < alpha and r["ks"] > TARGETS["ks_d"]]
    meds = ", ".join(f"{r['median']:.4g}" for r in rows)
    kss = ", ".join(f"{r['ks']:.3f}" for r in rows[1:])
    if moved:
        worst = max(moved, key=lambda r: r["ks"])
        why = (f"the length drifts across the trace: medians by {slices} time slices {meds}; KS D vs the first "
               f"slice {kss} (slice {worst['slice']}: p {worst['p']:.1e} < {alpha:.4f})")
        return {"verdict": "drift", "why": why, "slices": rows}
    why = (f"no drift beyond the KS target across {slices} time slices (medians {meds}; KS D vs the first slice "
           f"{kss})")
    return {"verdict": "stationary", "why": why, "slices": rows}


def fit_figures(cw: CalibratedWorkload, trace: Trace, folder, opts: WorkloadFitOptions) -> list:
    """CDF and QQ plots (log x) of the calibrated draws against the held-out data and the fitted data, one row per
    quantity, each titled with its held-out KS D and errors against TARGETS. Values of 0 (a log axis cannot show
    them) are drawn at the left edge, half the smallest positive value, and counted in the legend; the axis
    starts there, not at 1e-9."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, test = split_groups(trace.groups, opts.split)
    model = sample_quantities(cw, model_steps(cw, test, opts), opts.seed)
    held = quantities(test, cw.scale_target)
    fitted = quantities(train, cw.scale_target)
    quality = cw.report.get("quality", {})
    names = [n for n in ("length", "gen", "tool_s", "tool_out", "prompt")
             if n != cw.scale_target and len(held[n]) and len(model[n])]
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.3 * len(names)), squeeze=False)
    p = np.linspace(0.001, 0.9995, 400)
    for row, n in zip(axes, names):
        label = cw.scale_target if n == "length" else n
        unit = UNITS.get(label, "") if UNITS.get(label) != label else ""
        series = ((fitted[n], "fitted data", "0.6"), (held[n], "held out", "C0"), (model[n], "calibrated", "C1"))
        pos = np.concatenate([d[d > 0] for d, _, _ in series])
        floor = float(pos.min()) / 2 if len(pos) else 1.0
        for data, what, color in series:
            xs = np.sort(data)
            zeros = int((xs <= 0).sum())
            tag = f"{what} (n {len(xs):,}" + (f", {zeros / len(xs):.0%} zeros at the left edge)" if zeros else ")")
            row[0].step(np.maximum(xs, floor), np.arange(1, len(xs) + 1) / len(xs), where="post", label=tag,
                        color=color, lw=1.2 if what != "fitted data" else 0.9)
        row[0].set_xscale("log")
        row[0].set_xlim(left=floor)
        m = quality.get(label)
        marks = ""
        if m:
            ok = m.get("marks", {})
            marks = (f": KS {m['ks_d']:.3f} {'ok' if ok.get('ks_d') else 'MISS'}, p99 {m['p99_err']:.0%} "
                     f"{'ok' if ok.get('p99_err') else 'MISS'}, max-of-{m['k']:.0f} {m['maxk_mean_err']:.0%} "
                     f"{'ok' if ok.get('maxk_mean_err') else 'MISS'}")
        row[0].set_title(f"{label}{marks}", fontsize=9, loc="left")
        row[0].set_xlabel(f"{label} ({unit})" if unit else label)
        row[0].set_ylabel("share <= x")
        row[0].legend(fontsize=7, loc="lower right")
        qm, qt = np.quantile(model[n], p), np.quantile(held[n], p)
        row[1].loglog(np.maximum(qt, floor), np.maximum(qm, floor), ".", ms=3)
        lo, hi = floor, max(qt.max(), qm.max(), floor * 2)
        row[1].plot([lo, hi], [lo, hi], "k--", lw=0.8)
        row[1].set_xlim(lo, hi * 1.2)
        row[1].set_ylim(lo, hi * 1.2)
        row[1].set_title(f"{label}: QQ, held out vs calibrated (on the line: a match)", fontsize=9, loc="left")
        row[1].set_xlabel(f"held-out quantile ({unit})" if unit else "held-out quantile")
        row[1].set_ylabel(f"calibrated quantile ({unit})" if unit else "calibrated quantile")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 3, 40, 0.5 rather than 3x10^0
    for ax in axes.flat:
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(plain if ax.get_xlim()[1] / ax.get_xlim()[0] < 20 else NullFormatter())
        if ax.get_yscale() == "log":
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain if ax.get_ylim()[1] / ax.get_ylim()[0] < 20 else NullFormatter())
    fig.suptitle(f"{Path(trace.path).name}: calibrated model vs data (targets: KS <= {TARGETS['ks_d']:.2f}, "
                 f"p99 and max-of-K within {TARGETS['p99_err']:.0%})", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    path = folder / "fit_cdf_qq.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
