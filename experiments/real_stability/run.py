"""How often does a real tiny-cpu run collapse, and does a smaller step prevent it?

A collapse is the absorbing state seen in real runs: every rollout of every group earns the same reward, so
every advantage is 0 and no step can move the policy again (`RealResult.stalled_since`). This runs one policy
for `--steps` steps on `--seeds` task seeds (independent runs) per trainer setting and reports, per run, the
reward of the last 5 steps and the step from which it stalled (if it did).

Outputs: results/runs.csv (setting, seed, reward first 5 / last 5, stalled_since, makespan).
Usage: python experiments/real_stability/run.py [--policy async] [--preset tiny-cpu] [--seeds 8] [--steps 30]
       [--lrs 1e-2,3e-3] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="async")
    ap.add_argument("--preset", default="tiny-cpu", help="a real preset (gyre.real.config.PRESETS)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lrs", default="1e-2,3e-3", help="trainer learning rates to compare")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    from gyre.real.pool import ActorPool
    from gyre.real.config import get_preset
    from gyre.real.runner import run_real

    base = dataclasses.replace(get_preset(args.preset), steps=args.steps)
    rows, t0 = [], time.perf_counter()
    for lr in (float(x) for x in args.lrs.split(",")):
        tc = dataclasses.replace(base.pool.trainer_config, lr=lr)
        pool_cfg = dataclasses.replace(base.pool, trainer_config=tc)
        pool = ActorPool.shared(pool_cfg)  # a new trainer config: fresh actors
        for seed in range(args.seeds):
            cfg = dataclasses.replace(base, pool=pool_cfg, cluster=dataclasses.replace(base.cluster, seed=seed))
            r = run_real(cfg, args.policy, pool=pool)
            lc = r.learning()
            rows.append({"policy": args.policy, "lr": lr, "seed": seed, "makespan_s": r.makespan_s,
                         "reward_first5": float(lc["reward_mean"].iloc[:5].mean()),
                         "reward_last5": float(lc["reward_mean"].iloc[-5:].mean()),
                         "stalled_since": r.stalled_since(), "median_drift": float(lc["drift"].median())})
            print(f"[{time.perf_counter() - t0:5.0f}s] " + ", ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            pd.DataFrame(rows).to_csv(args.out / "runs.csv", index=False)
    df = pd.DataFrame(rows)
    print(df.groupby("lr").agg(runs=("seed", "size"), collapsed=("stalled_since", lambda s: int(s.notna().sum())),
                               reward_last5_median=("reward_last5", "median"),
                               reward_last5_min=("reward_last5", "min")).to_string())


if __name__ == "__main__":
    main()
