"""One 48-step equal-work row on xlong-swe-kv: a policy at one eta, per-engine cap and (async) split.

Runs `model_based.run` (makespan, deadline and scheduler-induced cuts, tokens generated, preemptions) for
one configuration and appends its row to results/run48_<preset>_s<steps>_seed<seed>.csv (with `--gpus N`,
the preset on N GPUs: results/run48_<preset>_g<N>_s<steps>_seed<seed>.csv; on 640 and 768 GPUs these are the
regime map's 48-step preset cells, experiments/regime_map/run.py's cell_config for the 1M window, 3x growth,
heavy training), so each row of the README's 48-step tables can be rerun alone (each takes minutes of CPU).

Usage: python experiments/elastic_vs_baselines/run48.py --policy elastic --eta 4 --cap 4
       python experiments/elastic_vs_baselines/run48.py --policy async --eta 4 --split 640 --cap 8
       python experiments/elastic_vs_baselines/run48.py --policy async --eta 4 --split 288 --cap 4 --gpus 640
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
    ap.add_argument("--tiers", default="", help="elastic's placement by age, AGE_S:N,... (ElasticConfig.tiers)")
    ap.add_argument("--gpus", type=int, default=0, help="the cluster's GPUs; 0: the preset's")
    ap.add_argument("--no-hold", action="store_true", help="elastic: admission never held (ElasticConfig.hold)")
    a = ap.parse_args()
    if a.policy == "async" and a.split <= 0:
        ap.error("--split: async needs its rollout GPUs (> 0)")
    params = {} if a.policy == "colocate" else {"eta": a.eta}
    if a.policy == "async":
        params["rollout_gpus"] = a.split
    if a.cap:
        params["max_running"] = a.cap
    if a.tiers:
        params["tiers"] = tuple((float(t.split(":")[0]), int(t.split(":")[1])) for t in a.tiers.split(","))
    if a.no_hold:
        params["hold"] = False
    if a.gpus < 0:
        ap.error("--gpus: a positive GPU count, or 0 for the preset's")
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed, **({"cluster.gpus": a.gpus} if a.gpus else {}))
    cfg.validate()
    row = {"preset": a.preset, "steps": a.steps, "seed": a.seed, **({"gpus": a.gpus} if a.gpus else {}),
           **run(cfg, a.policy, params)}
    print(row, flush=True)
    # tiers, or no hold: its own file
    tag = (f"_g{a.gpus}" if a.gpus else "") + ("_tiers" if a.tiers else "") + ("_nohold" if a.no_hold else "")
    out = HERE / "results" / f"run48_{a.preset}{tag}_s{a.steps}_seed{a.seed}.csv"
    pd.DataFrame([row]).to_csv(out, mode="a", header=not out.exists(), index=False)
    print(f"appended to {out}")


if __name__ == "__main__":
    main()
