"""Fault soak on the real backend: every registered policy under random engine and trainer-worker kills.

For each policy x fault kind x seed, one run of the tiny-test preset (local Ray, 4 logical GPUs) with the
kind's faults drawn from the seed (gyre.faults); every policy on-policy (eta 0), so the log-prob mismatch
says whether the engines served the trainer's weights. Per run: completed or the error, what the log counts
(gyre.faults.fault_summary), and the largest log-prob mismatch of a step. Writes runs.csv and the
survival table (policy x fault kind: runs, completed, faults fired, executions lost, duplicated, max
recovery time) as table.md.

    .venv/bin/python benchmarks/bench_faults.py --seeds 2 --steps 4 --out out/bench_faults
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import pandas as pd

KINDS = {
    "engines": ("random-engines:3",),
    "trainer": ("random-trainers:2",),
    "mixed": ("random-engines:3", "random-trainers:2"),
}
ON_POLICY = {"async": {"eta": 0}, "elastic": {"eta": 0}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--out", default="out/bench_faults")
    args = ap.parse_args()

    from gyre.cluster import ClusterError
    from gyre.policies import REGISTRY
    from gyre.faults import fault_summary
    from gyre.real.pool import ActorPool
    from gyre.real.config import preset_tiny_test
    from gyre.real.runner import run_real

    base = preset_tiny_test()
    pool = ActorPool.shared(base.pool)
    rows = []
    for seed in range(args.seeds):
        for kind, faults in KINDS.items():
            for policy in sorted(REGISTRY):
                cluster = dataclasses.replace(base.cluster, seed=100 + seed, faults=faults,
                                              checkpoint_every=args.checkpoint_every)
                cfg = dataclasses.replace(base, steps=args.steps, cluster=cluster, policy_params=ON_POLICY)
                t0 = time.perf_counter()
                row = {"policy": policy, "kind": kind, "seed": 100 + seed}
                try:
                    r = run_real(cfg, policy, pool=pool)
                    lc = r.learning()
                    row |= {"completed": len(lc) == args.steps, **fault_summary(r.log),
                            "logp_mismatch_max": float(lc["logp_mismatch"].max()), "makespan_s": r.makespan_s,
                            "error": ""}
                except ClusterError as exc:
                    row |= {"completed": False, "error": str(exc)[:200]}
                row["wall_s"] = time.perf_counter() - t0
                rows.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = pd.DataFrame(rows)
    runs.to_csv(out / "runs.csv", index=False)
    table = runs.groupby(["policy", "kind"]).agg(
        runs=("completed", "size"), completed=("completed", "sum"), faults=("faults", "sum"),
        lost=("executions_lost", "sum"), duplicated=("executions_duplicated", "sum"),
        moved=("executions_moved", "sum"), respawns=("respawns", "sum"),
        max_recovery_s=("recovery_s_max", "max"), max_logp_mismatch=("logp_mismatch_max", "max")).reset_index()
    lines = ["| policy | faults | runs | completed | faults fired | executions lost | duplicated | moved | respawns "
             "| max recovery | max logp mismatch |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in table.itertuples():
        lines.append(f"| {t.policy} | {t.kind} | {t.runs} | {int(t.completed)} | {int(t.faults)} | {int(t.lost)} | "
                     f"{int(t.duplicated)} | {int(t.moved)} | {int(t.respawns)} | {t.max_recovery_s:.1f} s | "
                     f"{t.max_logp_mismatch:.1e} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"{len(runs)} runs, {int(runs['faults'].sum())} faults fired; wrote {out}/runs.csv, table.md")


if __name__ == "__main__":
    main()
