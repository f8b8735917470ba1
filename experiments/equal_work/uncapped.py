"""Elastic alone, uncapped (max_running None), at given etas: makespan, deadline and scheduler cuts, tokens.

  python experiments/equal_work/uncapped.py --preset xlong-swe-kv --steps 6 --seed 0 --etas 2 4
Each row is `gyre.sim.harness.runner.simulate(cfg, "elastic", {"eta": E, "max_running": None})`, its work
columns as the equal-work table's (scheduler cuts: gyre.sim.harness.sched_cuts).
"""

from __future__ import annotations

import argparse
import time

from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--etas", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args()
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed).validate()
    for eta in a.etas:
        t0 = time.process_time()
        r = simulate(cfg, "elastic", {"eta": eta, "max_running": None})
        m, x = r.metrics.summary(), r.metrics.extra
        print(f"elastic eta {eta}: {r.makespan_s / 3600:.2f} h, deadline cuts {m.get('deadline_hit')}, sched cuts "
              f"{x.get('sched_cuts')}, tokens {m.get('tokens_generated')}, preemptions {m.get('preemptions')}, "
              f"{time.process_time() - t0:.0f} s CPU", flush=True)


if __name__ == "__main__":
    main()
