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
Per cell: colocate; async at eta 4 tuned by `gyre-sim compare`'s own search (gyre.sim.harness.compare.tune:
AsyncSplit.search, policies.tuning.refine_split_and_cap over every rollout split and the per-engine cap,
the `halvings` of the engine's admission limit), best kept at equal work (hindsight); async tuned the same
way on a pilot of the first steps // 6 steps (at least 1) and then run in full; elastic at eta 4. eta 4 is
the best staleness bound of every sweep this project has run (xlong-swe, xlong-swe-small, short-math),
so the map spends its runs on the split and cap. Every row carries its work (deadline cuts,
scheduler-induced cuts, tokens generated and trained, preemptions) and whether it does equal work
(policies.tuning: its scheduler-induced cuts within 1% of the cell's executions of the least of the cell's
rows); `elastic_vs_best` divides by the fastest baseline doing equal work (compare's `speedup_vs_best`), and a
cell whose elastic row does not do equal work itself says so (`elastic_equal_work`, "unequal work" in the figure).

python experiments/regime_map/run.py [--steps 6] [--jobs 2] [--cells core|all|1m|one] [--arch hybrid,gqa,mla]
    [--seed 0] [--name map] [--out DIR] [--resume]  ->  results/<name>.csv, .png (one row per cell), results/<name>_rows.csv (every policy
    row of every cell, with its work columns). Both CSVs are rewritten (tmp file, then rename) after every cell;
    `--resume` skips the cells already in results/<name>.csv (matched by KEY) and refuses a CSV written at other
    --steps or by an older run.py (without KEY, steps or executions columns).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from gyre.config import override
from gyre.hardware import CostConfig
from gyre.presets import KV_WINDOW, MODELS, get_preset
from gyre.sim.harness.compare import tune, tuned_table
from gyre.sim.harness.sweep import RAY_HELP, progress_lines

OUT = Path(__file__).parent / "results"
WINDOWS = (1 << 18, 1 << 19, 1 << 20, 1 << 21)
CLUSTERS = (640, 768, 1024)
ETA = 4
ARCHS = {"hybrid": "moe-2.4t-a95b", "gqa": "moe-2.4t-a95b-gqa", "mla": "moe-2.4t-a95b-mla"}


def cell_config(window: int, gpus: int, growth: bool, heavy: bool, arch: str, steps: int, seed: int = 0,
                sets: dict | None = None):
    """xlong-swe-kv with the cell's fields replaced, then `sets` (dotted fields, e.g. cluster.cost.train_mfu)."""
    base = get_preset("xlong-swe-kv")
    cost = CostConfig(train_extra_forwards=2 if heavy else 0, train_seq_tokens=KV_WINDOW)
    w = replace(base.workload, context_window=window,
                drift_per_step=base.workload.drift_per_step if growth else 0.0)
    cluster = replace(base.cluster, cost=cost, model=MODELS[ARCHS[arch]])
    return override(replace(base, workload=w, cluster=cluster),
                    **{"cluster.gpus": gpus, "steps": steps, "seed": seed, **(sets or {})})


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


ROWS = {"colocate": "colocate", "async": "async_best", "async-pilot": "async_pilot", "elastic": "elastic"}
WORK = ["deadline_hit", "sched_cuts", "sched_cut_tokens_lost", "tokens_generated", "tokens_trained", "preemptions",
        "equal_work"]  # each row's work (policies.work, gyre.metrics) and compare's equal-work mark
KEY = ["arch", "window", "gpus", "growth", "training"]  # a cell's identity in both CSVs
KEEP = ["policy", "config", "eta", "engine_limit", "makespan_s", "executions", "completed", "capped", *WORK,
        "gpu_h_idle", "tuned"]


def cell_table(cell: tuple, steps: int, jobs: int, ray: str | None, done, seed: int = 0,
               sets: dict | None = None) -> tuple[pd.DataFrame, dict]:
    """compare's table for one cell (colocate, async tuned by its search with a pilot, elastic; all at eta 4),
    indexed by row, and each row's chosen params."""
    cfg = cell_config(*cell, steps=steps, seed=seed, sets=sets)
    tuned = tune(cfg, ["colocate", "async", "elastic"], etas=(ETA,), pilot=max(1, steps // 6) < steps,
                 workers=jobs, ray=ray, on_done=lambda c, r: done(0, r))
    return tuned_table(tuned)[1].set_index("policy"), {k: t.best.params for k, t in tuned.items()}


def cell_row(cell: tuple, steps: int, t: pd.DataFrame, params: dict, seed: int = 0, sets: dict | None = None) -> dict:
    """The map's row of one cell from its compare table `t`: makespans, chosen splits and caps, work."""
    cfg = cell_config(*cell, steps=steps, seed=seed, sets=sets)
    c = cfg.costs()
    n, tmin = cfg.cluster.gpus, c.min_train_gpus
    pilot = "async-pilot" if "async-pilot" in t.index else "async"
    a, p = t.loc["async"], t.loc[pilot]
    ela = t.loc["elastic", "makespan_s"]
    row = {
        "arch": cell[4], "kv_bytes_per_token": cfg.cluster.model.kv_bytes_per_token,
        "state_tokens": c.state_tokens, "window": cell[0],
        "fits_full_window": c.kv_capacity_tokens / (cell[0] + c.state_tokens), "gpus": n, "trainer_min": tmin,
        "trainer_share": tmin / n, "growth": "3x" if cell[2] else "none", "training": "heavy" if cell[3] else "light",
        "steps": steps, "seed": seed, "executions": int(t.loc["elastic", "executions"]),
        "colocate_s": t.loc["colocate", "makespan_s"],
        "async_best_s": a["makespan_s"], "async_best_R": params["async"]["rollout_gpus"],
        "async_best_cap": a["engine_limit"], "async_pilot_R": params[pilot]["rollout_gpus"],
        "async_pilot_cap": p["engine_limit"], "async_pilot_s": p["makespan_s"], "elastic_s": ela,
        "elastic_vs_best": t.loc["elastic", "speedup_vs_best"], "elastic_vs_pilot_async": p["makespan_s"] / ela,
        "ceiling": n / (n - tmin), "elastic_vs_async_over_ceiling": (a["makespan_s"] / ela) / (n / (n - tmin)),
        "async_idle_gpu_h": a["gpu_h_idle"], "async_tuned": a["tuned"],
    }
    for name, prefix in ROWS.items():
        r = t.loc[name if name in t.index else "async"]
        row.update({f"{prefix}_{k}": r[k] for k in WORK})
    return row


def cell_key(cell: tuple) -> tuple:
    """The KEY values of one cell (window, gpus, growth, heavy, arch) as its CSV rows write them."""
    return cell[4], cell[0], cell[1], "3x" if cell[2] else "none", "heavy" if cell[3] else "light"


def write_atomic(df: pd.DataFrame, path: Path) -> None:
    """Write `df` to `path` through a tmp file renamed over it, so a killed run leaves the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    df.to_csv(tmp, index=False)
    tmp.replace(path)


def resumed(map_path: Path, rows_path: Path, steps: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The map rows already in `map_path` and their cells' compare rows from `rows_path`; exits with one line
    if the map was written at other --steps or by a run.py without the KEY, steps and executions columns."""
    if not map_path.exists():
        return pd.DataFrame(), pd.DataFrame()
    prev = pd.read_csv(map_path)
    missing = [k for k in (*KEY, "steps", "executions") if k not in prev.columns]
    if missing:
        sys.exit(f"--resume: {map_path} was written by an older run.py (no {', '.join(missing)} column); "
                 "move it aside or pick another --name")
    if set(prev.steps) != {steps}:
        sys.exit(f"--resume: {map_path} was written at --steps {sorted(set(prev.steps))}, not {steps}")
    rows = pd.read_csv(rows_path) if rows_path.exists() else pd.DataFrame(columns=[*KEEP, *KEY, "steps"])
    # a cell whose rows were written but not its map row (killed in between) runs again: drop its rows
    keys = set(prev[KEY].itertuples(index=False, name=None))
    rows = rows[[k in keys for k in rows[KEY].itertuples(index=False, name=None)]]
    return prev, rows


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
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed")
    ap.add_argument("--out", type=Path, default=OUT, help="the folder of <name>.csv (default: results/)")
    ap.add_argument("--resume", action="store_true",
                    help="skip the cells already in results/<name>.csv (same --steps), append the rest")
    a = ap.parse_args()
    archs = a.arch.split(",")
    if not set(archs) <= set(ARCHS):
        ap.error(f"--arch: unknown {sorted(set(archs) - set(ARCHS))}; known: {', '.join(ARCHS)}")
    if a.plot_only:
        heatmap(pd.read_csv(a.out / f"{a.name}.csv"), a.out / f"{a.name}.png")
        return
    cells = cell_list(a.cells, archs)
    if a.gpus:
        keep = {int(g) for g in a.gpus.split(",")}
        cells = [c for c in cells if c[1] in keep]
        if not cells:
            ap.error(f"--gpus {a.gpus}: no cell of --cells {a.cells} has that cluster size; sizes: {CLUSTERS}")
    a.out.mkdir(parents=True, exist_ok=True)
    map_path, rows_path = a.out / f"{a.name}.csv", a.out / f"{a.name}_rows.csv"
    prev, prev_rows = resumed(map_path, rows_path, a.steps) if a.resume else (pd.DataFrame(), pd.DataFrame())
    have = set(prev[KEY].itertuples(index=False, name=None)) if len(prev) else set()
    todo = [c for c in cells if cell_key(c) not in have]
    if a.resume:
        print(f"--resume: {len(cells) - len(todo)} of {len(cells)} cells already in {map_path}", flush=True)
    t0 = time.perf_counter()
    done = progress_lines(None, "runs")
    rows, tables = prev.to_dict("records"), [prev_rows] if len(prev_rows) else []
    for i, cell in enumerate(todo):  # one cell at a time; each search round's runs in parallel
        t, params = cell_table(cell, a.steps, a.jobs, a.ray, done, seed=a.seed)
        rows.append(cell_row(cell, a.steps, t, params, seed=a.seed))
        tables.append(t.reset_index()[KEEP].assign(arch=cell[4], window=cell[0], gpus=cell[1], steps=a.steps, seed=a.seed,
                                                     growth="3x" if cell[2] else "none",
                                                     training="heavy" if cell[3] else "light"))
        write_atomic(pd.concat(tables), rows_path)  # rows first: a map row always has its compare rows
        write_atomic(pd.DataFrame(rows), map_path)
        el = time.perf_counter() - t0
        eta = el / (i + 1) * (len(todo) - i - 1)
        print(f"cell {i + 1}/{len(todo)} {cell_key(cell)}: elapsed {el:.0f} s, ETA {eta:.0f} s "
              f"({len(rows)} cells in {map_path.name})", flush=True)
    df = pd.DataFrame(rows)
    heatmap(df, a.out / f"{a.name}.png")
    print(df[["arch", "window", "gpus", "growth", "training", "colocate_s", "async_best_s", "async_best_R",
              "async_best_cap", "elastic_s", "elastic_vs_best", "elastic_vs_pilot_async", "ceiling",
              "colocate_sched_cuts", "async_best_sched_cuts", "elastic_sched_cuts", "async_best_equal_work",
              "elastic_equal_work"]].round(3).to_string(index=False))
    print(f"{len(todo)} cells run in {time.perf_counter() - t0:.0f} s with {a.jobs} workers ({len(df)} in {map_path})")


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
    # maps written since the cap search mark a cell whose elastic row does not do equal work
    equal = (core.pivot_table(index="window", columns="gpus", values="elastic_equal_work", aggfunc="min")
             if "elastic_equal_work" in core else None)
    for i, j in itertools.product(range(piv.shape[0]), range(piv.shape[1])):
        unequal = equal is not None and not bool(equal.values[i, j])
        ax.text(j, i, f"{piv.values[i, j]:.2f}x\n(ceil {ceil.values[i, j]:.2f})" + ("\nunequal work" if unequal else ""),
                ha="center", va="center", fontsize=8)
    arch = f"{core.arch.iloc[0]}, " if "arch" in core else ""
    ax.set_title(f"elastic / best of (colocate, async), {arch}{int(core.steps.iloc[0])} steps, growth 3x, "
                 "heavy training", fontsize=10)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
