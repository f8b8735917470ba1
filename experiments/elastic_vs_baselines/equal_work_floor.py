"""The work floor at equal work: no policy that meets its executions' deadlines can decode at a full engine's pace.

ceiling.py's work floor charges every generated token at a full engine's pace (the admission limit's
sequences sharing each step). At equal work an execution must also finish by its deadline, and an engine
step with n sequences takes step_time(n) for each of them, so an execution with T generated tokens and B
seconds of its deadline left for decoding (the deadline less its tool seconds, its prefills at their
cheapest and its requests' latency: sim/cluster/bound.py's solo latency less its decode) decodes at a mean
step time of at most a = B / T. Its share of the engine's time is step_time(n) / n per token. Over any mix of
batch sizes with mean step time <= a, the least mean share is the lower convex hull of the points
(step_time(n), step_time(n) / n), n = 1 .. the engine's admission limit, at a (the share falls as the step
time grows, so the hull at min(a, step_time(limit))). Step times are taken at zero context (the roofline's
step grows with context, so this only lowers the floor).

Equal work lets a run cut up to `allow` executions by its scheduling beyond those that miss their deadline
even alone (the protocol's least sched cuts of the compared rows plus 1% of the executions); the floor lets
the `allow` executions with the largest decode charge go free, and charges nothing for one that misses
alone. Their training is kept (a cut execution still trains its partial trajectory; removing them would
lower the training floor by at most their share of the trained tokens, printed). The floor is then

    (sum of the executions' decode charge x engine GPUs + every tool output's prefill at its cheapest
     + the training GPU-work as the simulator charges it) / N,

a makespan no policy at equal work beats, whatever its split or its controller. Measured makespans over it
bound what any policy could gain on them.

Usage: python experiments/elastic_vs_baselines/equal_work_floor.py --preset xlong-swe-kv --steps 48 --seed 0
           [--allow 265] [--async-h 159.85 --colocate-h 238.22]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from gyre.config import override
from gyre.hardware import admission_limit
from gyre.presets import get_preset
from gyre.sim.cluster.bound import per_exec
from gyre.workload import sample_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "regime_map"))
from physics import cell_physics  # noqa: E402


def lower_hull(xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lower convex hull of the points (xs ascending), as its vertices."""
    hx, hy = [], []
    for x, y in zip(xs, ys):
        while len(hx) >= 2 and (hy[-1] - hy[-2]) * (x - hx[-2]) >= (y - hy[-2]) * (hx[-1] - hx[-2]):
            hx.pop()
            hy.pop()
        hx.append(float(x))
        hy.append(float(y))
    return np.array(hx), np.array(hy)


def decode_share_per_token(costs, limit: int):
    """f(a): the least mean engine-seconds per token of a sequence whose mean step time is at most a
    (np.inf where a is below a lone sequence's step)."""
    n = np.arange(1, limit + 1)
    step = np.array([costs.step_time(int(k), 0.0) for k in n])
    hx, hy = lower_hull(step, step / n)

    def f(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a, float)
        out = np.interp(np.minimum(a, hx[-1]), hx, hy)
        return np.where(a < hx[0], np.inf, out)

    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allow", type=int, default=None,
                    help="executions a run may cut by its scheduling (default: 1%% of the executions)")
    ap.add_argument("--async-h", type=float, default=None, help="a measured equal-work async makespan, hours")
    ap.add_argument("--colocate-h", type=float, default=None, help="a measured equal-work colocate makespan, hours")
    a = ap.parse_args()
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed)
    c, w = cfg.costs(), cfg.workload
    n_gpus, gps = cfg.cluster.gpus, w.groups_per_step
    limit = admission_limit(c.kv_capacity_tokens, w.context_window, c.admission_fill, c.state_tokens)
    if c.max_num_seqs:
        limit = min(limit, c.max_num_seqs)
    share = decode_share_per_token(c, limit)
    full = float(share(np.inf))
    charge, full_charge, intrinsic = [], [], 0
    prefill_gpu_s = train_gpu_s = 0.0
    trained_tok = 0.0
    tok_of = []
    for s in range(a.steps):
        groups = [sample_group(w, g, s, a.seed) for g in range(s * gps, (s + 1) * gps)]
        ph = cell_physics(cfg, groups)
        train_gpu_s += ph["train_gpu_h"] * 3600
        prefill_gpu_s += ph["rollout_gpu_h"] * 3600 * ph["prefill_share"]
        execs = [e for g in groups for e in g.executions]
        p = per_exec(execs, c)
        for e, solo in zip(execs, p.solo):
            gen = np.asarray(e.gen, float)
            T = float(gen.sum())
            decode_alone = float(np.dot(gen, c.decode_s_per_token(np.asarray(e.kv, float))))
            budget = e.deadline_s - (solo - decode_alone)  # solo = min(alone, deadline)
            if solo >= e.deadline_s or T <= 0:
                intrinsic += solo >= e.deadline_s
                charge.append(0.0)
            else:
                charge.append(T * float(share(budget / T)))
            full_charge.append(T * full)
            tok_of.append(T)
        trained_tok += sum(g.executions[0].prompt + sum(e.tokens - e.prompt for e in g.executions) for g in groups)
    charge = np.array(charge) * c.engine_gpus
    full_charge = np.array(full_charge) * c.engine_gpus
    n_exec = len(charge)
    allow = a.allow if a.allow is not None else n_exec // 100
    order = np.argsort(charge)[::-1]
    kept = charge.copy()
    kept[order[:allow]] = 0.0
    free_tok = float(np.array(tok_of)[order[:allow]].sum())
    floor = (kept.sum() + prefill_gpu_s + train_gpu_s) / n_gpus
    pace = (full_charge.sum() + prefill_gpu_s + train_gpu_s) / n_gpus
    print(f"{a.preset}, {a.steps} steps, seed {a.seed}: N = {n_gpus}, engines of {c.engine_gpus}, admission limit "
          f"{limit}; {n_exec:,} executions, {intrinsic} miss their deadline even alone, {allow} more may be cut")
    print(f"decode GPU-h: at a full engine's pace {full_charge.sum() / 3600:,.0f}; meeting deadlines "
          f"{charge.sum() / 3600:,.0f} ({charge.sum() / full_charge.sum():.2f}x); with the {allow} dearest free "
          f"{kept.sum() / 3600:,.0f}; tool-output prefill {prefill_gpu_s / 3600:,.0f}; training {train_gpu_s / 3600:,.0f}")
    print(f"work floor at a full engine's pace {pace / 3600:.2f} h; at equal work {floor / 3600:.2f} h "
          f"(the {allow} cut executions hold {free_tok / max(trained_tok, 1):.1%} of the trained tokens at most)")
    for name, h in (("async", a.async_h), ("colocate", a.colocate_h)):
        if h:
            print(f"{name} {h:.2f} h: at most {h * 3600 / floor:.3f}x faster at equal work")


if __name__ == "__main__":
    main()
