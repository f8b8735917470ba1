"""Simulator speed: xlong-swe at 1,024 GPUs for 48 steps, plus scaling tables.

Prints wall seconds, CPU seconds, events, events/s and simulated-time / wall-time for the headline run,
then (unless --headline-only) (a) wall time as the cluster grows from 64 to 4,096 GPUs with executions per GPU held fixed, and
(b) wall time for 70K / 700K / 7M tokens per rollout with the turn count held fixed: cost must follow
executions and events, not tokens. Run: `.venv/bin/python benchmarks/bench_sim.py [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

import pandas as pd

from gyre.config import override
from gyre.presets import MODELS, get_preset
from gyre.sim.runner import simulate
from gyre.workload import LogNormal


def measure(cfg, policy: str, params: dict | None = None) -> dict:
    c0 = time.process_time()
    r = simulate(cfg, policy, params or {})
    cpu = time.process_time() - c0
    execs = sum(1 for rec in r.log if rec[0] == "finish")
    return {
        "policy": policy, "gpus": cfg.cluster.gpus, "steps": cfg.steps, "executions": execs,
        "wall_s": r.wall_s, "cpu_s": cpu, "load_avg": os.getloadavg()[0], "events": r.events, "events_per_s": r.events / r.wall_s,
        "events_per_exec": r.events / max(execs, 1), "sim_over_wall": r.makespan_s / r.wall_s,
        "makespan_h": r.makespan_s / 3600, "tokens_generated": int(r.metrics.executions["generated"].sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps (for a smoke run)")
    ap.add_argument("--policies", default="colocate,async,elastic")
    ap.add_argument("--skip-headline", action="store_true", help="only the scaling tables")
    ap.add_argument("--headline-only", action="store_true", help="only the headline run, no scaling tables")
    args = ap.parse_args()
    pd.set_option("display.width", 200)
    base = get_preset("xlong-swe")
    steps = 6 if args.quick else 48
    from gyre.policies import REGISTRY

    rows = []
    for pol in [p for p in args.policies.split(",") if p in REGISTRY and not args.skip_headline]:
        params = {"eta": 2} if pol != "colocate" else {}
        rows.append(measure(override(base, steps=steps), pol, params))
        print(pd.DataFrame(rows[-1:]).to_string(index=False), flush=True)
    if rows:
        print("\n== xlong-swe, moe-2.4t-a95b-gqa, 1,024 H200 ==")
        print(pd.DataFrame(rows).to_string(index=False))
    if args.headline_only:
        return

    # the 2.4T model needs >= 328 GPUs to train: the cluster-size table uses the 30B-A3B MoE (1-GPU engines)
    print("\n== scaling with cluster size (xlong-swe, moe-30b-a3b, executions per GPU fixed, async eta=2, 4 steps) ==")
    scale = []
    for gpus in (64, 256, 1024, 4096):
        gps = max(2, base.workload.groups_per_step * gpus // 1024)
        cfg = override(base, steps=4, **{"cluster.gpus": gpus, "cluster.model": MODELS["moe-30b-a3b"],
                                          "workload.groups_per_step": gps})
        scale.append(measure(cfg, "async", {"eta": 2}))
    print(pd.DataFrame(scale)[["gpus", "executions", "events", "wall_s", "events_per_s", "events_per_exec"]].to_string(index=False))

    print("\n== scaling with tokens per rollout (turns fixed; 512 GPUs, async eta=2, 4 steps) ==")
    tok = []
    for factor, label in ((0.1, "70K"), (1.0, "700K"), (10.0, "7M")):
        w = base.workload
        w = replace(w, gen_tokens=LogNormal(median=w.gen_tokens.median * factor, p99_ratio=w.gen_tokens.p99_ratio),
                    tool_out_tokens=LogNormal(median=w.tool_out_tokens.median * factor, p99_ratio=w.tool_out_tokens.p99_ratio),
                    context_window=int(w.context_window * max(1.0, factor)), groups_per_step=8)
        cfg = override(replace(base, workload=w), steps=4, **{"cluster.gpus": 512})
        row = measure(cfg, "async", {"eta": 2})
        row["p99_tokens_per_rollout"] = label
        tok.append(row)
    print(pd.DataFrame(tok)[["p99_tokens_per_rollout", "tokens_generated", "events", "wall_s", "events_per_exec"]].to_string(index=False))


if __name__ == "__main__":
    main()
