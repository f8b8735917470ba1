"""Where a run's scheduler-induced deadline cuts come from: per cut execution, from the log and the engine's plans.

For one preset / policy / params, this simulates the run with each engine's step plan recorded (after every
re-plan: time, decoding sequences, step time) and prints, for every scheduler-induced cut (cut by its
deadline, solo latency within it, sim/harness/sched_cuts.py), its solo latency, how long it waited unstarted
(group drawn -> first start; not counted against its deadline), its time running (first start -> cut), the engines'
decode batch and per-token step time over its running time (time-weighted), the batch-1 step time at its
context, its turns done of all, and its parks / migrations / preemptions. Then the same summary for the
executions that finished, and per-engine admitted counts. Usage:
  python experiments/equal_work/cut_anatomy.py --preset xlong-swe-kv --steps 6 --policy async --params rollout_gpus=576,eta=4
"""

from __future__ import annotations

import argparse
from bisect import bisect_right
from collections import defaultdict

import numpy as np

from gyre.config import override
from gyre.hardware import admission_limit
from gyre.sim.cluster.bound import per_exec
from gyre.presets import get_preset
from gyre.sim.cluster import engine as sim_engine
from gyre.sim.harness.runner import simulate


def record_plans():
    """Patch SimEngine._reschedule to record (t, n_dec, step time) per engine; return the record dict."""
    plans: dict[int, list[tuple[float, int, float]]] = defaultdict(list)
    orig = sim_engine.SimEngine._reschedule

    def wrapped(self):
        orig(self)
        plans[self.id].append((self.t_last, self.kv.n_dec, 1.0 / self.rate if self.rate else 0.0))

    sim_engine.SimEngine._reschedule = wrapped
    return plans, lambda: setattr(sim_engine.SimEngine, "_reschedule", orig)


def weighted(plan, t0: float, t1: float) -> tuple[float, float]:
    """Time-weighted mean decode batch and step time (over time with decodes) of an engine on [t0, t1]."""
    ts = [p[0] for p in plan]
    i = max(0, bisect_right(ts, t0) - 1)
    nb = st = w = 0.0
    while i < len(plan) and plan[i][0] < t1:
        a = max(plan[i][0], t0)
        b = min(plan[i + 1][0] if i + 1 < len(plan) else t1, t1)
        if b > a and plan[i][1] > 0:
            nb += plan[i][1] * (b - a)
            st += plan[i][2] * (b - a)
            w += b - a
        i += 1
    return (nb / w, st / w) if w else (0.0, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="async")
    ap.add_argument("--params", default="")
    ap.add_argument("--show", type=int, default=12)
    ap.add_argument("--limit", type=int, default=0, help="set admission_fill so an engine is handed at most this many")
    a = ap.parse_args()
    params = {k: int(v) for k, v in (kv.split("=") for kv in a.params.split(",") if kv)}
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed).validate()
    if a.limit:  # the fill whose admission_limit is `limit` (gyre.hardware.admission_limit)
        c = cfg.costs()
        fill = min(1.0, (a.limit + 0.5) * (cfg.workload.max_context + c.state_tokens) / c.kv_capacity_tokens)
        cfg = override(cfg, **{"cluster.cost.admission_fill": fill}).validate()
        assert admission_limit(c.kv_capacity_tokens, cfg.workload.max_context, fill, c.state_tokens) == a.limit
    plans, undo = record_plans()
    try:
        res = simulate(cfg, a.policy, params)
    finally:
        undo()
    costs, log = res.costs, res.log
    execs = [e for g in res.groups for e in g.executions]
    solo = per_exec(execs, costs).solo
    spec = {e.exec_id: (e, float(s)) for e, s in zip(execs, solo)}
    drawn, group_of = {}, {e.exec_id: e.group_id for e in execs}
    start, fin, where = {}, {}, defaultdict(list)  # where: (t, engine or None)
    moves = defaultdict(lambda: [0, 0, 0])  # parks, migrations, preemptions
    admitted = defaultdict(int)
    for r in log:
        k = r[0]
        if k == "group":
            drawn[r[2]] = r[1]
        elif k == "start":
            start.setdefault(r[2], r[1])
        elif k in ("admit", "resume"):
            where[r[2]].append((r[1], r[3]))
            if k == "admit":
                admitted[r[3]] += 1
        elif k == "migrate":
            where[r[2]].append((r[1], r[4]))
            moves[r[2]][1] += 1
        elif k == "park":
            where[r[2]].append((r[1], None))
            moves[r[2]][0] += 1
        elif k == "preempt":
            moves[r[2]][2] += 1
        elif k == "finish":
            fin[r[2]] = r
    m = res.metrics
    sm = m.summary()
    print(f"{a.policy} {params}: makespan {m.makespan_s / 3600:.2f} h, executions {sm['executions']}, "
          f"deadline cuts {sm['deadline_hit']}, sched cuts {sm['sched_cuts']}, tokens {sm['tokens_generated'] / 1e6:.0f}M, "
          f"preemptions {sm['preemptions']}; engines used {len(plans)}, limit {a.limit or 'default'}")

    def row(eid):
        e, s = spec[eid]
        f = fin[eid]
        t0, t1 = start.get(eid, f[1]), f[1]
        segs = where[eid] + [(t1, None)]
        nb = st = w = 0.0
        for (ta, eng), (tb, _) in zip(segs, segs[1:]):
            if eng is None or tb <= ta:
                continue
            b, s_ = weighted(plans[eng], max(ta, t0), tb)
            nb += b * (tb - ta); st += s_ * (tb - ta); w += tb - ta
        done_turns = 0
        gen_done = f[4]
        acc = 0
        for gi in e.gen:
            if acc + gi > gen_done:
                break
            acc += gi; done_turns += 1
        ctx = e.kv[min(done_turns, len(e.kv) - 1)]
        solo_step = float(np.asarray(costs.decode_s_per_token(np.array([ctx]))).ravel()[0])
        return dict(id=eid, solo_h=s / 3600, wait_h=(t0 - drawn[group_of[eid]]) / 3600, run_h=(t1 - t0) / 3600,
                    batch=nb / w if w else 0, step_ms=1e3 * st / w if w else 0, solo_step_ms=1e3 * solo_step,
                    turns=f"{done_turns}/{len(e.gen)}", gen=f"{gen_done / 1e3:.0f}K/{sum(e.gen) / 1e3:.0f}K",
                    tool_h=sum(e.tool_s) / 3600, ppm=tuple(moves[eid]), step=e.step if hasattr(e, 'step') else -1)

    cuts = [eid for eid, f in fin.items() if f[3] == 2 and spec[eid][1] < spec[eid][0].deadline_s]
    rows = [row(x) for x in cuts]
    rows.sort(key=lambda r: -r["solo_h"])
    print(f"scheduler cuts: {len(rows)}")
    for r in rows[: a.show]:
        print("  " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    if rows:
        arr = lambda k: np.array([r[k] for r in rows])
        print(f"  cut means: solo {arr('solo_h').mean():.2f} h (min {arr('solo_h').min():.2f}), wait {arr('wait_h').mean():.2f} h, "
              f"run {arr('run_h').mean():.2f} h, batch {arr('batch').mean():.1f}, step {arr('step_ms').mean():.1f} ms vs "
              f"batch-1 {arr('solo_step_ms').mean():.1f} ms; parks {sum(r['ppm'][0] for r in rows)}, "
              f"migrations {sum(r['ppm'][1] for r in rows)}, preemptions {sum(r['ppm'][2] for r in rows)}")
    okk = [row(eid) for eid, f in fin.items() if f[3] != 2]
    arr = lambda k: np.array([r[k] for r in okk])
    print(f"finished: {len(okk)}; means: solo {arr('solo_h').mean():.2f} h, wait {arr('wait_h').mean():.2f} h, run "
          f"{arr('run_h').mean():.2f} h, batch {arr('batch').mean():.1f}, step {arr('step_ms').mean():.1f} ms vs batch-1 "
          f"{arr('solo_step_ms').mean():.1f} ms; run/solo {np.mean(arr('run_h') / arr('solo_h')):.2f}")
    near = [r for r in okk if r["solo_h"] > 2.0]
    if near:
        print(f"finished with solo > 2 h: {len(near)}, run/solo {np.mean([r['run_h'] / r['solo_h'] for r in near]):.2f}, "
              f"batch {np.mean([r['batch'] for r in near]):.1f}")
    print("admitted per engine:", dict(sorted(admitted.items())))
    # the engines' decode batch over the run (time-weighted, over time with decodes)
    for eng, plan in sorted(plans.items())[:4]:
        b, s_ = weighted(plan, 0, m.makespan_s)
        print(f"  engine {eng}: mean decode batch {b:.1f}, step {1e3 * s_:.1f} ms, peak batch {max(p[1] for p in plan)}")


if __name__ == "__main__":
    main()
