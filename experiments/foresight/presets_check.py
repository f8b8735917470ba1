"""On presets whose tasks never recur, does a predictor change anything? (It must not: every task is new, so
every group scores the same and ordered admission keeps the drawn order.)

Runs async and elastic (eta 4; async at the split its default picks) with predictor none and with
history+siblings (lookahead 4) on each preset for a few steps, and writes results/presets_check.csv with
both makespans and whether the admissions (execution, time) are identical.

Usage: python experiments/foresight/presets_check.py [--steps 4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate

HERE = Path(__file__).resolve().parent
PRESETS = ("short-math", "xlong-swe-small", "xlong-swe", "xlong-swe-kv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    rows = []
    for preset in PRESETS:
        cfg = override(get_preset(preset), steps=args.steps)
        for policy in ("async", "elastic"):
            runs = {p: simulate(cfg, policy, {"eta": 4, "predictor": p, "lookahead": 4})
                    for p in ("none", "history+siblings")}
            admits = {p: [x[1:3] for x in r.log if x[0] == "admit"] for p, r in runs.items()}
            rows.append({"preset": preset, "steps": args.steps, "policy": policy,
                         "makespan_none_s": runs["none"].makespan_s,
                         "makespan_predictor_s": runs["history+siblings"].makespan_s,
                         "same_admissions": admits["none"] == admits["history+siblings"]})
            print(rows[-1], flush=True)
    out = HERE / "results" / "presets_check.csv"
    pd.DataFrame(rows).to_csv(out, index=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
