"""Elastic at given etas, per-engine caps and ElasticConfig fields, with colocate: equal-work rows for issue 26.

Runs `model_based.run` (makespan, deadline and scheduler-induced cuts, tokens generated, preemptions,
migrations) for colocate (with --colocate) and elastic at every (eta, cap) given, each with the extra
ElasticConfig fields of --set, and appends the rows (with --label and the commit) to
results/admission_<preset>_s<steps>_seed<seed>.csv. Equal work is judged in the README against the
least-cutting row of the same table (1% of the executions).

Usage: python experiments/elastic_vs_baselines/admission.py --etas 2 4 --caps 0 8 4 2 --colocate --label cap
       python experiments/elastic_vs_baselines/admission.py --etas 2 4 --set admission=protect --label rule
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.presets import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_based import HERE, run  # noqa: E402


def value(s: str):
    """A --set value: int, float, None or the string itself."""
    if s == "None":
        return None
    for t in (int, float):
        try:
            return t(s)
        except ValueError:
            pass
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--etas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--caps", type=int, nargs="+", default=[0], help="max_running values; 0: none")
    ap.add_argument("--set", nargs="*", default=[], help="extra ElasticConfig fields, key=value")
    ap.add_argument("--colocate", action="store_true")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    extra = {k: value(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = HERE / "results" / f"admission_{a.preset}_s{a.steps}_seed{a.seed}.csv"
    runs = [("colocate", {})] if a.colocate else []
    runs += [("elastic", {"eta": e, **({"max_running": c} if c else {}), **extra}) for e in a.etas for c in a.caps]
    for policy, params in runs:
        row = {"label": a.label, "commit": commit, "preset": a.preset, "steps": a.steps, "seed": a.seed,
               **run(cfg, policy, params), "params": " ".join(f"{k}={v}" for k, v in params.items())}
        print(row, flush=True)
        pd.DataFrame([row]).to_csv(out, mode="a", header=not out.exists(), index=False)


if __name__ == "__main__":
    main()
