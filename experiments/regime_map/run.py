"""The regime map: where elastic beats a fixed split, on xlong-swe-kv (the 2.4T MoE, ~700K-token rollouts).

Axes (each cell is xlong-swe-kv with these fields replaced; nothing else moves):
- KV pressure: the compaction window W (262,144 / 524,288 / 1,048,576 / 2,097,152 tokens), so a 32-GPU
  engine's KV holds about 32 / 16 / 8 / 4 contexts at a full window with the GQA stand-in (8.1M tokens),
  256 / 128 / 63 / 32 with the hybrid one (67.8M tokens, a 12,720-token state per sequence). The trainer's memory
  minimum keeps the preset's 1M-token sequence in every cell, so this axis moves KV pressure only.
- trainer share: the cluster, 640 / 768 / 1,024 H200s, against a trainer minimum of 344 (hybrid)
  or 360 (GQA, MLA) GPUs.
- length growth: none, or turns x3 over the 48-step run (the preset's rate per step).
- training: heavy (the preset: activation and log-prob recompute, 10 x active params FLOPs per token)
  or light (neither, 6 x active params).
- architecture (`--arch`, any of): the 2.4T-A95B stand-in as the preset has it, hybrid linear attention
  on the Qwen3.5 layout (`moe-2.4t-a95b`), or with full GQA on every layer (`moe-2.4t-a95b-gqa`), or
  with DeepSeek-V3's latent attention (`moe-2.4t-a95b-mla`); each has its own KV per token, state and
  trainer minimum (gyre.presets).
Per cell: colocate; async at 5 rollout splits spread over every engine multiple that leaves the trainer
its minimum (both ends included) at eta 4, best one kept (hindsight); async tuned on a pilot of the first
steps // 6 steps (at least 1) over the same 5 splits and then run in full; elastic at eta 4. eta 4 is
the best staleness bound of every sweep this project has run (xlong-swe, xlong-swe-small, short-math),
so the map spends its runs on the split.

python experiments/regime_map/run.py [--steps 6] [--jobs 2] [--cells core|all|1m|one] [--arch hybrid,gqa,mla]
    [--name map]  ->  results/<name>.csv, .png
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from gyre.config import override
from gyre.hardware import CostConfig
from gyre.policies.async_split import AsyncSplit
from gyre.policies.common import ClusterShape
from gyre.policies.tuning import _spread, fastest_at_equal_work
from gyre.presets import KV_WINDOW, MODELS, get_preset
from gyre.sim.harness.runner import simulate
from gyre.sim.harness.sweep import RAY_HELP, progress_lines, run_map

OUT = Path(__file__).parent / "results"
WINDOWS = (1 << 18, 1 << 19, 1 << 20, 1 << 21)
CLUSTERS = (640, 768, 1024)
ETA = 4
ARCHS = {"hybrid": "moe-2.4t-a95b", "gqa": "moe-2.4t-a95b-gqa", "mla": "moe-2.4t-a95b-mla"}


def cell_config(window: int, gpus: int, growth: bool, heavy: bool, arch: str, steps: int):
    base = get_preset("xlong-swe-kv")
    cost = CostConfig(train_extra_forwards=2 if heavy else 0, train_seq_tokens=KV_WINDOW)
    w = replace(base.workload, context_window=window,
                drift_per_step=base.workload.drift_per_step if growth else 0.0)
    cluster = replace(base.cluster, cost=cost, model=MODELS[ARCHS[arch]])
    return override(replace(base, workload=w, cluster=cluster), **{"cluster.gpus": gpus, "steps": steps})


def cell_list(name: str, archs: list[str]) -> list[tuple]:
    """The cells of `--cells name` (main's help), each (window, gpus, growth, heavy, arch), per architecture."""
    cells = [(w, n, True, True) for w in WINDOWS for n in CLUSTERS]
    if name == "all":
        cells = list(itertools.product(WINDOWS, CLUSTERS, (False, True), (False, True)))
    elif name == "1m":
        cells = [(1 << 20, n, True, True) for n in CLUSTERS]
    elif name == "one":
        cells = [(1 << 20, 1024, True, True)]
    elif name == "core":
        cells += [(1 << 20, n, g, h) for n in (640, 1024) for g, h in ((False, True), (True, False))]
    return [(*c, arch) for arch in archs for c in cells]


def _run(job):
    cell, cfg, policy, params = job
    r = simulate(cfg, policy, params)
    s = r.metrics.summary()
    return cell, cfg.steps, policy, params, (r.makespan_s, s.get("sched_cuts", 0)), s.get("gpu_h_idle", float("nan"))


def _fastest(runs: dict[int, tuple[float, float, int]], executions: int) -> int:
    """The split whose (makespan, idle, sched_cuts) run is fastest among those doing equal work."""
    splits = list(runs)
    return splits[fastest_at_equal_work([runs[r][0] for r in splits], [runs[r][2] for r in splits], executions)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ray", default=None, help=RAY_HELP)
    ap.add_argument("--plot-only", action="store_true", help="redraw results/map.png from results/map.csv")
    ap.add_argument("--cells", choices=["core", "all", "1m", "one"], default="core",
                    help="core: every window x cluster with growth and heavy training, plus the other two axes "
                         "at W = 1M on 1,024 and 640 GPUs; all: the full 4 x 3 x 2 x 2 grid; 1m: the preset's "
                         "window (1M, growth, heavy) on each cluster; one: the preset's own cell (1M, 1,024)")
    ap.add_argument("--arch", default="hybrid",
                    help=f"comma-separated architectures, each a copy of the cells: {', '.join(ARCHS)}")
    ap.add_argument("--gpus", default="", help="comma-separated cluster sizes: only the cells on these (default: all)")
    ap.add_argument("--name", default="map", help="results/<name>.csv and .png")
    a = ap.parse_args()
    archs = a.arch.split(",")
    if not set(archs) <= set(ARCHS):
        ap.error(f"--arch: unknown {sorted(set(archs) - set(ARCHS))}; known: {', '.join(ARCHS)}")
    if a.plot_only:
        heatmap(pd.read_csv(OUT / f"{a.name}.csv"), OUT / f"{a.name}.png")
        return
    cells = cell_list(a.cells, archs)
    if a.gpus:
        keep = {int(g) for g in a.gpus.split(",")}
        cells = [c for c in cells if c[1] in keep]
        if not cells:
            ap.error(f"--gpus {a.gpus}: no cell of --cells {a.cells} has that cluster size; sizes: {CLUSTERS}")
    t0 = time.perf_counter()
    pilot_steps = max(1, a.steps // 6)
    jobs, meta = [], {}
    for cell in cells:
        cfg = cell_config(*cell, steps=a.steps)
        c = cfg.costs()
        shape = ClusterShape(n_gpus=cfg.cluster.gpus, gpus_per_engine=c.engine_gpus, min_train_gpus=c.min_train_gpus)
        splits = AsyncSplit.splits(shape)
        rs = [splits[i] for i in _spread(len(splits), 5)]
        meta[cell] = (cfg, c, rs)
        jobs += [(cell, cfg, "colocate", {}), (cell, cfg, "elastic", {"eta": ETA})]
        jobs += [(cell, cfg, "async", {"eta": ETA, "rollout_gpus": r}) for r in rs]
        if pilot_steps < a.steps:
            jobs += [(cell, replace(cfg, steps=pilot_steps), "async", {"eta": ETA, "rollout_gpus": r}) for r in rs]
    res = run_map(_run, jobs, workers=a.jobs, ray=a.ray, on_done=progress_lines(len(jobs), "runs"))
    rows = []
    for cell in cells:
        cfg, c, rs = meta[cell]
        mine = [x for x in res if x[0] == cell]
        full = {(p, tuple(sorted(q.items()))): (m, idle, cut) for _, st, p, q, (m, cut), idle in mine if st == a.steps}
        colo = full[("colocate", ())][0]
        ela = full[("elastic", (("eta", ETA),))][0]
        asyncs = {dict(q)["rollout_gpus"]: v for (p, q), v in full.items() if p == "async"}
        execs = cfg.steps * cfg.workload.groups_per_step * cfg.workload.group_size
        best_r = _fastest(asyncs, execs)  # at equal work (policies.tuning)
        pil = {q["rollout_gpus"]: (m, 0, cut) for _, st, p, q, (m, cut), _ in mine
               if p == "async" and st == pilot_steps < a.steps}
        pilot_r = _fastest(pil, pilot_steps * execs // cfg.steps) if pil else best_r
        n, tmin = cfg.cluster.gpus, c.min_train_gpus
        best = min(colo, asyncs[best_r][0])
        rows.append({
            "arch": cell[4], "kv_bytes_per_token": cfg.cluster.model.kv_bytes_per_token,
            "state_tokens": c.state_tokens, "window": cell[0],
            "fits_full_window": c.kv_capacity_tokens / (cell[0] + c.state_tokens), "gpus": n, "trainer_min": tmin,
            "trainer_share": tmin / n, "growth": "3x" if cell[2] else "none", "training": "heavy" if cell[3] else "light",
            "steps": a.steps, "colocate_s": colo, "async_best_s": asyncs[best_r][0], "async_best_R": best_r,
            "async_pilot_R": pilot_r, "async_pilot_s": asyncs[pilot_r][0], "elastic_s": ela,
            "elastic_vs_best": best / ela, "elastic_vs_pilot_async": asyncs[pilot_r][0] / ela,
            "ceiling": n / (n - tmin), "elastic_vs_async_over_ceiling": (asyncs[best_r][0] / ela) / (n / (n - tmin)),
            "async_idle_gpu_h": asyncs[best_r][1], "async_splits_tried": " ".join(map(str, rs)),
            "colocate_sched_cuts": full[("colocate", ())][2], "async_best_sched_cuts": asyncs[best_r][2],
            "elastic_sched_cuts": full[("elastic", (("eta", ETA),))][2],
        })
    OUT.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    df.to_csv(OUT / f"{a.name}.csv", index=False)
    heatmap(df, OUT / f"{a.name}.png")
    print(df[["arch", "window", "gpus", "growth", "training", "colocate_s", "async_best_s", "async_best_R", "elastic_s",
              "elastic_vs_best", "elastic_vs_pilot_async", "ceiling"]].round(3).to_string(index=False))
    print(f"{len(jobs)} runs in {time.perf_counter() - t0:.0f} s with {a.jobs} workers")


def heatmap(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    core = df[(df.growth == "3x") & (df.training == "heavy")]
    if "arch" in core:  # one architecture per figure: the first
        core = core[core.arch == core.arch.iloc[0]]
    tmin = int(core.trainer_min.iloc[0])
    piv = core.pivot_table(index="window", columns="gpus", values="elastic_vs_best")
    ceil = core.pivot_table(index="window", columns="gpus", values="ceiling")
    fig, ax = plt.subplots(figsize=(8.0, 5.0))
    im = ax.imshow(piv.values, cmap="RdYlGn", vmin=0.8, vmax=max(1.6, float(np.nanmax(piv.values))), origin="lower")
    ax.set_xticks(range(len(piv.columns)), [f"{g} ({tmin / g:.0%})" for g in piv.columns])
    fits = core.groupby("window")["fits_full_window"].first()
    ax.set_yticks(range(len(piv.index)), [f"{w // 1024}K: {fits[w]:.0f}" for w in piv.index])
    ax.set_xlabel(f"cluster GPUs (trainer minimum {tmin} as a share)")
    ax.set_ylabel("window: contexts per engine")
    for i, j in itertools.product(range(piv.shape[0]), range(piv.shape[1])):
        ax.text(j, i, f"{piv.values[i, j]:.2f}x\n(ceil {ceil.values[i, j]:.2f})", ha="center", va="center", fontsize=8)
    arch = f"{core.arch.iloc[0]}, " if "arch" in core else ""
    ax.set_title(f"elastic / best of (colocate, async), {arch}{int(core.steps.iloc[0])} steps, growth 3x, "
                 "heavy training", fontsize=10)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
