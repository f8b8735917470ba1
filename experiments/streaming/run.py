"""Streaming training added to colocate and to async, at equal work (issue: streaming training with cells).

For each preset and seed (8 steps, eta 1 for async), the rows:
- colocate, and colocate + streaming (cells whose engines are idle train the batch's finished groups while its
  tail rolls out; policies/colocate.py);
- async at its best split and per-engine cap for eta 1 (the hindsight search of `gyre-sim compare`);
- async + streaming at that same split and cap (the paper's ablation: "streaming alone added to Async saves
  11.6%; the fixed split stays");
- async + streaming at its own best split and cap (the same search, every run streaming).
A row does equal work when its scheduler-induced cuts exceed the least of its preset-and-seed's rows by at most
1% of the executions (gyre.policies.tuning.equal_work). Writes results/streaming_<steps>steps_rows.csv (every row)
and results/streaming_<steps>steps.csv (the savings per preset and seed, the paper's 11.6% beside them), and
prints both; rows of other presets and seeds already in the file are kept (each seed's are written as it ends).

Usage: python experiments/streaming/run.py [--presets xlong-swe-kv xlong-swe-small] [--seeds 0 1 2] [--steps 8]
       [--no-own-search]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.policies.tuning import equal_work
from gyre.presets import get_preset
from gyre.sim.harness.compare import tune
from gyre.sim.harness.runner import simulate

HERE = Path(__file__).resolve().parent
PAPER_ASYNC_SAVING = 0.116  # PAPER.md: streaming alone added to Async saves 11.6%
ETA = 1


def _row(name: str, preset: str, seed: int, r, params: dict) -> dict:
    s = r.metrics.summary()
    return {"preset": preset, "seed": seed, "row": name, "makespan_h": r.makespan_s / 3600,
            "config": ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "-",
            "executions": int(r.metrics.extra["executions"]), "sched_cuts": int(r.metrics.extra["sched_cuts"]),
            "deadline_hit": s["deadline_hit"], "tokens_trained": s["tokens_trained"], "staleness_max": s["staleness_max"],
            "gpu_h_train": s["gpu_h_train"], "busy_share": s["busy_share"]}


def rows_for(preset: str, seed: int, steps: int, own_search: bool = True) -> list[dict]:
    cfg = override(get_preset(preset), steps=steps, seed=seed).validate()
    out = []
    for name, params in (("colocate", {}), ("colocate + streaming", {"streaming": True})):
        out.append(_row(name, preset, seed, simulate(cfg, "colocate", params), params))
        print(f"  {preset} seed {seed}: {name} {out[-1]['makespan_h']:.2f} h", file=sys.stderr, flush=True)
    tuned = tune(cfg, ["async"], etas=(ETA,), pilot=False, workers=1)["async"]
    best = {k: v for k, v in tuned.best.params.items()}
    out.append(_row("async (best split)", preset, seed, tuned.result, best))
    same = {**best, "streaming": True}
    out.append(_row("async + streaming (same split)", preset, seed, simulate(cfg, "async", same), same))
    print(f"  {preset} seed {seed}: async {out[-2]['makespan_h']:.2f} h, + streaming {out[-1]['makespan_h']:.2f} h",
          file=sys.stderr, flush=True)
    if own_search:
        scfg = override(cfg, policy_params={"async": {"streaming": True}})
        st = tune(scfg, ["async"], etas=(ETA,), pilot=False, workers=1)["async"]
        out.append(_row("async + streaming (own best split)", preset, seed, st.result, {**st.best.params, "streaming": True}))
    marks = equal_work([r["sched_cuts"] for r in out], max(r["executions"] for r in out))
    for r, m in zip(out, marks):
        r["equal_work"] = m
    return out


def savings(rows: pd.DataFrame) -> pd.DataFrame:
    out = []
    for (preset, seed), t in rows.groupby(["preset", "seed"], sort=False):
        m = t.set_index("row")["makespan_h"]
        ok = t.set_index("row")["equal_work"]
        for a, b in (("colocate", "colocate + streaming"), ("async (best split)", "async + streaming (same split)"),
                     ("async (best split)", "async + streaming (own best split)")):
            if b not in m.index:
                continue
            out.append({"preset": preset, "seed": seed, "baseline": a, "with streaming": b,
                        "saving": 1 - m[b] / m[a], "equal_work": bool(ok[a] and ok[b]),
                        "paper_saving": PAPER_ASYNC_SAVING if a.startswith("async") else float("nan")})
    return pd.DataFrame(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["xlong-swe-kv", "xlong-swe-small"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-own-search", action="store_true", help="skip async + streaming's own split search (slow)")
    a = ap.parse_args()
    res = HERE / "results"
    res.mkdir(exist_ok=True)
    path = res / f"streaming_{a.steps}steps_rows.csv"
    t0 = time.time()
    for preset in a.presets:
        for seed in a.seeds:
            new = pd.DataFrame(rows_for(preset, seed, a.steps, not a.no_own_search))
            old = pd.read_csv(path) if path.exists() else new.iloc[:0]
            old = old[~((old["preset"] == preset) & (old["seed"] == seed))]
            pd.concat([old, new], ignore_index=True).to_csv(path, index=False)  # kept as each seed finishes
            print(f"{preset} seed {seed} done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    df = pd.read_csv(path)
    sv = savings(df)
    sv.to_csv(res / f"streaming_{a.steps}steps.csv", index=False)
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.precision", 3):
        print(df[["preset", "seed", "row", "makespan_h", "config", "sched_cuts", "equal_work"]].to_string(index=False))
        print()
        print(sv.to_string(index=False))
        print()
        print(sv.groupby(["preset", "baseline", "with streaming"], sort=False)["saving"].median().rename("median saving")
              .to_string())


if __name__ == "__main__":
    main()
