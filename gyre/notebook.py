"""Small helpers for the notebooks: tables and inline figures from run results and trace fits.

Everything takes results duck-typed (anything with `.policy`, `.log`, `.metrics`, `.bound`, `.config`
and `.makespan_s`: a gyre.sim.harness.runner.SimResult, or a gyre.real.runner.RealResult for the figures),
so this module imports no backend: not gyre.sim, not ray, not torch. Figures are returned, not
saved or closed, so a notebook with `%matplotlib inline` shows each one once at the end of its cell.

The colors and role names are the ones gyre.plots writes to PNG files (copied here because
importing gyre.plots selects matplotlib's Agg backend, which would hide inline figures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from gyre.metrics import TIMELINE_NAMES, role_matrix

ROLE_COLORS = ["#d9d9d9", "#1f77b4", "#d62728", "#ff7f0e", "#aec7e8"]  # = gyre.plots.ROLE_COLORS
GPU_HOURS = ["rollout_busy", "rollout_idle", "train", "switching", "idle"]
GPU_HOURS_COLORS = ["#1f77b4", "#aec7e8", "#d62728", "#ff7f0e", "#d9d9d9"]


def _runs(results: Mapping[str, Any] | Sequence[Any]) -> list[tuple[str, Any]]:
    if isinstance(results, Mapping):
        return list(results.items())
    return [(r.policy, r) for r in results]


def summary(results: Mapping[str, Any] | Sequence[Any], baseline: str | None = None) -> pd.DataFrame:
    """One row per run: makespan, utilization, distance to the lower bound, the work it did (deadline
    cuts, those the scheduler caused, tokens generated), and the speedup over the run named `baseline`
    (if given and present)."""
    rows = []
    for name, r in _runs(results):
        s = r.metrics.summary()
        rows.append({
            "policy": name,
            "makespan_h": r.makespan_s / 3600,
            "median_step_min": s["median_step_s"] / 60,
            "utilization": s["utilization"],
            "vs_bound": r.makespan_s / r.bound.makespan_s if getattr(r, "bound", None) else np.nan,
            "staleness_max": s["staleness_max"],
            "migrations": s["migrations"],
            "deadline_hit": s["deadline_hit"],
            "sched_cuts": s.get("sched_cuts", np.nan),
            "tokens_generated": s["tokens_generated"],
        })
    df = pd.DataFrame(rows).set_index("policy")
    if baseline is not None and baseline in df.index:
        df.insert(1, f"speedup_vs_{baseline}", df.loc[baseline, "makespan_h"] / df["makespan_h"])
    return df.sort_values("makespan_h")


def timeline(results: Mapping[str, Any] | Sequence[Any], bins: int = 600):
    """GPU (y) x hours (x), colored by role, one panel per run, on a shared time axis."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    runs = _runs(results)
    horizon = max(r.makespan_s for _, r in runs) or 1.0
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.6 * len(runs) + 0.7), squeeze=False, sharex=True)
    for ax, (name, r) in zip(axes[:, 0], runs):
        n = r.metrics.n_gpus
        m = role_matrix(r.log, n, r.makespan_s, bins=max(2, int(bins * r.makespan_s / horizon)))
        ax.imshow(m, aspect="auto", interpolation="nearest", cmap=ListedColormap(ROLE_COLORS), vmin=0, vmax=4,
                  extent=(0, r.makespan_s / 3600, n, 0))
        ax.set_xlim(0, horizon / 3600)
        ax.set_ylabel("GPU")
        ax.set_title(f"{name}: {r.makespan_s / 3600:.2f} h", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("hours")
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLORS], TIMELINE_NAMES,
               loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def utilization(results: Mapping[str, Any] | Sequence[Any]):
    """Share of GPUs in rollout and in training over time, one line per run."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.0), sharey=True)
    for name, r in _runs(results):
        df, n = r.metrics.utilization, r.metrics.n_gpus
        axes[0].plot(df["t_s"] / 3600, df["rollout"] / n, label=name)
        axes[1].plot(df["t_s"] / 3600, df["train"] / n, label=name)
    for ax, title in zip(axes, ("GPUs in rollout", "GPUs training")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("hours")
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("share of GPUs")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def breakdown(results: Mapping[str, Any] | Sequence[Any]):
    """Where the GPU-hours went (stacked by role), and how long each training step took."""
    import matplotlib.pyplot as plt

    runs = _runs(results)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.2))
    bottom = np.zeros(len(runs))
    names = [name for name, _ in runs]
    for key, color in zip(GPU_HOURS, GPU_HOURS_COLORS):
        vals = np.array([r.metrics.gpu_seconds[key] / 3600 for _, r in runs])
        ax0.bar(names, vals, bottom=bottom, color=color, label=key)
        bottom += vals
    ax0.set_ylabel("GPU-hours")
    ax0.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    for name, r in runs:
        st = r.metrics.steps
        ax1.plot(st["version"], st["duration_s"] / 60, "o-", label=name)
    ax1.xaxis.get_major_locator().set_params(integer=True)
    ax1.set_xlabel("step (version produced)")
    ax1.set_ylabel("step time (min)")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fit_plots(model: Mapping[str, np.ndarray], held: Mapping[str, np.ndarray], names: Sequence[str]):
    """Per quantity: CDF, QQ (held-out vs model quantiles) and the survival tail on log-log axes."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(names), 3, figsize=(11, 3.0 * len(names)), squeeze=False)
    p = np.linspace(0.001, 0.9995, 400)
    for (cdf, qq, tail), name in zip(axes, names):
        for data, label in ((held[name], "held out"), (model[name], "calibrated")):
            xs = np.sort(np.maximum(np.asarray(data, dtype=float), 1e-9))
            frac = np.arange(1, len(xs) + 1) / len(xs)
            cdf.plot(xs, frac, label=label)
            tail.loglog(xs, 1.0 - frac + 1.0 / len(xs), label=label)
        qm, qt = np.quantile(model[name], p), np.quantile(held[name], p)
        qq.loglog(np.maximum(qt, 1e-9), np.maximum(qm, 1e-9), ".", ms=3)
        lo, hi = max(min(qt.min(), qm.min()), 1e-9), max(qt.max(), qm.max())
        qq.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        cdf.set_xscale("log")
        cdf.set_title(f"{name}: CDF", fontsize=9)
        cdf.legend(fontsize=8)
        qq.set_title(f"{name}: QQ", fontsize=9)
        qq.set_xlabel("held-out quantile")
        qq.set_ylabel("calibrated quantile")
        tail.set_title(f"{name}: tail, P(X > x)", fontsize=9)
    fig.tight_layout()
    return fig
