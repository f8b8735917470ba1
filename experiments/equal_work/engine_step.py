"""What an engine's step per decoded token is in a run, against the decode step alone (read-only probe).

  python experiments/equal_work/engine_step.py --eta 4 [--preset xlong-swe-kv --steps 6 --seed 0]
Runs elastic uncapped (max_running None) and, by wrapping the simulator's per-engine replanning
(SimEngine._reschedule; nothing in sim/ is changed), integrates over every interval an engine decodes:
its decoded tokens (n x dt / step), its decode-only step at the same batch and contexts, whether the
interval's steps carry a prefill chunk, and its batch. Prints the mean step per decoded token as charged
(decode plus chunked prefill of prompts, tool outputs and migrated contexts) and as the decode step alone.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.cluster.engine import SimEngine
from gyre.sim.harness.runner import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eta", type=int, default=4)
    a = ap.parse_args()
    plan, acc = {}, defaultdict(float)
    orig = SimEngine._reschedule

    def probed(self) -> None:
        t0, n, step, alone, chunk = plan.get(self.id, (self.t_last, 0, 1.0, 1.0, False))
        dt = self.t_last - t0
        if dt > 0 and n:
            acc["time"] += dt
            acc["seq_time"] += n * dt
            acc["tokens"] += n * dt / step
            acc["alone"] += n * dt / step * alone
            acc["chunk_time"] += dt if chunk else 0.0
        orig(self)
        k = self.kv.n_dec
        if k and self.rate > 0:
            alone = self._step2(k, self.kv.kv_dec_base + k * self.V)[0]
            plan[self.id] = (self.t_last, k, 1.0 / self.rate, alone, self.pf_rate > 0)
        else:
            plan[self.id] = (self.t_last, 0, 1.0, 1.0, False)

    SimEngine._reschedule = probed
    try:
        cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed).validate()
        r = simulate(cfg, "elastic", {"eta": a.eta, "max_running": None})
    finally:
        SimEngine._reschedule = orig
    tok = acc["tokens"]
    print(f"elastic eta {a.eta}: {r.makespan_s / 3600:.2f} h, sched cuts {r.metrics.extra.get('sched_cuts')}; step per "
          f"decoded token {acc['seq_time'] / tok * 1e3:.2f} ms as charged, {acc['alone'] / tok * 1e3:.2f} ms the decode "
          f"step alone; {acc['chunk_time'] / acc['time']:.1%} of decoding time in steps carrying prefill; "
          f"time-weighted batch {acc['seq_time'] / acc['time']:.1f}")


if __name__ == "__main__":
    main()
