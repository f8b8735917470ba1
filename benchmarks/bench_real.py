"""Real-executor benchmark on local Ray (4 logical GPUs, tiny model, CPU): writes out/bench_real/.

1. Real runs of colocate, async and elastic (preset tiny-cpu): the simulator's output files, traces,
   profiles, and a learning-curve figure (reward vs step and vs wall time, one line per policy).
2. Control-plane cost: time to move one GPU rollout -> train -> rollout (engine sleep, trainer step
   start/end bookkeeping, engine wake; measured from the role log), and the pause per migrated
   execution (from its move to its first token on the target: re-prefill + queueing).
3. Sim-to-real: the simulator calibrated on each policy's profile predicts every policy's real
   makespan, replaying the calibrating run's trace ("source" workload: what a user has before running the
   other policy) and each predicted policy's own trace ("own": the cost model's error alone); predicted
   vs measured, error per pair. With --repeat N the whole set runs N times (RL runs differ run to run)
   and the errors are summarized by median and worst over the repeats.
4. Weight sync: seconds to publish a new version from a trainer worker to 1 and to 3 awake engines, by
   the Ray object store and by a gloo broadcast (`weight_sync_times`), per round and per engine.

Usage: .venv/bin/python benchmarks/bench_real.py [--steps N] [--eta E] [--repeat N] [--out DIR] [--sync-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd

POLICIES = ["colocate", "async", "elastic"]


def switch_costs(log: list[tuple]) -> dict[str, float]:
    """Median seconds per GPU from leaving rollout to training, and from leaving training to serving again.

    Both include everything the control plane does in between (draining to a tool-call boundary,
    engine sleep, trainer start; engine wake with the latest weights), read off the role log."""
    role: dict[int, int] = {}
    left: dict[tuple[int, int], float] = {}
    out_s, in_s = [], []
    for rec in log:
        if rec[0] != "role":
            continue
        _, t, gpus, r = rec
        for g in gpus:
            prev = role.get(g)
            if prev in (1, 2) and r != prev:
                left[(g, prev)] = t
            if r == 2 and (g, 1) in left:
                out_s.append(t - left.pop((g, 1)))
            if r == 1 and (g, 2) in left:
                in_s.append(t - left.pop((g, 2)))
            role[g] = r
    return {"rollout_to_train_s": float(np.median(out_s)) if out_s else float("nan"),
            "train_to_rollout_s": float(np.median(in_s)) if in_s else float("nan"),
            "moves": len(out_s)}


class MoveProbe:
    """Two engines; mid-step every live execution on engine A migrates to B, A's GPU trains, then serves again."""

    name = "move-probe"

    def run(self, cluster, steps):
        from gyre.handles import all_of

        a, b = yield all_of([cluster.start_engine([0]), cluster.start_engine([1])])
        for _ in range(steps):
            groups = [cluster.next_group() for _ in range(cluster.groups_per_step)]
            done = [cluster.admit(x, a) for g in groups for x in g.executions]
            yield cluster.timeout(0.15)
            t = cluster.now
            yield all_of([cluster.migrate(x, b) for x in cluster.live() if x.engine_id == a.id])
            drain = cluster.now - t
            gpus, t = a.gpus, cluster.now
            yield cluster.stop_engine(a)
            stop = cluster.now - t
            yield all_of(done)
            yield cluster.train(gpus, groups)
            t = cluster.now
            a = yield cluster.start_engine(gpus)
            start = cluster.now - t
            yield cluster.sync([b])
            cluster.note("probe", drain_s=drain, stop_s=stop, start_s=start)
            a, b = b, a


def weight_sync_times(pool, rounds: int = 20) -> pd.DataFrame:
    """Publish the weights of trainer worker N-1 to engines 0.. (awake) `rounds` times by each path.

    object_store: a fresh object ref of the snapshot per round (as a step's end makes one), loaded by every
    engine (`load_weights`); collective: `send_weights` + `receive_weights` over one cached group (its first
    round, which builds the group, is reported apart). Times are from submit to the last engine done."""
    import time

    import ray

    src = len(pool.trainers) - 1
    trainer = pool.trainers[src]
    v = ray.get(trainer.reset.remote(0))
    engines = [pool.engine((g,)) for g in range(0, src, pool.cfg.gpus_per_engine)]
    ray.get([e.wake.remote(trainer.weights.remote(v), v) for e in engines])
    rows = []
    for n in (1, len(engines)):
        targets = engines[:n]
        times = {"object_store": [], "collective": []}
        for _ in range(rounds):
            t0 = time.perf_counter()
            ref = trainer.weights.remote(v)
            ray.get([e.load_weights.remote(ref, v) for e in targets])
            times["object_store"].append(time.perf_counter() - t0)
        members = (f"t{src}",) + tuple(pool.member((g,)) for g in range(n))
        for _ in range(rounds + 1):
            specs = pool.book.specs(members, "sync")
            t0 = time.perf_counter()
            ray.get([trainer.send_weights.remote(specs[0], v)]
                    + [e.receive_weights.remote(s, v) for e, s in zip(targets, specs[1:])])
            times["collective"].append(time.perf_counter() - t0)
        first = times["collective"].pop(0)
        for how, ts in times.items():
            med = float(np.median(ts))
            rows.append({"path": how, "engines": n, "round_s": med, "per_engine_s": med / n,
                         "p90_round_s": float(np.quantile(ts, 0.9)),
                         "first_round_s": first if how == "collective" else float(ts[0])})
    ray.get([e.sleep.remote() for e in engines])
    return pd.DataFrame(rows)


def learning_figure(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for r in results:
        lc = r.learning()
        smooth = lc["reward_mean"].rolling(5, min_periods=1).mean()
        axes[0].plot(lc["version"], smooth, label=r.policy)
        axes[1].plot(lc["t_s"], smooth, label=r.policy)
    axes[0].set_xlabel("training step")
    axes[1].set_xlabel("wall time (s)")
    axes[0].set_ylabel("mean reward (5-step rolling)")
    axes[0].legend(fontsize=8)
    fig.suptitle("real runs, tiny model on CPU (4 logical GPUs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_policies(cfg, policies, pool, out: Path, load: dict | None = None) -> list:
    """One real run per policy into `out` (outputs, learning figure); a failed policy is reported, not fatal.
    `load` receives each policy's 1-minute load average at its start and end: real makespans (and the costs
    calibrated from them) slow down with whatever else shares the machine."""
    import os

    from gyre.cluster import ClusterError
    from gyre.real.runner import run_real, write_outputs

    results = []
    for p in policies:
        before = os.getloadavg()[0]
        try:
            r = run_real(cfg, p, pool=pool)
        except ClusterError as exc:  # reported, and the other policies still run
            print(f"{p}: FAILED: {exc}", flush=True)
            continue
        if load is not None:
            load[p] = (before, os.getloadavg()[0])
        lc = r.learning()
        print(f"{p}: makespan {r.makespan_s:.1f}s, reward {lc['reward_mean'].iloc[:5].mean():.3f} -> "
              f"{lc['reward_mean'].iloc[-5:].mean():.3f}", flush=True)
        results.append(r)
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(out, results)
    learning_figure(results, out / "learning.png")
    return results


def sim_to_real(out: Path, policies: list[str]) -> pd.DataFrame:
    """Every (calibrated on, predicted) pair of the runs in `out`, on the source's and on the own workload."""
    from gyre.bridge.cost_fit import predict_makespans

    return pd.concat([predict_makespans(out, src, policies, workload=w) for w in ("source", "own")
                      for src in policies], ignore_index=True)


def control_plane(results, cfg, pool) -> pd.DataFrame:
    """Role moves and migrations read off the runs, and a probe policy's rollout -> train -> rollout."""
    from gyre.real.config import preset_tiny_test
    from gyre.real.runner import run_real

    rows = []
    for r in results:
        mig = np.asarray(r.profile["migration"], dtype=float).reshape(-1, 3)
        rows.append({"policy": r.policy, **switch_costs(r.log),
                     "migrations": len(mig), "migration_pause_s": float(np.median(mig[:, 2])) if len(mig) else np.nan,
                     "reprefill_s": float(np.median(mig[:, 1])) if len(mig) else np.nan})
    # one GPU rollout -> train -> rollout, and migrations, measured by a probe policy (the user-policy path)
    probe = run_real(dataclasses.replace(preset_tiny_test(), pool=cfg.pool, steps=4), MoveProbe(), pool=pool)
    notes = pd.DataFrame([x[3] for x in probe.log if x[0] == "note" and x[2] == "probe"])
    mig = np.asarray(probe.profile["migration"], dtype=float).reshape(-1, 3)
    rows.append({"policy": "move-probe", "rollout_to_train_s": float(notes["stop_s"].median()),
                 "train_to_rollout_s": float(notes["start_s"].median()), "moves": len(notes),
                 "migrations": len(mig), "migration_pause_s": float(np.median(mig[:, 2])) if len(mig) else np.nan,
                 "reprefill_s": float(np.median(mig[:, 1])) if len(mig) else np.nan,
                 "drain_s": float(notes["drain_s"].median())})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("out/bench_real"))
    ap.add_argument("--policies", nargs="*", default=POLICIES)
    ap.add_argument("--eta", type=int, default=None, help="staleness bound for async and elastic (default: theirs)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the policies this many times (into OUT/run<i>/); sim-to-real errors are summarized "
                         "over the repeats (median and worst)")
    ap.add_argument("--sync-only", action="store_true", help="only the weight-sync timing (section 4)")
    args = ap.parse_args()
    from gyre.real.pool import ActorPool
    from gyre.real.config import preset_tiny_cpu

    cfg = dataclasses.replace(preset_tiny_cpu(), steps=args.steps)
    if args.eta is not None:
        cfg = dataclasses.replace(cfg, policy_params={p: {"eta": args.eta} for p in ("async", "elastic")})
    pool = ActorPool.shared(cfg.pool)
    args.out.mkdir(parents=True, exist_ok=True)
    sync = weight_sync_times(pool)
    sync.to_csv(args.out / "weight_sync.csv", index=False)
    print(sync.to_string(index=False), flush=True)
    if args.sync_only:
        return

    preds, runs, first = [], [], None
    for i in range(args.repeat):
        out = args.out if args.repeat == 1 else args.out / f"run{i}"
        if args.repeat > 1:
            print(f"--- repeat {i + 1}/{args.repeat} -> {out}", flush=True)
        load: dict = {}
        results = run_policies(cfg, args.policies, pool, out, load)
        first = first or results
        ran = [r.policy for r in results]
        p = sim_to_real(out, ran).assign(repeat=i)
        p.to_csv(out / "sim_to_real.csv", index=False)
        print(p.to_string(index=False), flush=True)
        preds.append(p)
        for r in results:
            lc = r.learning()
            runs.append({"repeat": i, "policy": r.policy, "makespan_s": r.makespan_s,
                         "load_start": load[r.policy][0], "load_end": load[r.policy][1],
                         "reward_first5": float(lc["reward_mean"].iloc[:5].mean()),
                         "reward_last5": float(lc["reward_mean"].iloc[-5:].mean())})
    preds = pd.concat(preds, ignore_index=True)
    runs = pd.DataFrame(runs)
    control = control_plane(first, cfg, pool)
    control.to_csv(args.out / "control_plane.csv", index=False)
    print(control.to_string(index=False))

    preds["abs_error"] = preds["error"].abs()
    summary = (preds.groupby(["workload", "calibrated_on", "policy"])["abs_error"]
             .agg(median="median", worst="max").reset_index())
    if args.repeat > 1:
        preds.to_csv(args.out / "sim_to_real_all.csv", index=False)
        runs.to_csv(args.out / "runs.csv", index=False)
        print(runs.to_string(index=False))
        print(runs.groupby("policy")[["makespan_s", "reward_last5"]].median().to_string())
    summary.to_csv(args.out / "sim_to_real_summary.csv", index=False)
    print(summary.to_string(index=False))
    for w, g in preds.groupby("workload"):
        print(f"sim-to-real, {w} workload: median |error| {g['abs_error'].median():.3f}, "
              f"worst {g['abs_error'].max():.3f} over {len(g)} predictions")
        if args.repeat > 1:
            for i, gi in g.groupby("repeat"):
                print(f"  repeat {i}: median {gi['abs_error'].median():.3f}, worst {gi['abs_error'].max():.3f}")
    (args.out / "bench.json").write_text(json.dumps({
        "control_plane": control.to_dict(orient="records"), "sim_to_real": preds.to_dict(orient="records"),
        "runs": runs.to_dict(orient="records"), "weight_sync": sync.to_dict(orient="records"),
        "learning": {r.policy: r.learning()[["version", "t_s", "reward_mean"]].to_dict(orient="list")
                     for r in first},
    }, default=float, indent=1))


if __name__ == "__main__":
    main()
