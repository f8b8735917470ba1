"""The paper's table on Gyre's 2.4T setup: every design side by side at equal work, ratios beside the paper's.

Setup: the `xlong-swe-kv` preset (PAPER.md's flagship: the 2.4T-A95B hybrid MoE, ~700K-token rollouts, a 4 h
deadline, lengths growing 3x over the run), `--steps` steps (the paper runs 48) on `--gpus` H200s (the paper does
not state its cluster size: run several). Rows, all at eta 1 except colocate (on-policy):
- colocate; colocate + streaming (idle cells train finished groups while the tail rolls out);
- the paper's Async: a fixed split chosen as its user would, without hindsight: one pilot step of colocate
  measures the batch's rollout GPU-seconds (an engine decoding) and training GPU-seconds, and the split gives
  each side its share of them (R
  rounded down to whole engines, leaving the trainer its memory minimum);
- Async + streaming at that same split;
- waterlevel at two cell sizes (policies/waterlevel.py), the cells' size and the standalone pool stated per row;
- elastic (the forecasting controller) at its default settings;
- async at its hindsight-best split and cap (`gyre-sim compare`'s search at eta 1).
Rows are marked equal work when their scheduler-induced cuts exceed the least of the table's by at most 1% of
the executions. Prints and writes results/paper_table_<gpus>gpus_<steps>steps.csv with each row's makespan, its
work, its GPU-time decomposition (gyre.gpu_time) in GPU-hours, and the ratios waterlevel / paper's Async and
waterlevel / colocate beside the paper's 1.78x and 1.21x.

Usage: python experiments/paper_table/run.py [--gpus 1024] [--steps 8] [--seed 0] [--cells 352:320 512:0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.gpu_time import decompose
from gyre.policies.tuning import equal_work
from gyre.presets import get_preset
from gyre.sim.harness.compare import tune
from gyre.sim.harness.runner import simulate

HERE = Path(__file__).resolve().parent
PAPER = {"vs_async": 1.78, "vs_colocate": 1.21}  # PAPER.md, the 2.4T row: 75.4 h vs 134.6 h (Async), 91.5 h (Colocate)
ETA = 1


def balanced_split(cfg) -> tuple[int, dict]:
    """The paper's Async split from one colocate pilot step: R / N = rollout GPU-seconds / (rollout + training)."""
    pilot = simulate(override(cfg, steps=1), "colocate")
    g = pilot.metrics.gpu_seconds
    roll, train = g["rollout_busy"], g["train"]  # GPU-seconds an engine decoded, and trained
    n, per, need = cfg.cluster.gpus, pilot.costs.engine_gpus, pilot.costs.min_train_gpus
    r = int(n * roll / (roll + train)) // per * per
    r = max(per, min(r, (n - need) // per * per))
    return r, {"pilot_rollout_gpu_h": roll / 3600, "pilot_train_gpu_h": train / 3600}


def row(name: str, r, note: str = "") -> dict:
    s = r.metrics.summary()
    d = decompose(r.log, r.config.cluster.gpus, r.costs.sync_s)
    return {"row": name, "makespan_h": r.makespan_s / 3600, "note": note,
            "executions": int(r.metrics.extra["executions"]), "sched_cuts": int(r.metrics.extra["sched_cuts"]),
            "deadline_hit": s["deadline_hit"], "staleness_max": s["staleness_max"], "busy_share": s["busy_share"],
            **{f"gpu_h_{k}": v / 3600 for k, v in d.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cells", nargs="+", default=["352:320", "512:0"], help="waterlevel cell sizes as CELL:POOL GPUs")
    ap.add_argument("--no-hindsight", action="store_true", help="skip the hindsight async search (slow)")
    a = ap.parse_args()
    cfg = override(get_preset("xlong-swe-kv"), steps=a.steps, seed=a.seed, **{"cluster.gpus": a.gpus}).validate()
    t0 = time.time()
    rows = []

    def add(name, policy, params=None, c=cfg, note=""):
        r = simulate(c, policy, params or {})
        rows.append(row(name, r, note))
        print(f"  {name}: {r.makespan_s / 3600:.2f} h ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)

    add("colocate", "colocate")
    add("colocate + streaming", "colocate", {"streaming": True})
    r_split, pilot = balanced_split(cfg)
    note = f"R={r_split} of {a.gpus} (pilot: rollout {pilot['pilot_rollout_gpu_h']:.0f}, train {pilot['pilot_train_gpu_h']:.0f} GPU-h)"
    add("async (paper's: pilot-balanced split)", "async", {"rollout_gpus": r_split, "eta": ETA}, note=note)
    add("async + streaming (same split)", "async", {"rollout_gpus": r_split, "eta": ETA, "streaming": True}, note=note)
    for spec in a.cells:
        cell, pool = (int(x) for x in spec.split(":"))
        c = override(cfg, **{"cluster.cell_gpus": cell, "cluster.standalone_gpus": pool}).validate()
        add(f"waterlevel (cells of {cell}, pool {pool})", "waterlevel", {"eta": ETA}, c=c,
            note=f"{(a.gpus - pool) // cell} cells of {cell} GPUs, standalone pool {pool}")
    add("elastic (forecasting, defaults)", "elastic", {"eta": ETA})
    if not a.no_hindsight:
        t = tune(cfg, ["async"], etas=(ETA,), pilot=False, workers=1)["async"]
        rows.append(row("async (hindsight-best split and cap)", t.result, ", ".join(f"{k}={v}" for k, v in t.best.params.items())))
        print(f"  hindsight async: {t.result.makespan_s / 3600:.2f} h", file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    df["equal_work"] = equal_work(df["sched_cuts"].tolist(), int(df["executions"].max()))
    base = df.set_index("row")["makespan_h"]
    asy, colo = base["async (paper's: pilot-balanced split)"], base["colocate"]
    df["vs_paper_async"] = asy / df["makespan_h"]
    df["vs_colocate"] = colo / df["makespan_h"]
    out = HERE / "results" / f"paper_table_{a.gpus}gpus_{a.steps}steps_seed{a.seed}.csv"
    out.parent.mkdir(exist_ok=True)
    df.to_csv(out, index=False)
    with pd.option_context("display.width", 220, "display.max_columns", 30, "display.precision", 3):
        print(df[["row", "makespan_h", "vs_paper_async", "vs_colocate", "sched_cuts", "equal_work", "note"]].to_string(index=False))
        print(f"\npaper (2.4T, 48 steps): elastic {PAPER['vs_async']}x its Async, {PAPER['vs_colocate']}x Colocate")
        terms = [c for c in df.columns if c.startswith("gpu_h_")]
        print(df[["row"] + terms].to_string(index=False))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
