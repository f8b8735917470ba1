"""What placing executions by their length can buy at equal work: a fluid model of each execution alone at its concurrency.

Each execution of the workload decodes at the concurrency n a rule gives it: its tokens take step_time(n, n x
its context) each (the roofline, the context at each segment), plus its tool seconds; it is cut if that passes
its deadline, and it is charged step_time / n engine-seconds per token (x the engine's GPUs): its share of an
engine that runs n such sequences. No queueing, no prefill, no migrations; yet on xlong-swe-kv, 48 steps, seed
0, uniform n = 4 / 5 / 6 cut 989 / 1,049 / 1,107 here and elastic at caps 4 / 5 / 6 1,011 / 1,061 / 1,127 in the
simulator (818 miss alone here, ~828 there): the model's cuts track the simulator's. The rules compared:

- uniform n (one `max_running` for every execution, what elastic and async run today);
- tiers by age (`ElasticConfig.tiers`: n falls as the execution's age passes each threshold);
- the oracle: each execution at the largest n at which it meets its deadline, from its true length (foresight,
  which no policy has: the most any placement could buy);
- `--dp`: the best rule that sees only an execution's progress (tokens generated, seconds used), given even the
  true length distribution: a dynamic program over (tokens done, seconds used) in 5K-token chunks, minimizing
  expected GPU-time + lam x P(cut), on a fitted context ctx(k) = a + b k (so its GPU-time runs ~10% under the
  per-segment model's: compare it with the uniform rows it prints in the same model).
- `--bins B`: the same DP knowing also which of B quantiles of its group's scale (task difficulty x the step's
  growth) an execution's task is in, one DP per quantile: a bound on what a rule can learn from a GRPO group's
  other executions and the step, since given the scale an execution's length is independent of its siblings'.

`--cuts` compares the DP's rows with uniform n at that many cuts, on the lower convex hull of each family's
(cuts, GPU-h) points.

A makespan is then at least (decode GPU-h + tool-output prefill + training GPU-h) / N (equal_work_floor.py's
terms; at cap 5 elastic's measured makespan is within 3% of it).

Usage: python experiments/elastic_vs_baselines/placement_bound.py [--steps 48] [--seed 0] [--dp [--bins 1,16,64]]
"""

from __future__ import annotations

import argparse

import numpy as np

from gyre.config import override
from gyre.presets import get_preset
from gyre.workload import sample_group

NS = [63, 48, 32, 24, 16, 12, 10, 8, 6, 5, 4, 3, 2, 1]  # concurrencies, descending
RULES = {"uniform 4": ([4], []), "uniform 5": ([5], []), "uniform 6": ([6], []), "uniform 8": ([8], []),
         "uniform 16": ([16], []), "tiers 8/5/3 @2000/6000 s": ([8, 5, 3], [2000, 6000]),
         "tiers 12/6/3 @2000/6000 s": ([12, 6, 3], [2000, 6000]),
         "tiers 16/8/4 @2000/6000 s": ([16, 8, 4], [2000, 6000])}


def step_groups(cfg, step: int, seed: int):
    w = cfg.workload
    return [sample_group(w, g, step, seed) for g in range(step * w.groups_per_step, (step + 1) * w.groups_per_step)]


def per_segment(cfg, steps: int, seed: int):
    """Cuts and decode GPU-h of each rule, and of the oracle, execution by execution (per-segment contexts)."""
    c = cfg.costs()
    out = {k: [0, 0.0] for k in RULES}
    oracle = [0, 0.0]
    for s in range(steps):
        ex = [e for g in step_groups(cfg, s, seed) for e in g.executions]
        S, E = max(len(e.gen) for e in ex), len(ex)
        gen, ctx, tool = np.zeros((E, S)), np.zeros((E, S)), np.zeros((E, S))
        for i, e in enumerate(ex):
            m = len(e.gen)
            gen[i, :m], ctx[i, :m] = e.gen, np.asarray(e.kv) + np.asarray(e.gen) / 2
            tool[i, :len(e.tool_s)] = e.tool_s
        dl = np.array([e.deadline_s for e in ex])
        grid = np.linspace(0, max(ctx.max(), 1.0) * 1.01, 200)
        dt, cost = {}, {}
        for n in NS:
            st = np.interp(ctx, grid, [c.step_time(n, n * x) for x in grid])
            dt[n], cost[n] = gen * st + tool, gen * st / n
        for k, (ns, ages) in RULES.items():
            t, tier, cc = np.zeros(E), np.zeros(E, int), np.zeros(E)
            for j in range(S):
                for p, n in enumerate(ns):
                    m = tier == p
                    t[m] += dt[n][m, j]
                    cc[m] += cost[n][m, j]
                for p, age in enumerate(ages):  # the next segment runs at the next tier once its age passes
                    tier = np.where((tier == p) & (t > age), p + 1, tier)
            out[k][0] += int((t > dl).sum())
            out[k][1] += cc.sum()
        best = np.full(E, np.nan)
        for n in sorted(NS, reverse=True):
            best = np.where(np.isnan(best) & (dt[n].sum(1) <= dl), cost[n].sum(1), best)
        oracle[0] += int(np.isnan(best).sum())  # miss even alone: cut whatever the rule, charged nothing
        oracle[1] += np.nansum(best)
    g = c.engine_gpus / 3600
    return {k: (m, v * g) for k, (m, v) in out.items()}, (oracle[0], oracle[1] * g)


def lengths(cfg, steps: int, seed: int) -> dict:
    """Each execution's generated tokens T, tool seconds, sum of gen x context, its group's scale and step."""
    cols: dict = {"T": [], "tool": [], "kvg": [], "scale": [], "step": []}
    for s in range(steps):
        for g in step_groups(cfg, s, seed):
            for e in g.executions:
                x = np.asarray(e.gen, float)
                for key, v in (("T", x.sum()), ("tool", float(np.sum(e.tool_s))), ("scale", g.scale), ("step", s),
                               ("kvg", float(np.dot(x, np.asarray(e.kv, float) + x / 2)))):
                    cols[key].append(v)
    return {k: np.array(v) for k, v in cols.items()} | {"deadline": cfg.workload.deadline_s}


def progress_dp(cfg, steps: int, seed: int, lams: list[float], bins: int = 1, by: str = "scale",
                fit_seed: int | None = None):
    """The best rule that sees an execution's progress and, with `bins` > 1, which of `bins` bins of its group's
    scale (`by="scale"`: quantiles of the task's difficulty x the step's growth, `GroupSpec.scale`) or of the
    step (`by="step"`: runs of consecutive steps) it is in (module docstring): (name, cuts, GPU-h) per lam, after
    uniform n in the same model.

    Each bin gets its own DP over its executions' length distribution. In-sample (`fit_seed` None) the DP is
    fitted on the executions it is scored on: the rule knows its bin's exact distribution, more than a policy
    can learn (given the scale, an execution's length is independent of its siblings'). With `fit_seed` the DP
    is fitted on that seed's workload (scale bins at its quantiles) and scored on `seed`'s: what a rule learned
    from another run buys."""
    c = cfg.costs()
    ev = lengths(cfg, steps, seed)
    fit = ev if fit_seed is None else lengths(cfg, steps, fit_seed)
    T, dl = ev["T"], ev["deadline"]
    tool_pt = ev["tool"].sum() / T.sum()
    b, a = np.polyfit(T / 2, ev["kvg"] / T, 1)
    dk = 5000.0
    J = int(np.ceil(max(T.max(), fit["T"].max()) / dk)) + 1
    k = np.arange(J) * dk
    st = np.array([[c.step_time(n, n * (a + b * (kk + dk / 2))) for kk in k] for n in NS])
    dt = dk * (st + tool_pt)
    dc = dk * st / np.array(NS)[:, None] * c.engine_gpus / 3600
    TB = 1440
    tg = np.linspace(0, dl, TB + 1)
    if by == "step":
        which, fit_which = ev["step"] * bins // steps, fit["step"] * bins // steps
    else:
        edges = np.quantile(fit["scale"], np.arange(1, bins) / bins)
        which, fit_which = np.searchsorted(edges, ev["scale"]), np.searchsorted(edges, fit["scale"])

    def run(pol) -> tuple[int, float]:
        """Every execution chunk by chunk at pol[its quantile, chunk, time bin]'s concurrency: cuts, GPU-h."""
        t, done = np.zeros(len(T)), np.zeros(len(T))
        live = np.ones(len(T), bool)
        cut, gpu_h = 0, 0.0
        for j in range(J):
            live &= done < T
            if not live.any():
                break
            i = pol[which[live], j, np.minimum(np.searchsorted(tg, t[live]), TB)]
            part = np.minimum(dk, T[live] - done[live])
            t[live] += part * (st[i, j] + tool_pt)
            gpu_h += float(np.sum(part * st[i, j] / np.array(NS)[i])) * c.engine_gpus / 3600
            done[live] += part
            over = live & (t > dl)
            cut += int(over.sum())
            live &= ~over
        return cut, gpu_h

    def solve(Tq: np.ndarray, lam: float) -> np.ndarray:
        """The DP's concurrency index at (chunk, time bin) for executions of lengths Tq, a cut priced lam."""
        surv = np.array([(Tq > kk).sum() for kk in k], float)
        V, pol = np.zeros(TB + 1), np.zeros((J, TB + 1), int)
        for j in range(J - 1, -1, -1):
            if surv[j] == 0:
                continue
            more = surv[j + 1] / surv[j] if j + 1 < J else 0.0
            t2 = tg[None, :] + dt[:, j, None]
            cont = np.where(t2 > dl, lam, V[np.minimum(np.searchsorted(tg, t2), TB)])
            fin = np.where(tg[None, :] + dt[:, j, None] / 2 > dl, lam, 0.0)  # one ending in this chunk uses half
            val = dc[:, j, None] * (more + (1 - more) / 2) + more * cont + (1 - more) * fin
            pol[j], V = val.argmin(0), val.min(0)
        return pol

    rows = [(f"uniform {n}", *run(np.full((bins, J, TB + 1), NS.index(n)))) for n in (4, 5, 6, 8)]
    for lam in lams:
        pol = np.stack([solve(fit["T"][fit_which == q], lam) for q in range(bins)])
        name = "progress-only" if bins == 1 else f"progress + {by} ({bins} bins)"
        name += "" if fit_seed is None else f", fitted on seed {fit_seed}"
        rows.append((f"{name}, lam {lam:g}", *run(pol)))
    return rows


def at_cuts(points: list[tuple[int, float]], cuts: float) -> float:
    """GPU-h at `cuts` on the lower convex hull of (cuts, GPU-h) points: two rules mixed over the executions
    reach any point between them, so the hull is what a family of rules buys."""
    pts = sorted(set(points))
    hull: list[tuple[int, float]] = []
    for p in pts:
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])) <= 0:
            hull.pop()
        hull.append(p)
    xs, ys = zip(*hull)
    if not xs[0] <= cuts <= xs[-1]:
        return float("nan")
    return float(np.interp(cuts, xs, ys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dp", action="store_true", help="also the best progress-only rule (a lam sweep)")
    ap.add_argument("--lams", default="100,200,300,500", help="the DP's price of a cut, GPU-h")
    ap.add_argument("--cuts", type=float, default=1083,
                    help="compare the rules at this many cuts (xlong-swe-kv 48 steps seed 0: 818 miss alone + 265)")
    ap.add_argument("--bins", default="1", help="comma-separated: the DP also knows the group's scale quantile "
                    "(or step bin, --by step) among this many (1: progress only)")
    ap.add_argument("--by", choices=["scale", "step"], default="scale", help="what the DP's bins split")
    ap.add_argument("--fit-seed", type=int, default=None, help="fit the DP on this seed's workload (default: in-sample)")
    a = ap.parse_args()
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed)
    rules, (om, oh) = per_segment(cfg, a.steps, a.seed)
    print(f"{a.preset}, {a.steps} steps, seed {a.seed}: cuts (deadline, all causes) and decode GPU-h, each execution "
          f"alone at its rule's concurrency")
    for k, (m, h) in rules.items():
        print(f"  {k:>28}: cuts {m:6,d}  decode {h:9,.0f} GPU-h")
    print(f"  {'oracle (its true length)':>28}: cuts {om:6,d}  decode {oh:9,.0f} GPU-h (the cuts miss even alone)")
    if a.dp:
        print("in the DP's model (a fitted context; compare with its own uniform rows):")
        uni = None
        for bins in [int(x) for x in a.bins.split(",")]:
            rows = progress_dp(cfg, a.steps, a.seed, [float(x) for x in a.lams.split(",")], bins, a.by, a.fit_seed)
            for name, m, h in rows if uni is None else rows[4:]:
                print(f"  {name:>36}: cuts {m:6,d}  decode {h:9,.0f} GPU-h", flush=True)
            uni = uni or at_cuts([(m, h) for _, m, h in rows[:4]], a.cuts)
            h = at_cuts([(m, h) for _, m, h in rows[4:]], a.cuts)
            print(f"  at {a.cuts:,.0f} cuts (lower hull): uniform {uni:,.0f} GPU-h, the DP with {bins} {a.by} bin(s) "
                  f"{h:,.0f} ({1 - h / uni:.1%} less)", flush=True)


if __name__ == "__main__":
    main()
