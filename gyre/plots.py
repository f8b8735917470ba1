"""Figures: GPU-role timelines, utilization over time, step-time breakdowns (matplotlib, Agg).

Time axes are in the unit that fits the longest run (time_unit: seconds under 2 minutes, minutes under 2
hours, else hours). Runs get distinct colours (tab10, then tab10 with dashes: 20 before a repeat), and
legends sit outside the axes, so no line is covered."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

from gyre.metrics import TIMELINE_NAMES, role_matrix  # noqa: E402

ROLE_COLORS = ["#d9d9d9", "#1f77b4", "#d62728", "#ff7f0e", "#aec7e8"]


def time_unit(horizon_s: float) -> tuple[float, str]:
    """(seconds per unit, unit name) for a time axis spanning horizon_s."""
    if horizon_s < 120:
        return 1.0, "seconds"
    if horizon_s < 7200:
        return 60.0, "minutes"
    return 3600.0, "hours"


def _style(i: int) -> dict:
    """Line i's colour and dash: tab10's ten colours solid, then dashed (20 distinct before a repeat)."""
    return {"color": plt.get_cmap("tab10")(i % 10), "linestyle": "-" if i % 20 < 10 else "--"}


def role_timelines(runs: Sequence[tuple[str, list[tuple], int, float]], path: Path) -> Path:
    """One panel per run: GPU (y) x time (x), colored by role. runs: (title, log, n_gpus, makespan)."""
    horizon = max(m for *_, m in runs) or 1.0
    unit, uname = time_unit(horizon)
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.9 * len(runs) + 0.6), squeeze=False)
    for ax, (title, log, n, makespan) in zip(axes[:, 0], runs):
        bins = max(2, int(600 * makespan / horizon))
        m = role_matrix(log, n, makespan, bins=bins)
        ax.imshow(m, aspect="auto", interpolation="nearest", cmap=ListedColormap(ROLE_COLORS), vmin=0, vmax=4,
                  extent=(0, makespan / unit, n, 0))
        ax.set_xlim(0, horizon / unit)
        faults = [r[1] / unit for r in log if r[0] == "note" and r[2] == "fault"]
        if faults:  # injected faults (gyre.faults): a black tick above the panel each
            ax.plot(faults, [0] * len(faults), "kv", markersize=6, clip_on=False)
        ax.set_ylabel("GPU")
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel(uname)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLORS]
    fig.legend(handles, TIMELINE_NAMES, loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def utilization(series: Sequence[tuple[str, "object"]], n_gpus: int, path: Path) -> Path:
    """Share of GPUs doing rollout (top) or training (bottom) over time, one line per run, each its own colour;
    runs with identical curves share one line (labelled 'a = b'); the legend to the right of the panels."""
    horizon = max((float(df["t_s"].max()) for _, df in series if len(df)), default=1.0) or 1.0
    unit, uname = time_unit(horizon)
    fig, axes = plt.subplots(2, 1, figsize=(11, 5.6), sharex=True)
    merged: list[tuple[list[str], object]] = []  # runs with identical curves: one line, their names joined
    for title, df in series:
        same = next((m for m in merged if m[1][["t_s", "rollout", "train"]].equals(df[["t_s", "rollout", "train"]])),
                    None)
        if same is None:
            merged.append(([title], df))
        else:
            same[0].append(title)
    for i, (titles, df) in enumerate(merged):
        title = " = ".join(titles)
        axes[0].plot(df["t_s"] / unit, df["rollout"] / n_gpus, label=title, lw=1.1, **_style(i))
        axes[1].plot(df["t_s"] / unit, df["train"] / n_gpus, label=title, lw=1.1, **_style(i))
    axes[0].set_title("GPUs in rollout", fontsize=9, loc="left")
    axes[1].set_title("GPUs training", fontsize=9, loc="left")
    for ax in axes:
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("share of GPUs")
    axes[1].set_xlabel(uname)
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def step_breakdown(rows: Sequence[dict], path: Path) -> Path:
    """Stacked GPU-hours by role per policy: one horizontal bar a policy (its name on the left, never
    overlapping another), the total at its end, the legend above."""
    keys = ["gpu_h_rollout_busy", "gpu_h_rollout_idle", "gpu_h_train", "gpu_h_switching", "gpu_h_idle"]
    colors = ["#1f77b4", "#aec7e8", "#d62728", "#ff7f0e", "#d9d9d9"]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.38 * len(rows)))
    left = np.zeros(len(rows))
    names = [r["policy"] for r in rows]
    y = np.arange(len(rows))
    for k, c in zip(keys, colors):
        vals = np.array([r[k] for r in rows], dtype=float)
        ax.barh(y, vals, left=left, color=c, label=k.removeprefix("gpu_h_").replace("_", " "), height=0.7)
        left += vals
    for yi, total in zip(y, left):
        ax.text(total, yi, f" {total:.3g}", va="center", fontsize=7)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, left.max() * 1.12 if len(left) and left.max() > 0 else 1)
    ax.set_xlabel("GPU-hours")
    ax.legend(fontsize=7, ncol=5, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
