"""Where a run's GPU-time went: N x makespan split into what every GPU was doing, from the event log alone.

Each GPU-second of [0, makespan] lands in exactly one term (GPU-seconds):

- `rollout_decoding`: a rollout engine with at least one sequence decoding (the log's "busy" records) while it
  holds at least half of `full_at` executions (all of the time when `full_at` is not given), less the two
  shares carved out of it below;
- `rollout_thin`: the same while it holds fewer than half of `full_at` (the admission limit): a thinning tail
  decoding at a fraction of a full engine's throughput;
- `weight_sync`: a rollout engine paused for a weight sync (each "sync" record ends a pause of `sync_s`);
- `kv_reprefill`: re-prefill of contexts that KV pressure freed (the "preempt" records' GPU-seconds, the
  cost model's price of recomputing them, charged at the preemption; carved out of `rollout_decoding`,
  never more than it holds, because chunked prefill shares the decodes' steps);
- `request_discarded`: decode work thrown away by in-flight requests cancelled at their source and retried
  elsewhere (the "move_request" records' GPU-seconds, each the decode-step shares of its discarded tokens;
  carved out of `rollout_decoding` like `kv_reprefill`, never more than it holds after it);
- `rollout_waiting`: a rollout engine holding executions none of which decodes (tool calls, prefills,
  queued behind KV);
- `rollout_empty`: a rollout engine holding no execution (waiting for the tail elsewhere, or for work);
- `train`: GPUs training a step;
- `switching`: role switches (engine wake + weight load, engine sleep, trainer onload);
- `idle_first_batch`: GPUs in no role before the first training step starts (a trainer waiting for its first
  batch, which no policy can train sooner than the first groups finish);
- `idle`: GPUs in no role after that (a trainer waiting for its next batch, or GPUs no policy placed).

The role terms come from the "role" records (gyre.gpu_roles); the five rollout terms from a sweep over each
engine's records between its "engine_up" and the first role change of its GPUs away from rollout: busy
flags, membership (admit, migrate, park, resume, finish), sync pauses. The two are independent, so their sum
equals N x makespan only if every rollout GPU-second lies inside exactly one engine's life
(`decompose` checks it and raises ValueError otherwise: a log from a run with injected faults, whose engines
go back to rollout after a crash without a new "engine_up", is not split). Migrations and parks are counted,
not priced: the log carries no re-prefill cost for them (their re-prefill is in `rollout_waiting` /
`rollout_decoding`).
"""

from __future__ import annotations

from collections import defaultdict

from gyre.cluster import Role
from gyre.metrics import by_kind

TERMS = ("rollout_decoding", "rollout_thin", "weight_sync", "kv_reprefill", "request_discarded", "rollout_waiting",
         "rollout_empty", "train", "switching", "idle_first_batch", "idle")
_ROLE_TERM = {int(Role.IDLE): "idle", int(Role.TRAIN): "train", int(Role.SWITCHING): "switching"}


def _role_seconds(roles: list[tuple], n_gpus: int, makespan: float) -> tuple[dict[int, float], float]:
    """GPU-seconds per role over [0, makespan] (every GPU starts idle), and the idle ones before the first
    GPU starts training."""
    first = min((t for _, t, _, r in roles if r == int(Role.TRAIN)), default=makespan)
    role, since = [int(Role.IDLE)] * n_gpus, [0.0] * n_gpus
    out: dict[int, float] = defaultdict(float)
    early = 0.0

    def close(g: int, t: float) -> None:
        nonlocal early
        out[role[g]] += t - since[g]
        if role[g] == int(Role.IDLE):
            early += max(0.0, min(t, first) - since[g])

    for _, t, gpus, r in roles:
        t = min(t, makespan)
        for g in gpus:
            close(g, t)
            role[g], since[g] = r, t
    for g in range(n_gpus):
        close(g, makespan)
    return out, early


def _engine_lives(log: list[tuple], makespan: float) -> dict[int, tuple[float, float, int]]:
    """engine -> (up, end of rollout, GPUs): end is the first role change of its GPUs away from rollout."""
    lives, open_by_gpu = {}, {}
    for rec in log:
        if rec[0] == "engine_up":
            lives[rec[2]] = (rec[1], makespan, len(rec[3]))
            for g in rec[3]:
                open_by_gpu[g] = rec[2]
        elif rec[0] == "role" and rec[3] != int(Role.ROLLOUT):
            for g in rec[2]:
                eid = open_by_gpu.pop(g, None)
                if eid is not None and lives[eid][1] == makespan:
                    lives[eid] = (lives[eid][0], min(rec[1], makespan), lives[eid][2])
    return lives


def _engine_events(kinds: dict[str, list[tuple]], sync_s: float) -> dict[int, list[tuple[float, str, int]]]:
    """Per engine, (t, what, delta) for busy flags, membership and sync pauses, in time order."""
    ev: dict[int, list[tuple[float, str, int]]] = defaultdict(list)
    for _, t, eid, flag in kinds.get("busy", []):
        ev[eid].append((t, "busy", 1 if flag else -1))
    for _, t, eid, _v in kinds.get("sync", []):
        ev[eid] += [(t - sync_s, "pause", 1), (t, "pause", -1)]
    where: dict[int, int | None] = {}
    moves = [(r[1], i, r) for i, r in enumerate(
        kinds.get("admit", []) + kinds.get("migrate", []) + kinds.get("park", []) + kinds.get("resume", [])
        + kinds.get("finish", []))]
    for t, _, r in sorted(moves, key=lambda x: (x[0], x[1])):
        kind, ex = r[0], r[2]
        src = where.get(ex)
        dst = r[3] if kind in ("admit", "resume") else r[4] if kind == "migrate" else None
        if src is not None and kind != "admit":
            ev[src].append((t, "member", -1))
        if dst is not None:
            ev[dst].append((t, "member", 1))
        where[ex] = dst
    for lst in ev.values():
        lst.sort(key=lambda x: x[0])
    return ev


def decompose(log: list[tuple], n_gpus: int, sync_s: float, full_at: int = 0) -> dict[str, float]:
    """GPU-seconds per term of TERMS (module docstring) over [0, makespan], makespan = the last step's end;
    `sync_s` is the run's weight-sync pause (Costs.sync_s), `full_at` the executions a full engine holds
    (the admission limit; 0: no engine counts as thin)."""
    kinds = by_kind(log)
    steps = kinds.get("step", [])
    makespan = max((r[1] for r in steps), default=0.0)
    roles, early = _role_seconds(kinds.get("role", []), n_gpus, makespan)
    out = dict.fromkeys(TERMS, 0.0)
    for r, term in _ROLE_TERM.items():
        out[term] = roles.get(r, 0.0)
    out["idle_first_batch"], out["idle"] = early, out["idle"] - early
    events = _engine_events(kinds, sync_s)
    for eid, (up, end, k) in _engine_lives(log, makespan).items():
        busy = members = pause = 0
        t0 = up
        for t, what, d in events.get(eid, []) + [(end, "end", 0)]:
            t = min(max(t, up), end)
            if t > t0:
                term = ("weight_sync" if pause > 0
                        else ("rollout_thin" if 2 * members < full_at else "rollout_decoding") if busy > 0
                        else "rollout_waiting" if members > 0 else "rollout_empty")
                out[term] += (t - t0) * k
                t0 = t
            if what == "busy":
                busy = 1 if d > 0 else 0
            elif what == "member":
                members += d
            elif what == "pause":
                pause += d
    rollout = roles.get(int(Role.ROLLOUT), 0.0)
    swept = sum(out[k] for k in TERMS if k not in ("kv_reprefill", "request_discarded", "idle_first_batch",
                                                   *_ROLE_TERM.values()))
    if abs(swept - rollout) > 1e-6 * max(1.0, n_gpus * makespan):
        raise ValueError(f"rollout GPU-seconds {rollout:.6g} from the role records, {swept:.6g} inside engine "
                         "lives: the log has rollout time outside one engine life (injected faults?)")
    out["kv_reprefill"] = min(out["rollout_decoding"], float(sum(r[5] for r in kinds.get("preempt", []))))
    out["rollout_decoding"] -= out["kv_reprefill"]
    out["request_discarded"] = min(out["rollout_decoding"], float(sum(r[6] for r in kinds.get("move_request", []))))
    out["rollout_decoding"] -= out["request_discarded"]
    return out


def counts(log: list[tuple]) -> dict[str, int]:
    """Moves the GPU-time terms do not price: migrations, parks, preemptions, cancelled requests, role changes."""
    kinds = by_kind(log)
    return {k: len(kinds.get(k, [])) for k in ("migrate", "park", "preempt", "move_request", "role")}
