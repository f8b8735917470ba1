"""Some of the regime map's cells, rerun alone: run.py's protocol (compare's tuning, eta 4) on the cells named.

Each `--cell WINDOW_K,GPUS[,none|light]` is a cell on the hybrid model with 3x growth and heavy training, or
with no growth (`none`) or light training (`light`) (run.py's `cell_list`); the rows go to results/<name>.csv and results/<name>_rows.csv in run.py's formats, rewritten
after every cell, so a rerun of the cells a change could move need not rerun the whole map.

Usage: python experiments/regime_map/cells.py --cell 256,768 --cell 512,768 --cell 512,1024 --name map_core_hybrid_misses
       python experiments/regime_map/cells.py --cell 1024,640,none --cell 1024,640,light --name map_core_hybrid_offaxis
       python experiments/regime_map/cells.py --cell 512,1024 --steps 8 --set cluster.cost.train_mfu=0.21 --name x
(`--set` replaces a dotted field of every cell's config after the cell's own, as `gyre-sim --set` does.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import CLUSTERS, KEEP, OUT, WINDOWS, cell_config, cell_row, cell_table, write_atomic  # noqa: E402

from gyre.config import ConfigError  # noqa: E402
from gyre.sim.cli.app import parse_sets  # noqa: E402
from gyre.sim.harness.sweep import progress_lines  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", action="append", required=True,
                    help="WINDOW_K,GPUS[,none|light], e.g. 512,1024 or 1024,640,none (repeatable)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--name", default="map_cells")
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed (the map itself is seed 0)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotted config field over every cell, e.g. cluster.cost.train_mfu=0.21 (repeatable)")
    a = ap.parse_args()
    try:
        sets = parse_sets(a.set)
    except ConfigError as exc:
        ap.error(str(exc))
    cells = []
    for text in a.cell:
        parts = text.split(",")
        try:
            w, n = int(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            ap.error(f"--cell {text!r}: expected WINDOW_K,GPUS[,none|light] such as 512,1024")
        axis = parts[2] if len(parts) > 2 else ""
        if w * 1024 not in WINDOWS or n not in CLUSTERS or len(parts) > 3 or axis not in ("", "none", "light"):
            ap.error(f"--cell {text}: windows (K) {[x // 1024 for x in WINDOWS]}, clusters {list(CLUSTERS)}, "
                     f"then optionally none (no growth) or light (light training)")
        cells.append((w * 1024, n, axis != "none", axis != "light", "hybrid"))
    try:  # a bad --set fails here, in one line, before any run
        for cell in cells:
            cell_config(*cell, steps=a.steps, seed=a.seed, sets=sets)
    except ConfigError as exc:
        ap.error(str(exc))
    rows, tables = [], []
    for cell in cells:
        t0 = time.perf_counter()
        t, params = cell_table(cell, a.steps, a.jobs, None, progress_lines(None, "runs"), seed=a.seed, sets=sets)
        r = cell_row(cell, a.steps, t, params, seed=a.seed, sets=sets) | {f"set:{k}": v for k, v in sets.items()}
        rows.append(r)
        tables.append(t.reset_index()[KEEP].assign(arch=cell[4], window=cell[0], gpus=cell[1], steps=a.steps,
                                                     seed=a.seed,
                                                     growth="3x" if cell[2] else "none",
                                                     training="heavy" if cell[3] else "light"))
        write_atomic(pd.concat(tables), OUT / f"{a.name}_rows.csv")
        write_atomic(pd.DataFrame(rows), OUT / f"{a.name}.csv")
        print(f"{cell[0] // 1024}K, {cell[1]} GPUs, {r['growth']} growth, {r['training']}: colocate {r['colocate_s'] / 3600:.2f} h, async {r['async_best_s'] / 3600:.2f}"
              f" h (R {r['async_best_R']}, cap {r['async_best_cap']}), elastic {r['elastic_s'] / 3600:.2f} h: "
              f"{r['elastic_vs_best']:.3f}x the best equal-work baseline; sched cuts {r['colocate_sched_cuts']} / "
              f"{r['async_best_sched_cuts']} / {r['elastic_sched_cuts']} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
