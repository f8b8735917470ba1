"""What the physics allows elastic against async and colocate over a whole run, with nothing simulated.

For one preset, seed and step count, per step from the groups the run must train (as the simulator draws
them) and the cost model alone (experiments/regime_map/physics.py's figures for each step's groups):

- rollout GPU-work: every generated token decoded at a full engine's pace (the admission limit's
  sequences at the step's token-weighted mean context) plus every tool output's prefill at its least cost;
  training GPU-work: the step's batch as the simulator charges it. Cut executions are counted whole (equal
  work: none is cut);
- latency: each step waits at least its slowest execution alone on an engine, capped at its deadline
  (sim/cluster/bound.py's solo latency); with staleness bound eta the run is at least the staleness chain over
  those (sim/cluster/bound.py, no execution exempted), and at least the longest group plus its training;
- elastic's floor, per eta: max(work / N, that chain, the critical path) (no allocation beats the work
  spread over all N GPUs);
- async's floor at its best split R (engine multiples, trainer >= its memory minimum): max(rollout work /
  R, training work / (N - R), the chain, the critical path); where rollout work dominates, R = N - minimum
  and async / elastic tends to the throughput ceiling N / (N - minimum) times the rollout share;
- colocate's floor: its steps one after another, each at least max(its slowest execution alone + its
  training on N, its work / N).

A floor is what a policy cannot beat, so a ratio of floors is what the ratio of makespans would be with both
policies at their floors; a policy far from its floor (an over-filled async, a colocate waiting for its
tail) loses more. The README sets the measured makespans beside them.

Usage: python experiments/elastic_vs_baselines/ceiling.py --preset xlong-swe-kv --steps 48 --seed 0 --etas 0,1,4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from gyre.config import override
from gyre.sim.cluster.bound import _group_max, per_exec
from gyre.presets import get_preset
from gyre.workload import sample_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "regime_map"))
from physics import cell_physics  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--etas", default="0,1,4")
    a = ap.parse_args()
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed)
    costs, w = cfg.costs(), cfg.workload
    n, per, need, gps = cfg.cluster.gpus, costs.engine_gpus, costs.min_train_gpus, w.groups_per_step
    roll, train, slow = np.zeros(a.steps), np.zeros(a.steps), np.zeros(a.steps)
    for s in range(a.steps):
        groups = [sample_group(w, g, s, a.seed) for g in range(s * gps, (s + 1) * gps)]
        ph = cell_physics(cfg, groups)
        roll[s], train[s] = ph["rollout_gpu_h"] * 3600, ph["train_gpu_h"] * 3600
        p = per_exec([e for g in groups for e in g.executions], costs)
        slow[s] = float(_group_max(p.solo, np.fromiter((len(g.executions) for g in groups), np.int64, gps)).max())
    work = (roll.sum() + train.sum()) / n
    critical = float(np.max(slow + train / n))
    colocate = float(np.maximum(slow + train / n, (roll + train) / n).sum())
    print(f"{a.preset}, {a.steps} steps, seed {a.seed}: N = {n}, engines of {per}, trainer >= {need}; throughput "
          f"ceiling N / (N - minimum) = {n / (n - need):.3f}x; rollout {roll.sum() / 3600:,.0f} GPU-h, training "
          f"{train.sum() / 3600:,.0f} GPU-h (rollout share {roll.sum() / (roll.sum() + train.sum()):.3f}); slowest "
          f"execution alone per step {slow.min() / 3600:.2f}-{slow.max() / 3600:.2f} h")
    print("| eta | elastic floor (h): work / chain / critical | async floor (h, best R) | colocate floor (h) | "
          "async / elastic floors | colocate / elastic floors |")
    print("|---|---|---|---|---|---|")
    for eta in (int(x) for x in a.etas.split(",")):
        # the staleness chain (sim/cluster/bound.py): steps eta + 1 apart follow one another, each at least its
        # slowest execution; summed along the eta + 1 chains, the longest steps sharing chains
        chain = (float(np.sort(slow)[::-1].sum()) + train.sum() / n) / (eta + 1)
        el = max(work, chain, critical)
        best = min((max(roll.sum() / r, train.sum() / (n - r)), r) for r in range(per, n - need + 1, per))
        asy = max(best[0], chain, critical)
        print(f"| {eta} | {el / 3600:.2f}: {work / 3600:.2f} / {chain / 3600:.2f} / {critical / 3600:.2f} | "
              f"{asy / 3600:.2f} (R = {best[1]}) | {colocate / 3600:.2f} | {asy / el:.3f}x | {colocate / el:.3f}x |")


if __name__ == "__main__":
    main()
