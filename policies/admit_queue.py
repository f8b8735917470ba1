"""Admission by room: an engine is handed an execution only while it can hold it; the rest wait unstarted.

The rule: an engine holds at most `EngineView.admit_limit` executions at once, floor(fill x its KV
capacity / the workload's window), at least 1 (gyre.hardware.admission_limit; `fill` is the config's
`admission_fill`, default 1), or a policy's own lower `cap` (a fixed split's searched per-engine
concurrency, policies.async_split). It is the concurrency vLLM reports at start-up for requests of
max_model_len tokens, and the bound a real rollout manager puts on each server (a fixed number of
concurrent rollouts per engine), derived here from KV instead of tuned per workload. Because so many
full-window contexts fit together, the admitted set's growth alone never outgrows the engine: the
preemption loop of admitting everything at once (each admitted execution prefilled, grown, preempted,
re-prefilled, its deadline clock running all the while) cannot start. A context can still pass its
window by one turn (or a sub-agent sit beside its parent); the engine preempts then, as vLLM does.

Why this rule and not "live KV below a fill of capacity": contexts start small (a prompt) and grow turn
by turn, so a live-KV test admits an engine full of young executions that then outgrow it together,
exactly the thrash this is meant to stop; a window-bounded count needs no foresight of lengths. Its cost
is concurrency where typical contexts stay far below the window and few engines serve many executions
(a small rollout split); admitting beyond the limit while live KV is low recovers that, but brings the
preemption loop back wherever contexts grow, so the limit is the whole rule. The window is the
workload's `max_context` (a single-turn workload's prompt and generation caps, when those are smaller).

How it runs: `submit` queues executions (FIFO) and returns, for each, a handle that completes with it
when it finishes (its finish handle once admitted). `pump` hands waiting executions, in order, to the
least-loaded engine that has room (fewest executions per KV token of capacity, ties by id), counting
migrations already sent to an engine (`move`) as held there. It runs when an admitted execution
finishes (as `Batcher.watch` watches finish handles), and the policy calls it when its engines change.
An execution moved off an engine that cannot go elsewhere (a drain whose targets are full) is parked by
the policy and handed to `hold`: it is resumed, ahead of the unstarted ones, where room frees.

With no engine ready (all restarting after a fault) executions go to the restarting ones, within their
room: a restarting engine accepts admissions and starts them when it is back.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

from gyre.cluster import Cluster, EngineView, ExecutionView
from gyre.handles import Handle


class AdmissionQueue:
    """Executions waiting for room on an engine, admitted as room frees."""

    def __init__(self, cluster: Cluster, engines: Sequence[EngineView] | Callable[[], Sequence[EngineView]],
                 limit: Callable[[EngineView], int] | None = None) -> None:
        """`engines`: the engines to admit to, or a function returning them now (a pool that changes);
        `limit(e)`: the policy's own cap on the executions `e` holds, within its `admit_limit` (default: that)."""
        self.cluster = cluster
        self.limit = limit
        self._engines = engines if callable(engines) else (lambda: engines)
        self.waiting: deque[tuple[ExecutionView, Handle]] = deque()  # unstarted, in submission order
        self.held: deque[ExecutionView] = deque()  # parked off an engine, resumed first
        self.incoming: dict[int, int] = {}  # engine id -> migrations sent there, not yet arrived

    def __len__(self) -> int:
        return len(self.waiting) + len(self.held)

    def submit(self, executions: Sequence[ExecutionView]) -> list[Handle]:
        """Queue executions; each handle completes with the execution when it finishes."""
        out = []
        for x in executions:
            h = Handle(f"queued{x.id}")
            self.waiting.append((x, h))
            out.append(h)
        self.pump()
        return out

    def hold(self, x: ExecutionView) -> None:
        """A parked execution waits for room (resumed before any unstarted one)."""
        self.held.append(x)
        self.pump()

    def park(self, x: ExecutionView) -> Handle:
        """Park `x` at its next tool-call boundary and hold it here until an engine has room."""
        h = self.cluster.park(x)
        h.on_done(lambda h: self.hold(x) if h.error is None and h.value else None)
        return h

    def room(self, e: EngineView) -> int:
        """Executions `e` may still be handed."""
        limit = e.admit_limit if self.limit is None else min(e.admit_limit, self.limit(e))
        return limit - e.n_live - self.incoming.get(e.id, 0)

    def move(self, x: ExecutionView, target: EngineView) -> Handle:
        """Migrate `x` to `target`, counting it there until it arrives (or the move is dropped)."""
        self.incoming[target.id] = self.incoming.get(target.id, 0) + 1
        h = self.cluster.migrate(x, target)

        def arrived(_h: Handle) -> None:
            self.incoming[target.id] -= 1
            self.pump()

        h.on_done(arrived)
        return h

    def pump(self) -> None:
        """Hand waiting executions, held ones first, to the least-loaded engines with room."""
        if not self.waiting and not self.held:
            return
        given = list(self._engines())
        ready = [e for e in given if e.ready]
        # engines with room, least loaded first (ties: lower id): a heap, re-keyed when one is handed an execution
        # (only that engine's load moves meanwhile), so a pump costs O(log engines) per execution
        cands = [(e.n_live / max(e.kv_capacity, 1), e.id, e) for e in (ready or given) if self.room(e) > 0]
        heapq.heapify(cands)
        while cands and (self.held or self.waiting):
            e = cands[0][2]
            if self.held:
                x = self.held.popleft()
                if ready:
                    self.cluster.resume(x, e)
                else:  # resume needs a ready engine: wait for one
                    self.held.appendleft(x)
                    if not self.waiting:
                        return
                    self._admit(e)
            else:
                self._admit(e)
            if self.room(e) <= 0:
                heapq.heappop(cands)
            else:
                heapq.heapreplace(cands, (e.n_live / max(e.kv_capacity, 1), e.id, e))

    def _admit(self, e: EngineView) -> None:
        x, proxy = self.waiting.popleft()
        h = self.cluster.admit(x, e)

        def done(h: Handle) -> None:
            if h.error is not None:
                proxy.fail(h.error)
            else:
                proxy.succeed(h.value)
            self.pump()

        h.on_done(done)
