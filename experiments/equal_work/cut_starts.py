"""When elastic's scheduler-induced cut executions started, against the run's first finish.

  python experiments/equal_work/cut_starts.py --eta 4 [--preset xlong-swe-kv --steps 6 --seed 0 --cap 0]
Runs elastic (eta; per-engine cap `max_running`, 0: none) and prints, for every scheduler-induced cut (cut
by its deadline, solo latency within it: sim/cluster/bound.py), its first start and group, and how many
started before any execution had finished: an admission then had no finished length to go by. Then how close
to its deadline each cut's solo latency is, against the whole run's executions: an execution whose solo latency is
within a few percent of its deadline is cut by any engine that runs it beside others (decode slows with batch).
"""

from __future__ import annotations

import argparse

import numpy as np

from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.cluster.bound import per_exec
from gyre.sim.harness.runner import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--cap", type=int, default=0)
    a = ap.parse_args()
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed).validate()
    r = simulate(cfg, "elastic", {"eta": a.eta, "max_running": a.cap or None})
    execs = [e for g in r.groups for e in g.executions]
    solo = dict(zip((e.exec_id for e in execs), per_exec(execs, r.costs).solo))
    spec = {e.exec_id: e for e in execs}
    start, fin, first = {}, {}, None
    for rec in r.log:
        if rec[0] == "start":
            start.setdefault(rec[2], rec[1])
        elif rec[0] == "finish":
            fin[rec[2]] = rec
            first = rec[1] if first is None else first
    cuts = [x for x, f in fin.items() if f[3] == 2 and solo[x] < spec[x].deadline_s]
    st = np.array(sorted(start[x] for x in cuts))
    print(f"elastic eta {a.eta} cap {a.cap or 'none'}: first finish at {first:.1f} s; {len(cuts)} scheduler cuts, "
          f"{int((st < first).sum())} started before it; starts (h): {np.round(st / 3600, 2).tolist()}")
    print("their groups:", sorted(spec[x].group_id for x in cuts))
    share = np.array([solo[x] / spec[x].deadline_s for x in cuts])
    every = np.array([solo[e.exec_id] / e.deadline_s for e in execs if e.deadline_s < float("inf")])
    edges = [0.0, 0.5, 0.8, 0.9, 0.95, 0.98, 1.0]
    print("solo latency / deadline:  bin           cuts  executions")
    for lo, hi in zip(edges, edges[1:]):
        print(f"                          [{lo:.2f}, {hi:.2f})  {int(((share >= lo) & (share < hi)).sum()):4d}  "
              f"{int(((every >= lo) & (every < hi)).sum()):10d}")
    print(f"                          >= 1.00        {int((share >= 1).sum()):4d}  {int((every >= 1).sum()):10d}")


if __name__ == "__main__":
    main()
