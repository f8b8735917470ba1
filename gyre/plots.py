"""Figures: GPU-role timelines, utilization over time, step-time breakdowns (matplotlib, Agg)."""

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


def role_timelines(runs: Sequence[tuple[str, list[tuple], int, float]], path: Path) -> Path:
    """One panel per run: GPU (y) x time (x), colored by role. runs: (title, log, n_gpus, makespan)."""
    horizon = max(m for *_, m in runs) or 1.0
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.9 * len(runs) + 0.6), squeeze=False)
    for ax, (title, log, n, makespan) in zip(axes[:, 0], runs):
        bins = max(2, int(600 * makespan / horizon))
        m = role_matrix(log, n, makespan, bins=bins)
        ax.imshow(m, aspect="auto", interpolation="nearest", cmap=ListedColormap(ROLE_COLORS), vmin=0, vmax=4,
                  extent=(0, makespan / 3600, n, 0))
        ax.set_xlim(0, horizon / 3600)
        faults = [r[1] / 3600 for r in log if r[0] == "note" and r[2] == "fault"]
        if faults:  # injected faults (gyre.faults): a black tick above the panel each
            ax.plot(faults, [0] * len(faults), "kv", markersize=6, clip_on=False)
        ax.set_ylabel("GPU")
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("hours")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLORS]
    fig.legend(handles, TIMELINE_NAMES, loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def utilization(series: Sequence[tuple[str, "object"]], n_gpus: int, path: Path) -> Path:
    """Share of GPUs doing rollout or training over time, one line per run."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), sharey=True)
    for title, df in series:
        axes[0].plot(df["t_s"] / 3600, df["rollout"] / n_gpus, label=title)
        axes[1].plot(df["t_s"] / 3600, df["train"] / n_gpus, label=title)
    axes[0].set_title("GPUs in rollout", fontsize=9)
    axes[1].set_title("GPUs training", fontsize=9)
    for ax in axes:
        ax.set_xlabel("hours")
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("share of GPUs")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def step_breakdown(rows: Sequence[dict], path: Path) -> Path:
    """Stacked GPU-hours by role per policy."""
    keys = ["gpu_h_rollout_busy", "gpu_h_rollout_idle", "gpu_h_train", "gpu_h_switching", "gpu_h_idle"]
    colors = ["#1f77b4", "#aec7e8", "#d62728", "#ff7f0e", "#d9d9d9"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bottom = np.zeros(len(rows))
    names = [r["policy"] for r in rows]
    for k, c in zip(keys, colors):
        vals = np.array([r[k] for r in rows])
        ax.bar(names, vals, bottom=bottom, color=c, label=k.removeprefix("gpu_h_"))
        bottom += vals
    ax.set_ylabel("GPU-hours")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
