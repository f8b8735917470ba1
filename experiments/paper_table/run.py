"""The paper's table on Gyre's 2.4T setup: every design side by side at equal work, ratios beside the paper's.

Setups (`--preset`): `xlong-swe-kv` (PAPER.md's flagship: the 2.4T-A95B hybrid MoE, ~700K-token rollouts, a 4 h
deadline, lengths growing 3x over the run), `nl2repo-122b` and `deepswe-122b` (the 122B setups, gyre.presets);
`--steps` steps (the paper runs 48) on `--gpus` H200s (the paper does
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
the executions. Prints and writes results/paper_table[_<preset>]_<gpus>gpus_<steps>steps_seed<seed>.csv with each row's makespan, its
work, its GPU-time decomposition (gyre.gpu_time) in GPU-hours, and the ratios waterlevel / paper's Async and
waterlevel / colocate beside the paper's (PAPER).

Usage: python experiments/paper_table/run.py [--preset xlong-swe-kv] [--gpus 1024] [--steps 8] [--seed 0]
           [--cells 512:0 256:0] [--no-hindsight]
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
# PAPER.md's results table: elastic over its Async and over Colocate, per setup (a range where the paper gives one)
PAPER = {"xlong-swe-kv": ("1.78", "1.21"), "nl2repo-122b": ("1.42-1.53", "1.36-1.47"),
         "deepswe-122b": ("1.38-1.57", "1.61-1.85")}
ETA = 1


def cell_choices(cfg) -> list[str]:
    """Two waterlevel layouts as CELL:POOL: the whole cluster in 2 cells, and in 4 (or, where a quarter cannot hold
    the training state, 2 cells with a standalone pool of what is left past two training minima)."""
    costs = cfg.costs()
    n, per, need = cfg.cluster.gpus, costs.engine_gpus, costs.min_train_gpus
    out = [f"{n // k}:0" for k in (2, 4) if n % k == 0 and n // k >= need and (n // k) % per == 0]
    if len(out) < 2:
        cell = -(-need // per) * per
        out.append(f"{cell}:{n - 2 * cell}")
    return out[:2]


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
    ap.add_argument("--preset", default="xlong-swe-kv", choices=sorted(PAPER))
    ap.add_argument("--gpus", type=int, default=None, help="cluster size (default: the preset's)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cells", nargs="+", default=None, help="waterlevel cell sizes as CELL:POOL GPUs (default: "
                    "2 and 4 cells, cell_choices)")
    ap.add_argument("--no-hindsight", action="store_true", help="skip the hindsight async search (slow)")
    a = ap.parse_args()
    base = get_preset(a.preset)
    a.gpus = a.gpus or base.cluster.gpus
    cfg = override(base, steps=a.steps, seed=a.seed, **{"cluster.gpus": a.gpus}).validate()
    a.cells = a.cells or cell_choices(cfg)
    t0 = time.time()
    rows = []

    def add(name, policy, params=None, c=cfg, note=""):
        r = simulate(c, policy, params or {})
        rows.append(row(name, r, note))
        print(f"  {name}: {r.makespan_s / 3600:.2f} h ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)

    add("colocate", "colocate")
    per = cfg.costs().engine_gpus
    add("colocate + streaming", "colocate", {"streaming": True})
    r_split, pilot = balanced_split(cfg)
    note = f"R={r_split} of {a.gpus} (pilot: rollout {pilot['pilot_rollout_gpu_h']:.0f}, train {pilot['pilot_train_gpu_h']:.0f} GPU-h)"
    add("async (paper's: pilot-balanced split)", "async", {"rollout_gpus": r_split, "eta": ETA}, note=note)
    add("async + streaming (same split)", "async", {"rollout_gpus": r_split, "eta": ETA, "streaming": True}, note=note)
    pool = next((int(x.split(":")[1]) for x in a.cells if int(x.split(":")[1])), 0)
    pool = pool or a.gpus // 4 // per * per
    c = override(cfg, **{"cluster.cell_gpus": a.gpus - pool, "cluster.standalone_gpus": pool}).validate()
    add("colocate + standalone pool", "colocate", c=c, note=f"pool {pool} GPUs never train")
    for i, spec in enumerate(a.cells):
        cell, pool = (int(x) for x in spec.split(":"))
        c = override(cfg, **{"cluster.cell_gpus": cell, "cluster.standalone_gpus": pool}).validate()
        layout = f"{(a.gpus - pool) // cell} cells of {cell} GPUs, standalone pool {pool}"
        add(f"waterlevel (cells of {cell}, pool {pool})", "waterlevel", {"eta": ETA}, c=c, note=layout)
        if i == 0:  # the other reading of C_R: engines counted at their admission limit (policies/waterlevel.py)
            add(f"waterlevel, capacity = limit (cells of {cell}, pool {pool})", "waterlevel",
                {"eta": ETA, "capacity": "limit"}, c=c, note=layout)
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
    df["paper_vs_async"], df["paper_vs_colocate"] = PAPER[a.preset]
    name = "paper_table" if a.preset == "xlong-swe-kv" else f"paper_table_{a.preset}"
    out = HERE / "results" / f"{name}_{a.gpus}gpus_{a.steps}steps_seed{a.seed}.csv"
    out.parent.mkdir(exist_ok=True)
    df.to_csv(out, index=False)
    with pd.option_context("display.width", 220, "display.max_columns", 30, "display.precision", 3):
        print(df[["row", "makespan_h", "vs_paper_async", "vs_colocate", "sched_cuts", "equal_work", "note"]].to_string(index=False))
        pa, pc = PAPER[a.preset]
        print(f"\npaper ({a.preset}'s setup): elastic {pa}x its Async, {pc}x Colocate")
        terms = [c for c in df.columns if c.startswith("gpu_h_")]
        print(df[["row"] + terms].to_string(index=False))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
