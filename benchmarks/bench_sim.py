"""Simulator speed: xlong-swe at 1,024 GPUs for 48 steps, plus scaling tables.

Prints wall seconds, CPU seconds, events, events/s and simulated-time / wall-time for the headline run,
then (unless --headline-only) (a) wall time as the cluster grows from 64 to 4,096 GPUs with executions per GPU held fixed, and
(b) wall time for 70K / 700K / 7M tokens per rollout with the turn count held fixed: cost must follow
executions and events, not tokens. Run: `.venv/bin/python benchmarks/bench_sim.py [--quick]`.

`--vs REV` times this checkout's simulator against commit REV's instead, side by side in one run: REV is
checked out with `git worktree add` (kept in /tmp for the next run), and every measurement is a subprocess
running one tree's code (benchmarks/behaviour_hashes.py's `use_tree`) on the headline workload, old and new
alternating per policy and repeat. It prints each pair's CPU seconds in the cluster's run (the ratio that
other processes' load moves least), wall seconds of the run and CPU seconds of the whole process, events and
events per CPU-second, the ratios, the medians over repeats, the load average, whether the two trees' event
logs are identical, and how many hot-path modules the new tree ran compiled (gyre.compiled; `GYRE_PURE=1`
times its pure-Python fallback).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from behaviour_hashes import sim_module, use_tree  # noqa: E402

if __name__ == "__main__" and "--root" in sys.argv:  # --one on another checkout: its packages, before gyre's
    use_tree(Path(sys.argv[sys.argv.index("--root") + 1]))

from gyre.config import override  # noqa: E402
from gyre.presets import MODELS, get_preset  # noqa: E402
from gyre.workload import LogNormal  # noqa: E402

simulate = sim_module("gyre.sim.harness.runner", "gyre.sim.runner").simulate  # this tree's, or --root's


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


def one(policy: str, steps: int) -> dict:
    """One headline run in this process (--one): its timing, event count and the sha256 of its event log.
    `run_cpu_s` is the CPU time of the cluster's run alone (the simulator's core with the policy and the
    workload's sampling: what `wall_s` times, but not moved by other processes' load); `cpu_s` also counts
    building the run and its metrics, bound and cut counts."""
    params = {"eta": 2} if policy != "colocate" else {}
    cluster_cls = sim_module("gyre.sim.cluster.backend", "gyre.sim.backend").SimCluster
    run, spent = cluster_cls.run, []

    def timed_run(self, *a, **k):
        c = time.process_time()
        try:
            return run(self, *a, **k)
        finally:
            spent.append(time.process_time() - c)

    cluster_cls.run = timed_run
    c0 = time.process_time()
    r = simulate(override(get_preset("xlong-swe"), steps=steps), policy, params)
    cpu = time.process_time() - c0
    import gyre

    compiled = getattr(getattr(gyre, "compiled", None), "active", list)()
    log = hashlib.sha256("\n".join(repr(rec) for rec in r.log).encode()).hexdigest()
    return {"wall_s": r.wall_s, "cpu_s": cpu, "run_cpu_s": sum(spent), "events": r.events, "log_sha": log,
            "compiled": len(compiled)}


def tree_for(rev: str) -> Path:
    """A checkout of `rev` (a git worktree in /tmp, made once)."""
    repo = HERE.parent
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=repo, capture_output=True, text=True, check=True)
    path = Path(f"/tmp/gyre-bench-{sha.stdout.strip()}")
    if not (path / "gyre" / "__init__.py").exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=repo, check=True,
                       capture_output=True)
    return path


def run_tree(root: Path | None, policy: str, steps: int) -> dict:
    cmd = [sys.executable, str(HERE / "bench_sim.py"), "--one", policy, "--steps", str(steps)]
    if root is not None:
        cmd += ["--root", str(root)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def versus(rev: str, policies: list[str], steps: int, repeats: int) -> None:
    """This checkout against `rev`, alternating old and new, each run in its own process."""
    old_root = tree_for(rev)
    load0 = os.getloadavg()
    print(f"xlong-swe, 1,024 GPUs x {steps} steps; old = {rev} ({old_root}), new = {HERE.parent}; "
          f"load average {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} (1 / 5 / 15 min), {os.cpu_count()} CPUs",
          flush=True)
    rows = []
    for rep in range(repeats):
        for pol in policies:
            old = run_tree(old_root, pol, steps)
            new = run_tree(None, pol, steps)
            row = {"policy": pol, "repeat": rep, "old_wall_s": old["wall_s"], "new_wall_s": new["wall_s"],
                   "old_run_cpu_s": old["run_cpu_s"], "new_run_cpu_s": new["run_cpu_s"],
                   "old_cpu_s": old["cpu_s"], "new_cpu_s": new["cpu_s"], "events": new["events"],
                   "old_events_per_cpu_s": old["events"] / old["run_cpu_s"],
                   "new_events_per_cpu_s": new["events"] / new["run_cpu_s"],
                   "ratio_wall": old["wall_s"] / new["wall_s"], "ratio_run_cpu": old["run_cpu_s"] / new["run_cpu_s"],
                   "ratio_cpu": old["cpu_s"] / new["cpu_s"],
                   "same_events": old["events"] == new["events"], "same_log": old["log_sha"] == new["log_sha"],
                   "new_compiled_modules": new["compiled"], "new_log_sha": new["log_sha"][:12],
                   "load_1min": os.getloadavg()[0]}
            rows.append(row)
            print(pd.DataFrame([row]).to_string(index=False, float_format=lambda x: f"{x:,.2f}"), flush=True)
    df = pd.DataFrame(rows)
    med = df.groupby("policy", sort=False).agg(
        old_run_cpu_s=("old_run_cpu_s", "median"), new_run_cpu_s=("new_run_cpu_s", "median"),
        events=("events", "first"), old_events_per_cpu_s=("old_events_per_cpu_s", "median"),
        new_events_per_cpu_s=("new_events_per_cpu_s", "median"), ratio_run_cpu=("ratio_run_cpu", "median"),
        ratio_wall=("ratio_wall", "median"), ratio_cpu=("ratio_cpu", "median"), same_log=("same_log", "all"))
    print(f"\n== medians over {repeats} repeat(s); load average now {os.getloadavg()[0]:.1f} ==")
    print(med.to_string(float_format=lambda x: f"{x:,.2f}"))
    tot_old, tot_new = df["old_run_cpu_s"].sum(), df["new_run_cpu_s"].sum()
    print(f"all runs' CPU in the cluster's run: old {tot_old:,.1f} s, new {tot_new:,.1f} s, ratio {tot_old / tot_new:.2f}x; "
          f"event logs identical: {bool(df['same_log'].all())}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps (for a smoke run)")
    ap.add_argument("--policies", default="colocate,async,elastic")
    ap.add_argument("--skip-headline", action="store_true", help="only the scaling tables")
    ap.add_argument("--headline-only", action="store_true", help="only the headline run, no scaling tables")
    ap.add_argument("--vs", metavar="REV", help="time this checkout against commit REV, side by side")
    ap.add_argument("--repeats", type=int, default=1, help="with --vs: old/new pairs per policy")
    ap.add_argument("--steps", type=int, help="with --vs or --one: steps (default 48; --quick 6)")
    ap.add_argument("--one", metavar="POLICY", help=argparse.SUPPRESS)  # one run, JSON out (--vs's subprocess)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)  # with --one: that checkout's code
    args = ap.parse_args()
    steps = args.steps or (6 if args.quick else 48)
    if args.one:
        print(json.dumps(one(args.one, steps)))
        return
    if args.vs:
        versus(args.vs, [p for p in args.policies.split(",") if p], steps, args.repeats)
        return
    pd.set_option("display.width", 200)
    base = get_preset("xlong-swe")
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
