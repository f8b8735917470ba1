"""Where a scheduler-induced cut execution's time goes: decoding, tool calls, prefill, queued, off-engine.

  python experiments/equal_work/cut_time.py --eta 4 [--preset xlong-swe-kv --steps 6 --seed 0 --params max_running=4]
Runs elastic (eta, and any ElasticConfig fields of --params) with the simulator's per-engine replanning
(SimEngine._reschedule) wrapped, read-only: at every replan of an engine, each member's phase (gyre.cluster.Phase)
is sampled, and the time since its last sample is charged to the phase it was in. A phase holds between an
engine's replans (every membership change, segment end, tool return and prefill end replans it), so the
charge is exact. The phases: decoding (and the tokens it decoded there, at the engine's rate 1 / step over
the interval), tool (the tool call and any request latency), prefill (its missing context computed),
queued before its first decode (admitted, waiting for KV), queued between turns (back from a tool, waiting
to rejoin the batch), and off-engine (left an engine by a migration or a park, not yet on the next).
Unstarted (group drawn -> first start) is not on the deadline clock and is given apart. For every
scheduler-induced cut (sim/harness/sched_cuts.py: cut by its deadline, solo latency within it) and for the
finished executions, prints the mean seconds per phase, the step per decoded token while decoding, and
the run's seconds per generated token, against the batch-1 decode step at their contexts.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from gyre.cluster import Phase
from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.cluster.bound import per_exec
from gyre.sim.cluster.engine import SimEngine
from gyre.sim.harness.runner import simulate

PHASES = ("decode", "tool", "prefill", "queued_first", "queued_turn", "off_engine")


def probe():
    """Wrap SimEngine._reschedule; return (time[ex][phase], tokens[ex], undo)."""
    spent: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
    tokens: dict[int, float] = defaultdict(float)
    state: dict[int, tuple[float, str, int, float]] = {}  # ex -> (since, phase, engine, rate while decoding)
    decoded: set[int] = set()
    members: dict[int, set[int]] = defaultdict(set)
    orig = SimEngine._reschedule

    def charge(xid: int, t: float) -> None:
        since, ph, _, rate = state[xid]
        if t > since:
            spent[xid][ph] += t - since
            if ph == "decode":
                tokens[xid] += (t - since) * rate
                decoded.add(xid)

    def probed(self) -> None:
        t = self.t_last
        now = set(self.members)
        for xid in members[self.id] - now:  # left this engine: off it until the next one samples it
            if xid in state and state[xid][2] == self.id:
                charge(xid, t)
                state[xid] = (t, "off_engine", -1, 0.0)
        members[self.id] = now
        orig(self)
        for xid, ex in self.members.items():
            if xid in state:
                charge(xid, t)
            p = ex.phase
            ph = ("decode" if p == Phase.DECODE else "tool" if p == Phase.TOOL else "prefill" if p == Phase.PREFILL
                  else "queued_turn" if (ex.seg > 0 or xid in decoded) else "queued_first")
            state[xid] = (t, ph, self.id, self.rate if ph == "decode" else 0.0)

    SimEngine._reschedule = probed
    return spent, tokens, state, charge, lambda: setattr(SimEngine, "_reschedule", orig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--params", default="", help="extra ElasticConfig fields, k=v,k=v (ints or floats)")
    a = ap.parse_args()
    params = {"eta": a.eta, "max_running": None}
    for kv in filter(None, a.params.split(",")):
        k, v = kv.split("=")
        params[k] = None if v == "None" else (int(v) if v.lstrip("-").isdigit() else float(v) if v[0].isdigit() else v)
    cfg = override(get_preset(a.preset), steps=a.steps, seed=a.seed).validate()
    spent, tokens, state, charge, undo = probe()
    try:
        r = simulate(cfg, "elastic", params)
    finally:
        undo()
    execs = [e for g in r.groups for e in g.executions]
    solo = dict(zip((e.exec_id for e in execs), per_exec(execs, r.costs).solo))
    spec = {e.exec_id: e for e in execs}
    drawn, start, fin = {}, {}, {}
    for rec in r.log:
        if rec[0] == "group":
            drawn[rec[2]] = rec[1]
        elif rec[0] == "start":
            start.setdefault(rec[2], rec[1])
        elif rec[0] == "finish":
            fin[rec[2]] = rec
    for xid, f in fin.items():  # close each at its finish
        if xid in state:
            charge(xid, f[1])
            state.pop(xid)
    m = r.metrics.summary()
    print(f"elastic {params}: {r.makespan_s / 3600:.2f} h, deadline cuts {m['deadline_hit']}, sched cuts "
          f"{r.metrics.extra.get('sched_cuts')}, tokens {m['tokens_generated'] / 1e6:.1f}M")

    def summary(name: str, ids: list[int]) -> None:
        if not ids:
            print(f"{name}: none")
            return
        run = np.array([fin[x][1] - start.get(x, fin[x][1]) for x in ids])
        gen = np.array([fin[x][4] for x in ids], dtype=float)
        ph = {p: np.array([spent[x][p] for x in ids]) for p in PHASES}
        tok = np.array([tokens[x] for x in ids])
        unstarted = np.array([start.get(x, fin[x][1]) - drawn[spec[x].group_id] for x in ids])
        ctx = np.array([spec[x].kv[min(spec[x].kv.__len__() - 1, len(spec[x].kv) // 2)] for x in ids])
        solo_step = np.asarray(r.costs.decode_s_per_token(ctx.astype(float))).ravel()
        acc = sum(ph.values())
        print(f"{name}: {len(ids)}; mean run {run.mean() / 3600:.2f} h (phases sum to {acc.mean() / 3600:.2f} h), "
              f"unstarted {unstarted.mean() / 3600:.2f} h, generated {gen.mean() / 1e3:.0f}K tokens, "
              f"{1e3 * run.sum() / gen.sum():.1f} ms of run per generated token")
        print("  " + ", ".join(f"{p} {ph[p].mean() / 3600:.2f} h ({ph[p].sum() / run.sum():.0%}, "
                               f"{1e3 * ph[p].sum() / gen.sum():.1f} ms/token)" for p in PHASES))
        print(f"  decoding: {1e3 * ph['decode'].sum() / tok.sum():.1f} ms per decoded token (engine step), batch-1 "
              f"step at mid-run context {1e3 * solo_step.mean():.1f} ms; decoded {tok.mean() / 1e3:.0f}K (log "
              f"{gen.mean() / 1e3:.0f}K); solo {np.mean([solo[x] for x in ids]) / 3600:.2f} h")

    deadline = {x: spec[x].deadline_s for x in fin}
    cuts = [x for x, f in fin.items() if f[3] == 2 and solo[x] < deadline[x]]
    other = [x for x, f in fin.items() if f[3] == 2 and solo[x] >= deadline[x]]
    done = [x for x, f in fin.items() if f[3] != 2]
    summary("scheduler cuts", cuts)
    summary("other deadline cuts (solo past the deadline)", other)
    summary("finished", done)
    long = [x for x in done if solo[x] > 0.5 * deadline[x]]
    summary("finished with solo > half the deadline", long)


if __name__ == "__main__":
    main()
