"""A trace cut by time into the part a workload is fitted on and the part held out, the per-execution quantities
both are read as, and a fitted workload judged on the held-out part (gyre.traces.workload_fit fits it).

The held-out groups are compared with groups drawn from the calibrated source for the same steps (at least
`WorkloadFitOptions.model_draws` segments and MIN_MODEL_DRAWS executions): per quantity, tail_dist.fit_quality
with K = the batch size; `fit_figures` draws the same comparison as CDF and QQ plots.
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


def evaluate(cw: CalibratedWorkload, test: list[GroupSpec], k: int, opts: WorkloadFitOptions) -> dict[str, dict]:
    """fit_quality per quantity: the calibrated source's draws vs the held-out groups."""
    model = sample_quantities(cw, model_steps(cw, test, opts), opts.seed)
    held = quantities(test, cw.scale_target)
    out = {}
    for name in ("length", "gen", "tool_s", "tool_out", "prompt"):
        if name == cw.scale_target or not (len(held[name]) and len(model[name])):
            continue  # the length *is* that quantity
        out[cw.scale_target if name == "length" else name] = fit_quality(model[name], held[name], k)
    return out


def fit_figures(cw: CalibratedWorkload, trace: Trace, folder, opts: WorkloadFitOptions) -> list:
    """CDF and QQ plots (log scale) of the calibrated draws against the held-out data, one row per quantity."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _, test = split_groups(trace.groups, opts.split)
    model = sample_quantities(cw, model_steps(cw, test, opts), opts.seed)
    held = quantities(test, cw.scale_target)
    names = [n for n in ("length", "gen", "tool_s", "tool_out", "prompt")
             if n != cw.scale_target and len(held[n]) and len(model[n])]
    fig, axes = plt.subplots(len(names), 2, figsize=(10, 3.2 * len(names)), squeeze=False)
    p = np.linspace(0.001, 0.9995, 400)
    for row, n in zip(axes, names):
        label = cw.scale_target if n == "length" else n
        for data, what in ((held[n], "held out"), (model[n], "calibrated")):
            xs = np.sort(data)
            row[0].plot(np.maximum(xs, 1e-9), np.arange(1, len(xs) + 1) / len(xs), label=what)
        row[0].set_xscale("log")
        row[0].set_title(f"{label}: CDF")
        row[0].legend()
        qm, qt = np.quantile(model[n], p), np.quantile(held[n], p)
        row[1].loglog(np.maximum(qt, 1e-9), np.maximum(qm, 1e-9), ".", ms=3)
        lo, hi = max(min(qt.min(), qm.min()), 1e-9), max(qt.max(), qm.max())
        row[1].plot([lo, hi], [lo, hi], "k--", lw=0.8)
        row[1].set_title(f"{label}: QQ (held-out vs calibrated)")
        row[1].set_xlabel("held-out quantile")
        row[1].set_ylabel("calibrated quantile")
    fig.tight_layout()
    path = folder / "fit_cdf_qq.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
