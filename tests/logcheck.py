"""What a run did, rebuilt from its event log alone: the reference the invariant tests hold the simulator to.

Nothing here reads an engine's or an execution's own counters. The reconstructions:

- `staleness`: the version each engine serves over time (the trainer's version when it came up, then each
  of its syncs and restarts after a fault, in log order), so the version that generated an execution's oldest token is bounded by what
  its engine served at its "start" record and at every engine it was later moved to ("migrate", "resume").
  Where prefill is free an execution decodes at the instant it starts, so its first token's version is
  exactly what its engine served then (`exact=True`). An execution whose in-flight request was cancelled
  ("move_request") may have lost the tokens decoded there, its oldest among them: its oldest kept token's version
  is bounded by the lowest an engine it ran on served and the version it trained at.
- `occupancy`: how many executions each engine holds over time, from the admit, migrate, park, resume and
  finish records.
- `kv_occupancy`: for single-turn executions on an engine that decodes `rate` tokens per second per
  sequence whatever its batch (linear step cost a, b = c = 0: rate = 1 / a) with free prefill, each
  execution's decoding intervals: the first begins at its "start" record; each ends at a "preempt" (whose
  lost context says how far it got) or at its "finish" (all its tokens), and the later ones began as long
  before their end as their tokens take at `rate`, the engine's sync pauses (each "sync" record ends one
  `sync_s` long) not counting. An engine's KV at any moment is then the prompt plus decoded tokens of the
  executions decoding on it: a lower bound of what it holds (a restart inside a pause is placed at the
  pause's end), exact between events. A "move_request" ends an interval too, its discarded tokens saying how
  far it got; the retried request decodes them again from none.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Staleness:
    """Per trained execution: the trained version, the log's bounds on its oldest token's version, and what
    the run recorded in its "trained" record (version - staleness, the per-token lag sum, the token count)."""

    trained_v: dict[int, int] = field(default_factory=dict)
    start_v: dict[int, int] = field(default_factory=dict)  # what its engine served at its "start"
    low_v: dict[int, int] = field(default_factory=dict)  # least of that and every engine it moved to, on arrival
    recorded_v: dict[int, int] = field(default_factory=dict)
    lag_sum: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    cancelled: set[int] = field(default_factory=set)  # executions with a "move_request" (a request cancelled)


def staleness(log: list[tuple], mu: int = 1) -> Staleness:
    """`mu`: steps per weight publication (an engine comes up serving the latest multiple of mu)."""
    version, served = 0, {}
    out = Staleness()
    for r in log:
        kind = r[0]
        if kind == "step":
            version = r[2]
        elif kind == "engine_up":
            served[r[2]] = version - version % mu
        elif kind == "sync":
            served[r[2]] = r[3]
        elif kind == "note" and r[2] == "engine_restarted":  # a killed engine is back, serving the latest weights
            served[r[3]["engine"]] = r[3]["version"]
        elif kind == "start" and r[2] not in out.start_v:
            out.start_v[r[2]] = out.low_v[r[2]] = served[r[3]]
        elif kind in ("migrate", "resume"):
            x, dst = r[2], r[-1]
            if x in out.low_v:
                out.low_v[x] = min(out.low_v[x], served[dst])
        elif kind == "move_request":
            out.cancelled.add(r[2])
        elif kind == "trained":
            _, _, x, _, v, stale, lag, n = r
            out.trained_v[x], out.recorded_v[x], out.lag_sum[x], out.tokens[x] = v, v - stale, lag, n
    return out


def check_staleness(log: list[tuple], eta: int, exact: bool, mu: int = 1) -> None:
    """Every trained execution's staleness is what the log says: its recorded oldest version lies within the
    log's bounds (equals its start's when `exact` and it never moved to an older engine), its staleness is <= eta,
    and its per-token lag sum is between 0 and its tokens x the largest lag the log allows."""
    s = staleness(log, mu)
    for x, v in s.trained_v.items():
        lo, start, got = s.low_v[x], s.start_v[x], s.recorded_v[x]
        if s.tokens[x]:
            hi = start if exact and x not in s.cancelled else v
            assert lo <= got <= hi, (f"exec {x}: recorded oldest version {got}, the log says it is in [{lo}, {hi}] "
                                     f"(started at v{start}, trained at v{v})")
        assert v - start <= eta, f"exec {x} started at v{start}, trained at v{v}: staleness {v - start} > eta {eta}"
        assert -1e-6 <= s.lag_sum[x] <= s.tokens[x] * (v - lo) + 1e-6, \
            f"exec {x}: lag sum {s.lag_sum[x]} outside [0, {s.tokens[x]} x {v - lo}]"


def _pauses(log: list[tuple], sync_s: float) -> dict[int, list[tuple[float, float]]]:
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in log:
        if r[0] == "sync":
            out[r[2]].append((r[1] - sync_s, r[1]))
    return out


def _active(a: float, b: float, pauses: list[tuple[float, float]]) -> float:
    """Seconds of [a, b] outside the pauses."""
    return (b - a) - sum(max(0.0, min(b, p1) - max(a, p0)) for p0, p1 in pauses)


def _began(end: float, busy: float, pauses: list[tuple[float, float]]) -> float:
    """The latest time r with `busy` seconds outside the pauses in [r, end]."""
    t, left = end, busy
    for p0, p1 in sorted(pauses, reverse=True):
        if p0 >= t:
            continue
        run = t - min(p1, t)  # unpaused time between this pause's end and t
        if run >= left:
            return t - left
        left -= run
        t = p0
    return t - left


_TIE = 1e-7  # seconds: a rebuilt restart time carries the float error of the times it was computed from


@dataclass
class Interval:
    engine: int
    prompt: int
    begin: float
    end: float
    tok0: float  # tokens decoded when it began
    tok1: float  # ... and when it ended


def decode_intervals(log: list[tuple], prompts: dict[int, int], rate: float, sync_s: float,
                     first_tolerance: float = 1e-6) -> list[Interval]:
    """Every decoding interval of single-turn executions (module docstring). Asserts that each first interval's
    tokens are what `rate` decodes between its start and its end (the decode rate the log implies)."""
    pauses = _pauses(log, sync_s)
    where: dict[int, int | None] = {}
    started: dict[int, tuple[float, int]] = {}
    tok: dict[int, float] = defaultdict(float)
    first: set[int] = set()
    out: list[Interval] = []

    def close(x: int, e: int, t: float, tokens: float) -> None:
        busy = (tokens - tok[x]) / rate
        if x not in first:
            first.add(x)
            t0, e0 = started[x]
            assert e0 == e, f"exec {x} started on engine {e0} and first stopped on {e}"
            took = _active(t0, t, pauses[e])
            assert abs(took - busy) <= first_tolerance * (1 + busy), \
                f"exec {x} decoded {tokens - tok[x]:.1f} tokens in {took:.6f} s of engine time at {rate} tok/s"
            begin = t0
        else:
            begin = _began(t, busy, pauses[e])
        out.append(Interval(e, prompts[x], begin, t, tok[x], tokens))
        tok[x] = tokens

    for r in log:
        kind = r[0]
        if kind == "admit":
            where[r[2]] = r[3]
        elif kind == "start":
            started[r[2]] = (r[1], r[3])
        elif kind in ("migrate", "resume"):
            where[r[2]] = r[-1]
        elif kind == "park":
            where[r[2]] = None
        elif kind == "preempt":
            _, t, x, e, lost, _ = r
            close(x, e, t, lost - prompts[x])
        elif kind == "move_request":  # a single-turn execution's request holds every token it decoded
            _, t, x, e, _, tokens, _ = r
            close(x, e, t, tokens)
            tok[x] = 0.0
        elif kind == "finish":
            close(r[2], where[r[2]], r[1], r[4])
    return out


def kv_occupancy(intervals: list[Interval], rate: float, sync_s: float, log: list[tuple]) -> dict[int, float]:
    """Per engine, the most KV the intervals show it holding at once: at every interval end and pause start,
    the executions decoding just before it (begun before, not ended), each its prompt and tokens so far. A restart
    rebuilt to within `_TIE` seconds of a moment counts as after it (it took the room of one that left then)."""
    pauses = _pauses(log, sync_s)
    by_engine: dict[int, list[Interval]] = defaultdict(list)
    for iv in intervals:
        by_engine[iv.engine].append(iv)
    peak: dict[int, float] = {}
    for e, ivs in by_engine.items():
        ps = pauses[e]
        moments = sorted({iv.end for iv in ivs} | {p0 for p0, _ in ps})
        best = 0.0
        for b in moments:
            kv = sum(iv.prompt + iv.tok0 + rate * _active(iv.begin, b, ps) for iv in ivs
                     if iv.begin < b - _TIE <= iv.end)
            best = max(best, kv)
        peak[e] = best
    return peak


def occupancy(log: list[tuple]) -> dict[int, list[tuple[float, int]]]:
    """Per engine, (time, executions it holds) after every change, from admit/migrate/park/resume/finish records."""
    where: dict[int, int] = {}
    held: dict[int, int] = defaultdict(int)
    out: dict[int, list[tuple[float, int]]] = defaultdict(list)

    def put(e: int, d: int, t: float) -> None:
        held[e] += d
        out[e].append((t, held[e]))

    for r in log:
        kind = r[0]
        if kind in ("admit", "resume"):
            where[r[2]] = r[3]
            put(r[3], +1, r[1])
        elif kind == "migrate":
            where[r[2]] = r[4]
            put(r[3], -1, r[1])
            put(r[4], +1, r[1])
        elif kind == "park":
            put(where.pop(r[2]), -1, r[1])
        elif kind == "finish":
            put(where.pop(r[2]), -1, r[1])
    return out
