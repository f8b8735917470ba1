"""Replay a serving run's arrivals through a step-by-step model of vLLM's V1 scheduler.

Each replica runs engine steps back to back while it has work. A step is scheduled as vLLM does:

1. running requests in admission order, each asking for its remaining uncomputed tokens (1 for a
   decode, the rest of its prompt for a partial prefill), capped by the step's token budget
   `max_num_batched_tokens`. KV comes in blocks of `block_size` tokens; when a request's new blocks do
   not fit, the most recently admitted running request is preempted (recompute: its blocks are freed,
   its computed tokens reset, and it goes back to the front of the waiting queue), until it fits or
   the request itself was preempted;
2. if nothing was preempted, waiting requests in FCFS order while the budget lasts and fewer than
   `max_num_seqs` run: a request is admitted only if the free blocks hold its whole known sequence
   (vLLM's `scheduler_reserve_full_isl`), and is scheduled for as much of it as the budget allows
   (chunked prefill).

A request whose computed tokens reach its known sequence samples one token at the end of the step
(the first one is its first token); it finishes on its `output_toks`-th. A preempted request
re-prefills prompt plus generated tokens. The step's duration comes from a step-time function of
(decodes n, their total context, prefill chunk tokens m, chunk offset p): gyre.roofline's
`EngineRoofline.step_time`, the simulator's own. A one-token item is a decode at context p + 1.
Several prefill chunks in one step enter as one chunk of their total length M at the offset p' that
keeps the step's KV read (ctx + p) and attention FLOPs (ctx + M p' + M^2 / 2) exact (the roofline is
linear in both; the decode context absorbs the difference).
Data-parallel replicas each take a new arrival when it comes, routed as vLLM's DP load balancer routes
it (vllm/v1/engine/core_client.py, DPLBAsyncMPClient.get_core_engine_for_request): to the replica of
least 4 x waiting + running, the first in rank order on a tie, from counts the DP coordinator
publishes every 100 ms plus one waiting request for each request the client routed since. An MoE's
replicas under expert parallel (`group_step`) step in lockstep, as vLLM runs DP ranks of an MoE (every
MoE layer waits for all ranks' tokens): each step starts on all replicas at once and lasts
`group_step(batches)` (gyre.roofline_comm.ep_group_step_time); replicas with nothing to run wait it out.

Not modelled: prefix-cache hits (ShareGPT prompts barely share prefixes), async scheduling's overlap,
the scheduling of requests that arrive during a step before that step ends (they wait for the next).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

StepTime = Callable[[int, float, float, float], float]  # (decodes, their context, chunk tokens, chunk offset) -> s
Batch = tuple[int, float, float, float]
LB_INTERVAL_S = 0.1  # vLLM's DP coordinator publishes replicas' request counts every 100 ms


@dataclass(frozen=True, kw_only=True)
class SchedulerArgs:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    kv_blocks: int  # per replica


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    scheduled: np.ndarray  # per request, seconds (same clock as the arrivals)
    first_token: np.ndarray
    last_token: np.ndarray
    preemptions: int
    steps: int
    running_t: np.ndarray  # step start times (all replicas, merged, sorted)
    running_n: np.ndarray  # running requests (all replicas) just after each step's scheduling


class DPBalancer:
    """vLLM's DP load balancer (module docstring): least 4 x waiting + running, from counts refreshed at
    most every LB_INTERVAL_S, plus one waiting request per request routed since."""

    def __init__(self, replicas: int) -> None:
        self.counts = [[0, 0] for _ in range(replicas)]
        self.heard = -np.inf

    def route(self, now: float, live: list[tuple[int, int]]) -> int:
        """The replica for a request arriving at `now`; `live`: each replica's (waiting, running) now."""
        if now >= self.heard + LB_INTERVAL_S:
            self.heard = now
            self.counts = [list(c) for c in live]
        c = self.counts
        ri = min(range(len(c)), key=lambda j: (4 * c[j][0] + c[j][1], j))
        c[ri][0] += 1
        return ri


class _Replica:
    """One engine's scheduler state; request state lives in the shared arrays of `replay`."""

    def __init__(self, args: SchedulerArgs) -> None:
        self.args = args
        self.running: list[int] = []
        self.waiting: deque[int] = deque()
        self.free = args.kv_blocks
        self.busy_until = 0.0
        self.pending: list[tuple[int, int]] = []  # (request, new tokens) of the step in flight
        self.starting = False  # an idle replica's start is queued


def replay(arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, args: SchedulerArgs, step_time: StepTime,
           replicas: int = 1, group_step: Callable[[list[Batch]], float] | None = None) -> ReplayResult:
    """Run every request (arrays in arrival order) through `replicas` engines; with `group_step`, in
    lockstep (expert parallel); see the module docstring."""
    n = len(arrival)
    bs = args.block_size
    computed = [0] * n
    known = [int(x) for x in prompt]  # tokens of the sequence known so far (prompt + generated)
    generated = [0] * n
    blocks = [0] * n
    out = [int(x) for x in output]
    sched = np.full(n, np.nan)
    first = np.full(n, np.nan)
    last = np.full(n, np.nan)
    if any(-(-k // bs) > args.kv_blocks for k in (int(p) + int(o) for p, o in zip(prompt, output))):
        raise ValueError(f"a request needs more than the {args.kv_blocks} KV blocks of a replica")
    reps = [_Replica(args) for _ in range(replicas)]
    events: list[tuple[float, int, int]] = []  # (time, kind: 0 step end, 1 arrival, 2 idle start; index)
    for i, a in enumerate(arrival):
        heapq.heappush(events, (float(a), 1, i))
    preempt = steps = 0
    trace_t: list[float] = []
    trace_n: list[int] = []

    def plan(r: _Replica, now: float) -> Batch | None:
        """Schedule replica r's next step (vLLM's scheduler); its (decodes, context, chunk, offset) or None."""
        nonlocal preempt
        budget = args.max_num_batched_tokens
        sched_now: list[tuple[int, int]] = []
        preempted = False
        k = 0
        running = r.running
        while k < len(running) and budget > 0:
            q = running[k]
            m = min(known[q] - computed[q], budget)
            need = -(-(computed[q] + m) // bs) - blocks[q]
            while need > r.free:
                v = running.pop()
                r.free += blocks[v]
                blocks[v] = 0
                computed[v] = 0
                r.waiting.appendleft(v)
                preempted = True
                preempt += 1
                if v == q:
                    break
            else:
                r.free -= need
                blocks[q] += need
                sched_now.append((q, m))
                budget -= m
                k += 1
                continue
            break
        if not preempted:
            while r.waiting and budget > 0 and len(running) < args.max_num_seqs:
                q = r.waiting[0]
                if -(-known[q] // bs) > r.free:  # the whole known sequence must fit
                    break
                m = min(known[q] - computed[q], budget)
                need = -(-(computed[q] + m) // bs) - blocks[q]
                r.waiting.popleft()
                r.free -= need
                blocks[q] += need
                running.append(q)
                if np.isnan(sched[q]):
                    sched[q] = now
                sched_now.append((q, m))
                budget -= m
        if not sched_now:
            r.pending = []
            if preempted and r.waiting:  # everything running was preempted: the next step admits
                return plan(r, now)
            return None
        n_dec = 0
        ctx = big_m = sum_p = attn = 0.0
        for q, m in sched_now:
            p = computed[q]
            if m == 1:  # a decode (or a one-token chunk): reads its p + 1 tokens
                n_dec += 1
                ctx += p + 1
            else:
                big_m += m
                sum_p += p
                attn += m * p + 0.5 * m * m
        p_eff = sum_p
        if big_m and attn != big_m * sum_p + 0.5 * big_m * big_m:  # several chunks: one equivalent chunk
            p_eff = (attn - 0.5 * big_m * big_m - sum_p) / (big_m - 1)
            ctx += sum_p - p_eff
        r.pending = sched_now
        return n_dec, ctx, big_m, p_eff

    def start_step(r: _Replica, ri: int, now: float) -> None:
        nonlocal steps
        if group_step is not None:  # lockstep: every replica plans, the step lasts the group's time
            batches = [b for b in (plan(x, now) for x in reps) if b is not None]
            if not batches:
                return
            dt = group_step(batches)
            for x in reps:
                x.busy_until = now + dt
            heapq.heappush(events, (now + dt, 0, -1))
        else:
            b = plan(r, now)
            if b is None:
                return
            r.busy_until = now + step_time(*b)
            heapq.heappush(events, (r.busy_until, 0, ri))
        steps += 1
        trace_t.append(now)
        trace_n.append(sum(len(x.running) for x in reps))

    def end_step(r: _Replica, now: float) -> None:
        for q, m in r.pending:
            computed[q] += m
            if computed[q] == known[q]:
                generated[q] += 1
                known[q] += 1
                if generated[q] == 1:
                    first[q] = now
                if generated[q] >= out[q]:
                    last[q] = now
                    r.running.remove(q)
                    r.free += blocks[q]
                    blocks[q] = 0
        r.pending = []

    balancer = DPBalancer(replicas)

    def idle(ri: int) -> bool:
        return not any(x.pending for x in reps) if group_step is not None else not reps[ri].pending

    while events:
        now, kind, idx = heapq.heappop(events)
        if kind == 1:
            ri = balancer.route(now, [(len(x.waiting), len(x.running)) for x in reps]) if replicas > 1 else 0
            r = reps[ri]
            r.waiting.append(idx)
            si = 0 if group_step is not None else ri
            if idle(ri) and not reps[si].starting:  # idle: start once every arrival at this instant is in
                reps[si].starting = True
                heapq.heappush(events, (now, 2, si))
        elif kind == 2:
            reps[idx].starting = False
            start_step(reps[idx], idx, now)
        elif idx < 0:  # a lockstep step ended on every replica
            for x in reps:
                end_step(x, now)
            start_step(reps[0], 0, now)
        else:
            r = reps[idx]
            end_step(r, now)
            start_step(r, idx, now)
    if np.isnan(last).any():
        raise RuntimeError("replay ended with unfinished requests")
    order = np.argsort(trace_t, kind="stable")
    return ReplayResult(scheduled=sched, first_token=first, last_token=last, preemptions=preempt, steps=steps,
                        running_t=np.asarray(trace_t)[order], running_n=np.asarray(trace_n)[order])
