"""Pure decisions of the elastic controller: predictions from observations, and the trainer size they choose.

Everything here is a function of observations (engines' load, live executions' progress, what finished
executions showed) and of the cluster's cost estimate (gyre.estimate), never of the future, and has no
side effects, so it is unit-tested on plain stand-ins. The rule these functions implement is stated once,
in policies/elastic.py's docstring.

- `History` (policies.elastic_history): what finished executions showed, and the live ones' progress.
- `remaining_s` (policies.elastic_predict, with the other predictions of one live execution: its cut
  probability, its wait for a tool-call boundary, its engine's load): a live execution's expected remaining time: its expected remaining segments (the mean,
  over finished executions longer than it so far, of their segments beyond its own; none longer: its
  segments so far times `unseen_residual`) times its own observed seconds per segment.
- `drain_order` / `plan_drain`: engines to drain for a trainer of a given size (fewest live executions
  first; at least one engine stays), each migrant (largest context first) to the staying engine with the
  most free KV below `kv_fill` of capacity and a slot (`slots`: the pool's drain room); the migrants that
  fit nowhere are the plan's `parks` (a plan with any is not a candidate: policies.elastic, 1.).
- `evaluate`: for one candidate plan, when the step would end (the slowest migrant's wait for its
  tool-call boundary, then training at the estimate's speed) and when the following batch would be ready
  (each live execution's predicted remaining time, stretched by its engine's step time after the moves
  over its own engine's now, for the rest of its run), and so
  when each later batch of the groups admitted so far would be trained (in order of predicted finish,
  each as long as this one), and how many more executions its delays are expected to push past their
  deadline (`cut_p`); `choose` keeps the candidates within a tolerance of the least-cutting one (a cut
  is lost work, never a speed-up) and takes the one that trains the last of them soonest (ties: the
  sooner step end, then the larger trainer). The drained engines' slots come back after the step, so each
  later batch trained on the candidate's GPUs pays its switch again (the migrants' wait, the stop).
- The start (its split, and when its trainer GPUs are lent) is policies.elastic_start.

Simplifications: a migrant's re-prefill time is not charged; an execution decodes all of its time (a
slowdown of its engine delays it in full) and its engine's load stays as the moves leave it (others
finishing would speed it up again); the executions of a group not yet admitted take the finished ones'
durations, in start order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gyre.cluster import EngineView, ExecutionView
from gyre.policies.elastic_history import History


def batch_ready_times(group_ends: Sequence[float], per_batch: int, due: Sequence[int] | None = None) -> list[float]:
    """When each coming batch of these groups is ready: batch j takes every group due by it (`due`: each
    group's batch index, the staleness bound's deadline; the trainer waits for them, as the Batcher does),
    then the earliest-finishing others up to `per_batch`; it is ready when the last it takes ends. Without
    `due`, batches are the groups in order of finish."""
    left = sorted(zip(group_ends, due if due is not None else [len(group_ends)] * len(group_ends)))
    out: list[float] = []
    j = 0
    while left:
        need = [i for i, (_, d) in enumerate(left) if d <= j]
        take = set(need[:per_batch]) if len(need) >= per_batch else set(need)
        for i in range(len(left)):
            if len(take) >= per_batch:
                break
            take.add(i)
        out.append(max(left[i][0] for i in take))
        left = [g for i, g in enumerate(left) if i not in take]
        j += 1
    return out


def last_batch_end(start: float, group_ends: Sequence[float], per_batch: int, train_s: float,
                   due: Sequence[int] | None = None) -> float:
    """When the last of these groups is trained: batches as `batch_ready_times` forms them, each trained
    for `train_s` once it is ready and the trainer (free from `start`) is free."""
    t = start
    for r in batch_ready_times(group_ends, per_batch, due):
        t = max(t, r) + train_s
    return t


def run_queue(free_at: Sequence[float], durations: Sequence[float],
              factor: Callable[[int, float], float] = lambda i, t: 1.0) -> list[float]:
    """Finish time of each job, in order: it starts in the earliest free engine slot and frees it when done;
    job i starting at t takes its duration times factor(i, t)."""
    heap = list(free_at)
    heapq.heapify(heap)
    out = []
    for i, d in enumerate(durations):
        t = heapq.heappop(heap) if heap else float("inf")
        out.append(t + d * factor(i, t))
        heapq.heappush(heap, out[-1])
    return out


def pending_ends(now: float, live_ends: dict[int, float], free_at: Sequence[float], queued: Sequence[int],
                 durations: Sequence[float], f: float, pending: Sequence[int], finished: set[int]) -> list[float]:
    """When each pending group ends: its live executions' latest predicted finish (`live_ends`), and the
    executions waiting to start (`queued`: their group ids, in order) taking slots as they free (`free_at`,
    `run_queue`), each as long as a finished execution took (`durations`, cycled) times `f`; a finished
    group (`finished`) ends now."""
    jobs = [durations[i % len(durations)] * f if durations else 0.0 for i in range(len(queued))]
    ends = dict(live_ends)
    for gid, t in zip(queued, run_queue(free_at, jobs)):
        ends[gid] = max(ends.get(gid, now), t)
    return [now if gid in finished else ends.get(gid, now) for gid in pending]


def choose_grow(*, now: float, free_gpus: int, per: int, min_train: int, engines: int, limit: int,
                live_free_at: Sequence[float], unused_slots: int, live_ends: dict[int, float], pending: Sequence[int],
                finished: set[int], queued: Sequence[int], durations: Sequence[float], scale: Callable[[int], float],
                per_batch: int, train_s: Callable[[int], float], start_s: float, drain_s: float,
                due: Sequence[int] | None = None, empty_drain_s: float | None = None) -> int:
    """Engines to start on the free GPUs when a step ends (the rest stay free for the next step).

    For k new engines (serving after `start_s`, `limit` executions each): the executions waiting to start
    (`queued`: their group ids, in order) take slots as they free (`run_queue`: the live executions'
    predicted finishes `live_free_at`, `unused_slots` free now, the new engines' slots) and take what
    finished executions took (`durations`, cycled), times `scale(engines + k)` (the estimate's step time
    at the load that many engines carry, over the load those durations were measured at); the next steps
    train on the GPUs left free (at least the memory minimum: below it a step first drains engines,
    `drain_s`; `due`: each pending group's batch index, `batch_ready_times`). `empty_drain_s`, where every
    engine is empty when the next batch is ready (eta 0: every admitted group is in it): the next steps may
    instead train on every GPU but one engine's, each paying that drain (the engines' stop), whichever ends
    sooner. Returns the k whose last pending group (`pending`; `live_ends`: the live executions'
    latest predicted finish per group) is trained soonest (ties: fewer engines)."""
    best, best_end = 0, float("inf")
    for k in range(free_gpus // per + 1):
        e = engines + k
        if e == 0:
            continue
        keep = free_gpus - k * per
        g, wait = (keep, 0.0) if keep >= min_train else (-(-min_train // per) * per, drain_s)
        free_at = list(live_free_at) + [now] * unused_slots + [now + start_s] * (k * limit)
        last = pending_ends(now, live_ends, free_at, queued, durations, scale(e), pending, finished)
        end = last_batch_end(now + wait, last, per_batch, train_s(g), due) if last else now
        if last and empty_drain_s is not None and e > 1:
            drained = free_gpus + (engines - 1) * per  # all but one engine (plan_drain), k of them new
            end = min(end, last_batch_end(now, last, per_batch, train_s(drained) + empty_drain_s, due))
        if end < best_end - 1e-9:
            best, best_end = k, end
    return best


@dataclass(frozen=True)
class DrainPlan:
    victims: tuple[EngineView, ...]
    moves: tuple[tuple[ExecutionView, EngineView], ...]
    parks: tuple[ExecutionView, ...] = ()  # migrants no staying engine has room for

    @property
    def gpus(self) -> list[int]:
        return [g for e in self.victims for g in e.gpus]


def drain_order(engines: Sequence[EngineView]) -> list[EngineView]:
    """Cheapest to empty first: fewest live executions, then fewest decoding (they move only at a
    tool-call boundary), then id."""
    return sorted(engines, key=lambda e: (e.n_live, e.n_decoding, e.id))


def _limit_room(e: EngineView) -> int:
    return e.admit_limit - e.n_live


def assign_targets(executions: Sequence[ExecutionView], targets: Sequence[EngineView], *, kv_fill: float,
                   slots: Callable[[EngineView], int] = _limit_room
                   ) -> tuple[list[tuple[ExecutionView, EngineView]], list[ExecutionView]]:
    """Greedy best fit: largest context first, to the target with the most free KV (capacity x kv_fill -
    used - already assigned) that can take it (the KV, and a slot under its admission limit: `slots`,
    policies.admit_queue); ties by id. Returns (moves, the executions no target can hold)."""
    free = {t.id: t.kv_capacity * kv_fill - t.kv_used for t in targets}
    left = {t.id: slots(t) for t in targets}
    heap = [(-free[t.id], t.id, i) for i, t in enumerate(targets) if left[t.id] > 0]
    heapq.heapify(heap)
    moves, parks = [], []
    for x in sorted(executions, key=lambda x: (-x.context_tokens, x.id)):
        if heap and -heap[0][0] >= x.context_tokens:
            neg, tid, i = heapq.heappop(heap)
            moves.append((x, targets[i]))
            left[tid] -= 1
            if left[tid] > 0:
                heapq.heappush(heap, (neg + x.context_tokens, tid, i))
        else:  # the roomiest target cannot take the largest remaining context: neither can any other
            parks.append(x)
    return moves, parks


def plan_drain(engines: Sequence[EngineView], live: Sequence[ExecutionView], n_victims: int, *, kv_fill: float,
               slots: Callable[[EngineView], int] = _limit_room) -> DrainPlan:
    """Drain the first `n_victims` engines of `drain_order` (at most all but one) and place their executions."""
    order = drain_order(engines)
    victims = order[: max(0, min(n_victims, len(order) - 1))]
    vids = {e.id for e in victims}
    stay = [e for e in engines if e.id not in vids]
    movers = [x for x in live if x.engine_id in vids]
    moves, parks = assign_targets(movers, stay, kv_fill=kv_fill, slots=slots)
    return DrainPlan(tuple(victims), tuple(moves), tuple(parks))


@dataclass(frozen=True)
class Candidate:
    """One trainer size and what the controller predicts for it (absolute times)."""

    gpus: int
    plan: DrainPlan
    step_end: float  # the step's GPUs gathered, then trained
    next_ready: float  # the following batch ready
    last_end: float  # the last batch of the groups admitted so far trained
    train_s: float
    cuts: float = 0.0  # executions the plan's delays are expected to push past their deadline

    @property
    def key(self) -> tuple[float, float, int]:
        return (self.last_end, self.step_end, -self.gpus)


def evaluate(plan: DrainPlan, *, gpus: int, now: float, train_s: float, finish: dict[int, float],
             waits_s: dict[int, float], engines: Sequence[EngineView], live: Sequence[ExecutionView],
             group_of: dict[int, int], pending: Sequence[int], finished: set[int], n_next: int,
             queued: Sequence[int], durations: Sequence[float], step_s: Callable[[int, float], float],
             stop_s: float = 0.0, start_s: float = 0.0,
             risk: Callable[[ExecutionView, float], float] | None = None,
             scale: Callable[[int], float] = lambda n: 1.0, due: Sequence[int] | None = None,
             starting: Sequence[float] = ()) -> Candidate:
    """The candidate for `plan` (a trainer of `gpus` GPUs; see the module docstring).

    `finish`: each live execution's predicted finish (absolute) without reallocation; `waits_s`: each
    one's wait for a tool-call boundary; `pending`: the untrained groups outside the batch being trained
    (ids), `finished` those of them done; `n_next`: groups the following batch needs; `queued`: the group
    id of each execution waiting unstarted (admitted or still to be), in order; `durations`: what finished
    executions took, cycled over the queued ones; `stop_s` / `start_s`: an engine's stop and (re)start
    (the drained engines' slots come back `start_s` after the step ends); `risk(x, stretch)`: the
    probability x is cut if stretched so (`cut_p`); without it, a cut is a predicted finish
    pushed past the deadline; `scale(n)`: how much longer than the finished ones a job takes with the
    work spread over n engines (the staying ones until the drained ones are back, then all); `due`: each
    pending group's batch index by the staleness bound (`batch_ready_times`); `starting`: when each slot of
    the engines being started (not yet in `engines`) is expected to serve. The plan places every migrant
    (`parks` empty: a drain never parks)."""
    if plan.parks:
        raise ValueError("evaluate: a candidate plan places every migrant (it parks none)")
    gather = max((waits_s[x.id] for x, _ in plan.moves), default=0.0)
    end = now + gather + (stop_s if plan.victims else 0.0) + train_s
    # each engine's step time now and after the moves: executions stay where they are put until they finish,
    # so an engine's slowdown stretches the whole remaining time of everything it holds
    by_id = {e.id: e for e in engines}
    add_n: dict[int, int] = {}
    add_k: dict[int, float] = {}
    for x, t in plan.moves:
        add_n[t.id] = add_n.get(t.id, 0) + 1
        add_k[t.id] = add_k.get(t.id, 0.0) + x.context_tokens
    before = {e.id: step_s(max(e.n_live, 1), e.kv_used) for e in engines}
    after = {i: step_s(by_id[i].n_live + add_n[i], by_id[i].kv_used + add_k[i]) for i in add_n}
    target = {x.id: t.id for x, t in plan.moves}
    vids = {e.id for e in plan.victims}
    t_of: dict[int, float] = {}
    stretch: dict[int, float] = {}
    for x in live:
        if x.id in target or x.engine_id not in vids:
            dst = target.get(x.id, x.engine_id)
            stretch[x.id] = after.get(dst, before.get(dst, 1.0)) / before.get(x.engine_id, 1.0)
            t_of[x.id] = now + (finish[x.id] - now) * stretch[x.id]
    # the unstarted executions (`queued`: their group ids, in admission order) take engine slots as they
    # free: a staying execution's finish, a slot free now, the drained engines' back at step end
    limit = {e.id: e.admit_limit for e in engines}
    used: dict[int, int] = {}
    for x in live:
        if x.id in t_of:
            dst = target.get(x.id, x.engine_id)
            used[dst] = used.get(dst, 0) + 1
    free_at = list(t_of.values()) + [now] * sum(max(0, limit[e.id] - used.get(e.id, 0)) for e in engines
                                                if e.id not in vids) + [end + start_s] * sum(limit[i] for i in vids)
    free_at += list(starting)
    jobs = [durations[i % len(durations)] if durations else 0.0 for i in range(len(queued))]
    n_all, n_stay, back = len(engines), len(engines) - len(vids), end + start_s
    f_stay, f_all = scale(max(n_stay, 1)), scale(max(n_all, 1))
    done_at = run_queue(free_at, jobs, lambda i, t: f_stay if t < back else f_all)
    group_end: dict[int, float] = {}
    cuts = 0.0
    for x in live:
        t = t_of[x.id]
        if risk is not None:
            cuts += risk(x, stretch[x.id]) - risk(x, 1.0)
        else:
            cuts += finish[x.id] <= x.deadline_at < t
        gid = group_of[x.id]
        group_end[gid] = max(group_end.get(gid, now), t)
    for gid, t in zip(queued, done_at):
        group_end[gid] = max(group_end.get(gid, now), t)
    ends = [now if g in finished else group_end.get(g, now) for g in pending]
    ready = batch_ready_times(ends, n_next, due)[0] if n_next > 0 and ends else now
    # the drained engines are back for the rollout after the step, so a later step trains on these GPUs only
    # by draining them again: each pays this step's switch (the wait for the migrants' boundaries, the stop)
    again = train_s + ((gather + stop_s) if plan.victims else 0.0)
    last = last_batch_end(end, ends, n_next, again, due) if n_next > 0 and ends else end
    return Candidate(gpus=gpus, plan=plan, step_end=end, next_ready=ready, last_end=last, train_s=train_s, cuts=cuts)


def park_pays(*, now: float, finish: dict[int, float], group_of: dict[int, int], pending: Sequence[int],
              finished: set[int], due: Sequence[int], per_batch: int, capacity: int, parks: Sequence[int],
              gather_s: float, stop_s: float, train_s: float, start_s: float, extra_cuts: Callable[[float], float],
              tolerance: float) -> bool:
    """With no trainer size whose migrants all fit (policies.elastic, 1.): drain the smallest size that reaches
    the trainer's minimum now, parking the migrants that fit nowhere (`parks`), rather than hold admission until
    the live executions fit on the staying engines? Holding, they fit once enough have finished (`finish`: each
    live execution's predicted finish) to leave no more than the staying engines' `capacity`, and the step trains
    then; parking, it trains now, and the parked executions resume when the drained engines serve again after
    the step, that much later. Parks pay where the next batch (formed from the `pending` groups' predicted ends
    as `batch_ready_times` forms it; a group neither live nor `finished` has not started: unknown) is so trained
    sooner and the parks are expected to cut (`extra_cuts(delay)`) at most `tolerance` more executions."""
    over = len(finish) - capacity
    fit_at = now if over <= 0 else sorted(finish.values())[over - 1]
    park_end = now + gather_s + stop_s + train_s
    delay = park_end + start_s - now

    def next_end(step_end: float, shift: float) -> float:
        ends: dict[int, float] = {}
        for xid, t in finish.items():
            g = group_of[xid]
            ends[g] = max(ends.get(g, now), t + (shift if xid in parked else 0.0))
        group_ends = [ends.get(g, now if g in finished else math.inf) for g in pending]
        ready = batch_ready_times(group_ends, per_batch, due)[0] if pending and per_batch > 0 else now
        return max(step_end, ready) + train_s

    parked = set(parks)
    if next_end(park_end, delay) >= next_end(fit_at + gather_s + stop_s + train_s, 0.0):
        return False
    return extra_cuts(delay) <= tolerance


def choose(candidates: Sequence[Candidate], cut_tolerance: float = 0.0) -> Candidate:
    """Among the candidates expected to cut at most `cut_tolerance` executions more than the least-cutting
    one, the one training every admitted group soonest (ties: sooner step end, then larger)."""
    least = min(c.cuts for c in candidates)
    return min((c for c in candidates if c.cuts <= least + cut_tolerance + 1e-12), key=lambda c: c.key)

