"""The elastic controller's decisions, as pure functions of one `Forecast` (docs/elastic.md).

One objective throughout: when the pending groups are trained (policies.batch_times.last_batch_end), among
the choices expected to cut at most the equal-work tolerance more executions than the least-cutting one.
Simplifications: a migrant's re-prefill is not charged; an execution decodes all of its remaining time, so
its engine's slowdown delays it in full; waiting executions take finished ones' durations, in start order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gyre.cluster import EngineView, ExecutionView
from gyre.policies.batch_times import batch_ready_times, last_batch_end, run_queue
from gyre.policies.elastic_forecast import Forecast
from gyre.policies.placement import assign_targets, room


def pending_ends(f: Forecast, free_at: Sequence[float], factor: Callable[[int, float], float],
                 finish: Mapping[int, float] | None = None) -> list[float]:
    """When each pending group ends: its live executions' last finish (`finish`, default the forecast's), and
    its waiting ones' as they take slots (`free_at`), each a finished one's duration times factor(i, start)."""
    jobs = [f.durations[i % len(f.durations)] if f.durations else 0.0 for i in range(len(f.waiting))]
    finish = f.finish if finish is None else finish
    ends: dict[int, float] = {}
    for x in f.live:
        ends[x.group_id] = max(ends.get(x.group_id, f.now), finish[x.id])
    for gid, t in zip(f.waiting, run_queue(free_at, jobs, factor)):
        ends[gid] = max(ends.get(gid, f.now), t)
    return [f.now if gid in f.finished else ends.get(gid, f.now) for gid in f.pending]


@dataclass(frozen=True)
class DrainPlan:
    victims: tuple[EngineView, ...]
    moves: tuple[tuple[ExecutionView, EngineView], ...]
    parks: tuple[ExecutionView, ...] = ()  # migrants no staying engine has room for

    @property
    def gpus(self) -> list[int]:
        return [g for e in self.victims for g in e.gpus]


def plan_drain(engines: Sequence[EngineView], live: Sequence[ExecutionView], n_victims: int, *, kv_fill: float,
               slots: Callable[[EngineView], int] = room) -> DrainPlan:
    """Drain the first `n_victims` engines (all but one at most) by fewest live, then decoding, executions."""
    order = sorted(engines, key=lambda e: (e.n_live, e.n_decoding, e.id))
    victims = order[: max(0, min(n_victims, len(order) - 1))]
    vids = {e.id for e in victims}
    moves, parks = assign_targets([x for x in live if x.engine_id in vids], [e for e in engines if e.id not in vids],
                                  kv_fill=kv_fill, slots=slots)
    return DrainPlan(tuple(victims), tuple(moves), tuple(parks))


@dataclass(frozen=True)
class Candidate:
    """One trainer size and its predicted times (absolute)."""

    gpus: int
    plan: DrainPlan
    step_end: float  # the step's GPUs gathered, then trained
    next_ready: float  # the following batch ready
    last_end: float  # the last pending group trained: the objective
    train_s: float
    cuts: float = 0.0  # executions the plan's delays are expected to push past their deadline

    @property
    def key(self) -> tuple[float, float, int]:
        return (self.last_end, self.step_end, -self.gpus)


def evaluate(f: Forecast, plan: DrainPlan, gpus: int, train_s: float) -> Candidate:
    """A trainer of `gpus` GPUs gathered by `plan` (which parks none) and trained `train_s` (docs/elastic.md)."""
    now = f.now
    gather = max((f.waits[x.id] for x, _ in plan.moves), default=0.0)
    end = now + gather + (f.stop_s if plan.victims else 0.0) + train_s
    by_id = {e.id: e for e in f.engines}
    add_n: dict[int, int] = {}
    add_k: dict[int, float] = {}
    for x, t in plan.moves:
        add_n[t.id] = add_n.get(t.id, 0) + 1
        add_k[t.id] = add_k.get(t.id, 0.0) + x.context_tokens
    before = {e.id: f.step_s(max(e.n_live, 1), e.kv_used) for e in f.engines}
    after = {i: f.step_s(by_id[i].n_live + add_n[i], by_id[i].kv_used + add_k[i]) for i in add_n}
    target = {x.id: t.id for x, t in plan.moves}
    vids = {e.id for e in plan.victims}
    t_of: dict[int, float] = {}
    stretch: dict[int, float] = {}
    used: dict[int, int] = {}
    for x in f.live:
        if x.id in target or x.engine_id not in vids:
            dst = target.get(x.id, x.engine_id)
            stretch[x.id] = after.get(dst, before.get(dst, 1.0)) / before.get(x.engine_id, 1.0)
            t_of[x.id] = now + (f.finish[x.id] - now) * stretch[x.id]
            used[dst] = used.get(dst, 0) + 1
    back = end + f.start_s
    free_at = (list(t_of.values())
               + [now] * sum(max(0, e.admit_limit - used.get(e.id, 0)) for e in f.engines if e.id not in vids)
               + [back] * sum(e.admit_limit for e in plan.victims) + list(f.starting))
    f_stay, f_all = f.scale(max(len(f.engines) - len(vids), 1)), f.scale(max(len(f.engines), 1))
    ends = pending_ends(f, free_at, lambda i, t: f_stay if t < back else f_all, t_of)
    cuts = sum(f.risk(x, stretch[x.id]) - f.risk(x, 1.0) for x in f.live)
    n = f.per_batch
    ready = batch_ready_times(ends, n, f.due)[0] if n > 0 and ends else now
    again = train_s + ((gather + f.stop_s) if plan.victims else 0.0)
    last = last_batch_end(end, ends, n, again, f.due) if n > 0 and ends else end
    return Candidate(gpus=gpus, plan=plan, step_end=end, next_ready=ready, last_end=last, train_s=train_s, cuts=cuts)


def choose(candidates: Sequence[Candidate], tolerance: float = 0.0) -> Candidate:
    """Among those expected to cut at most `tolerance` more than the least-cutting one, the soonest `key`."""
    least = min(c.cuts for c in candidates)
    return min((c for c in candidates if c.cuts <= least + tolerance + 1e-12), key=lambda c: c.key)


def park_pays(f: Forecast, parks: Sequence[ExecutionView], gather_s: float, train_s: float, capacity: int,
              tolerance: float) -> bool:
    """Drain now and park `parks` until the drained engines serve again, rather than hold admission until the
    live executions fit the staying engines' `capacity`? If the next batch so trains sooner, within `tolerance`."""
    over = len(f.live) - capacity
    fit_at = f.now if over <= 0 else sorted(f.finish.values())[over - 1]
    park_end = f.now + gather_s + f.stop_s + train_s
    delay = park_end + f.start_s - f.now
    parked = {x.id for x in parks}

    def next_end(step_end: float, shift: float) -> float:
        ends: dict[int, float] = {}
        for x in f.live:
            ends[x.group_id] = max(ends.get(x.group_id, f.now), f.finish[x.id] + (shift if x.id in parked else 0.0))
        group_ends = [ends.get(g, f.now if g in f.finished else float("inf")) for g in f.pending]
        if not f.pending or f.per_batch <= 0:
            return max(step_end, f.now) + train_s
        return last_batch_end(step_end, group_ends, f.per_batch, train_s, f.due, batches=1)

    if next_end(park_end, delay) >= next_end(fit_at + gather_s + f.stop_s + train_s, 0.0):
        return False
    return sum(f.risk(x, 1.0, delay) - f.risk(x, 1.0) for x in parks) <= tolerance


def size_trainer(f: Forecast, *, kv_fill: float, slots: Callable[[EngineView], int],
                 most: Callable[[EngineView], int], tolerance: float) -> tuple[Candidate | None, bool]:
    """Decision 1: the trainer for a ready batch (None: none now) and whether admission holds. `slots(e)`: the
    migrants a staying engine may take; `most(e)`: the executions it may carry."""
    cands, blocked = [], None
    for k in range(len(f.engines)):
        plan = plan_drain(f.engines, f.live, k, kv_fill=kv_fill, slots=slots)
        if len(plan.victims) < k or plan.parks:
            blocked = k if plan.parks and not cands else None
            break
        g = f.free + len(plan.gpus)
        if g >= f.min_train:
            cands.append(evaluate(f, plan, g, f.train_s(g) + (f.onload_s if plan.victims else 0.0)))
    if cands:
        return choose(cands, tolerance), False
    if blocked is None:
        return None, False
    for k in range(blocked, len(f.engines)):
        plan = plan_drain(f.engines, f.live, k, kv_fill=kv_fill, slots=slots)
        if f.free + len(plan.gpus) >= f.min_train:
            break
    g = f.free + len(plan.gpus)
    if g < f.min_train:
        return None, True
    train = f.train_s(g) + f.onload_s
    gather = max([f.waits[x.id] for x, _ in plan.moves] + [f.waits[x.id] for x in plan.parks], default=0.0)
    capacity = sum(most(e) for e in f.engines if e not in plan.victims)
    if not park_pays(f, plan.parks, gather, train, capacity, tolerance):
        return None, True
    end = f.now + gather + f.stop_s + train
    return Candidate(gpus=g, plan=plan, step_end=end, next_ready=end, last_end=end, train_s=train), False


def choose_grow(f: Forecast, drain_s: float, empty_drain_s: float | None = None) -> int:
    """Decision 2: engines to start on the free GPUs at a step end (ties: fewer). Below the trainer's minimum the
    next step first drains engines (`drain_s`); with `empty_drain_s` (eta 0: every engine empty when the next
    batch is ready) it may also train on every GPU but one engine's after that stop."""
    engines, limit = len(f.engines), max(e.admit_limit for e in f.engines)
    unused = sum(max(0, e.admit_limit - e.n_live) for e in f.engines)
    best, best_end = 0, float("inf")
    for k in range(f.free // f.per + 1):
        e = engines + k
        if e == 0:
            continue
        keep = f.free - k * f.per
        g, wait = (keep, 0.0) if keep >= f.min_train else (-(-f.min_train // f.per) * f.per, drain_s)
        free_at = [f.finish[x.id] for x in f.live] + [f.now] * unused + [f.now + f.start_s] * (k * limit)
        scale = f.scale(e)
        last = pending_ends(f, free_at, lambda i, t: scale)
        end = last_batch_end(f.now + wait, last, f.per_batch, f.train_s(g) + f.onload_s, f.due) if last else f.now
        if last and empty_drain_s is not None and e > 1:
            drained = f.free + (engines - 1) * f.per  # all but one engine (plan_drain), k of them new
            end = min(end, last_batch_end(f.now, last, f.per_batch, f.train_s(drained) + f.onload_s + empty_drain_s,
                                          f.due))
        if end < best_end - 1e-9:
            best, best_end = k, end
    return best


def initial_engines(*, n_gpus: int, per: int, min_train: int, eta: int, limit: int, ctx: float,
                    step_s: Callable[[int, float], float], train_s_per_token_gpu: float) -> int:
    """Decision 0: the engines kept at the start: the e maximizing the slower of decode (e x `limit` /
    step_s(limit, ctx) tokens/s) and training (the GPUs left); ties: more. At eta 0 every GPU an engine."""
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
    """A live execution past its first segment, or a finished one of two or more?"""
    return any(t >= 1 for t in live_turns) or any(s > 1 for s in finished_segments)


def lend_pays(f: Forecast, wait_s: float) -> bool:
    """Decision 0: lend the reserve? If the first batch is predicted ready after the lent engines' start and the
    drain that returns them (`wait_s` for boundaries, the stop, the onload)."""
    free_at = [f.finish[x.id] for x in f.live] + [f.now] * sum(max(0, e.admit_limit - e.n_live) for e in f.engines)
    last = pending_ends(f, free_at, lambda i, t: 1.0)
    ready = batch_ready_times(last, f.per_batch, f.due)[0] if last else f.now
    return ready - f.now > f.start_s + wait_s + f.stop_s + f.onload_s
