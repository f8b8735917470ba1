"""One 48-step equal-work row on xlong-swe-kv: a policy at one eta, per-engine cap and (async) split.

Runs `model_based.run` (makespan, deadline and scheduler-induced cuts, tokens generated, preemptions) for
one configuration and appends its row to results/run48_<preset>_seed<seed>.csv, so each row of the
README's 48-step table can be rerun alone (each takes minutes to tens of minutes of CPU).

Usage: python experiments/elastic_vs_baselines/run48.py --policy elastic --eta 4 --cap 4
       python experiments/elastic_vs_baselines/run48.py --policy async --eta 4 --split 640 --cap 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.presets import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_based import HERE, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", choices=["colocate", "async", "elastic"], required=True)
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--cap", type=int, default=0, help="per-engine cap (max_running); 0: none")
    ap.add_argument("--split", type=int, default=0, help="async's rollout GPUs (required for async)")
    a = ap.parse_args()
    if a.policy == "async" and a.split <= 0:
        ap.error("--split: async needs its rollout GPUs (> 0)")
    params = {} if a.policy == "colocate" else {"eta": a.eta}
    if a.policy == "async":
        params["rollout_gpus"] = a.split
    if a.cap:
        params["max_running"] = a.cap
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed)
    row = {"preset": a.preset, "steps": a.steps, "seed": a.seed, **run(cfg, a.policy, params)}
    print(row, flush=True)
    out = HERE / "results" / f"run48_{a.preset}_s{a.steps}_seed{a.seed}.csv"
    pd.DataFrame([row]).to_csv(out, mode="a", header=not out.exists(), index=False)
    print(f"appended to {out}")


if __name__ == "__main__":
    main()
