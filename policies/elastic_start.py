"""The elastic controller's start: the split it begins on, and when it lends that split's trainer GPUs.

Before anything has run the controller cannot tell a rollout-bound workload from a trainer-bound one (no
length, no turn count is visible). What it can tell from the cost estimate (gyre.estimate) is which
fixed split balances decode and training, and what each start costs under either hypothesis:

- every GPU an engine: the first batch's trainer must be gathered by draining engines, and a drain waits
  for each migrant's next tool-call boundary; a single-turn rollout reaches none, so its engine is free
  only once its longest rollout ends (a whole rollout lost on the drained GPUs);
- the balanced split (`initial_engines`) with the rest kept free for the first step: the kept GPUs idle
  until the first batch is ready (a whole first rollout lost on them).

The rule: start on the balanced split, its trainer GPUs kept free, and lend them to the rollout
(`release_reserve`) at the first decision point where both (a) some execution has reached a tool call (so
a drain that gives them back waits a share of a segment, not a rollout) and (b) the first batch is
predicted further off than lending costs: the lent engines' start, then the drain that returns them (the
wait for a boundary, an engine's stop, the trainer's load onto its GPUs). Once lent, the live executions
are spread evenly over the old and the new engines at their tool-call boundaries (`spread_moves`), since
everything was admitted onto the split's engines before. A single-turn workload never shows a tool call,
so it keeps the split through its first step; a multi-turn one with long rollouts lends the split's
trainer GPUs within its first few turns.

Everything here but `lend` (the action) is a pure function of observations and the estimate, unit-tested
on plain stand-ins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gyre.cluster import Cluster, EngineView, ExecutionView
from gyre.handles import all_of
from gyre.policies.elastic_plan import batch_ready_times, pending_ends


def initial_engines(*, n_gpus: int, per: int, min_train: int, eta: int, limit: int, ctx: float,
                    step_s: Callable[[int, float], float], train_s_per_token_gpu: float) -> int:
    """Engines to keep at the start, before anything is observed: the fixed split whose rollout decode
    rate (e engines, each running `limit` sequences whose contexts sum to `ctx`: `limit / step_s(limit,
    ctx)` tokens/s) and training rate (the GPUs left, `1 / train_s_per_token_gpu` tokens/s each, without
    the attention term: contexts are not known yet) are most nearly matched, i.e. the e in
    [1, (n_gpus - min_train) / per] maximizing the slower of the two (ties: more engines). At eta 0 no
    training overlaps a rollout (the trainer waits for every batch), so GPUs kept for it would only idle:
    every GPU runs an engine."""
    most = (n_gpus - min_train) // per
    if eta == 0 or most < 1:
        return n_gpus // per
    best, best_rate = 1, -1.0
    for e in range(1, most + 1):
        rate = min(e * limit / step_s(limit, ctx), (n_gpus - e * per) / train_s_per_token_gpu)
        if rate >= best_rate - 1e-12 * max(rate, 1.0):
            best, best_rate = e, max(rate, best_rate)
    return best


def tool_call_seen(live_turns: Sequence[int], finished_segments: Sequence[int]) -> bool:
    """Has any execution reached a tool call: a live one past its first segment, or a finished one that ran
    more than one?"""
    return any(t >= 1 for t in live_turns) or any(s > 1 for s in finished_segments)


def first_ready_at(*, now: float, live_ends: dict[int, float], live_free_at: Sequence[float], unused_slots: int,
                   queued: Sequence[int], durations: Sequence[float], pending: Sequence[int], finished: set[int],
                   per_batch: int, due: Sequence[int]) -> float:
    """When the first coming batch is predicted ready: each pending group at its live executions' latest
    predicted finish, the executions waiting to start taking slots as the live ones free them (and the
    `unused_slots` now), each as long as `durations` (policies.elastic_plan.pending_ends), batches formed
    as the Batcher forms them (`batch_ready_times`, `due`: each group's batch index by the staleness bound)."""
    free_at = list(live_free_at) + [now] * unused_slots
    last = pending_ends(now, live_ends, free_at, queued, durations, 1.0, pending, finished)
    return batch_ready_times(last, per_batch, due)[0] if last else now


def release_reserve(*, tool_call: bool, ready_in_s: float, wait_s: float, start_s: float, stop_s: float,
                    onload_s: float) -> bool:
    """Lend the start's trainer GPUs to the rollout (module docstring)? Only once a tool call has been seen
    (`tool_call`) and if the first batch is predicted ready `ready_in_s` from now, later than lending costs:
    the lent engines serve `start_s` after they start, and the drain that gives the GPUs back waits
    `wait_s` for its migrants' boundaries, `stop_s` for the engines to stop and `onload_s` for the
    trainer's state."""
    return tool_call and ready_in_s > start_s + wait_s + stop_s + onload_s


def _limit_room(e: EngineView) -> int:
    return e.admit_limit - e.n_live


def spread_moves(engines: Sequence[EngineView], live: Sequence[ExecutionView], *, kv_fill: float,
                 slots: Callable[[EngineView], int] = _limit_room) -> list[tuple[ExecutionView, EngineView]]:
    """Even the live executions out over `engines` by migration. An engine holding more than
    ceil(total / engines) gives its excess, the smallest contexts first (the least to re-prefill; ties by
    id), each to the engine holding the fewest (counting what it was given; ties by id) if that narrows the
    gap (it holds at least two fewer than the giver), has a slot (`slots`) and its KV stays below `kv_fill`
    of capacity; otherwise the execution stays. Givers in order of load, most first (ties by id)."""
    if not engines:
        return []
    high = -(-sum(e.n_live for e in engines) // len(engines))
    load = {e.id: e.n_live for e in engines}
    room = {e.id: slots(e) for e in engines}
    kv = {e.id: kv_fill * e.kv_capacity - e.kv_used for e in engines}
    mine: dict[int, list[ExecutionView]] = {}
    for x in live:
        mine.setdefault(x.engine_id, []).append(x)
    moves = []
    for src in sorted(engines, key=lambda e: (-e.n_live, e.id)):
        for x in sorted(mine.get(src.id, []), key=lambda x: (x.context_tokens, x.id)):
            if load[src.id] <= high:
                break
            dst = min((e for e in engines if e.id != src.id and room[e.id] > 0 and kv[e.id] >= x.context_tokens),
                      key=lambda e: (load[e.id], e.id), default=None)
            if dst is None or load[dst.id] + 2 > load[src.id]:
                break
            moves.append((x, dst))
            load[src.id] -= 1
            load[dst.id] += 1
            room[dst.id] -= 1
            kv[dst.id] -= x.context_tokens
    return moves


def lend(cluster: Cluster, pool, kv_fill: float):
    """Lend the start's trainer GPUs (`pool`: policies.elastic_pool.EnginePool): engines on all of them,
    then the live executions spread evenly over the old and new engines (`spread_moves`, within each
    target's admission limit), each moving at its next tool-call boundary; yields until all have moved."""
    pool.reserve = 0
    yield from pool.grow(sync=False)
    moves = spread_moves(pool.ready(), cluster.live(), kv_fill=kv_fill, slots=pool.drain_room)
    cluster.note("elastic_release", engines=len(pool.engines), moves=len(moves))
    if moves:
        yield all_of([pool.move(x, t) for x, t in moves])
