"""The simulator's clock and its one event heap: Gyre's own discrete-event loop (docs/event-loop.md says why
it is not SimPy's).

An event is a heap entry (time, tie-break, fn, arg); running it sets the clock `now` to its time and calls
fn(time, arg). Two kinds share the heap: engine events (`at`: each engine's next wakeup, pushed by the engine
itself with `heap` and `tick`, and the few other events the cluster schedules at a time), by far the most
numerous, and timers (`after`: a callback dt seconds from now, for role switches, training, weight syncs and
policy timeouts). Engine events take tie-breaks from 0 and timers from `_TIMER` on, so at equal times engine
events run first, and each kind in the order it was scheduled: a run is a pure function of (config, policy,
seed).

`run` runs events in time order until one leaves work for the cluster's outer loop
(gyre.sim.cluster.backend.SimCluster._run). In the plain case (no invariant checks, no progress reports, no
faults) it goes on while nothing was deferred (a handle to complete), no engine waits for a re-plan, and the
event run and the next one are engine events; otherwise it stops after one. A timer always ends a run: its
callback may complete a handle, and so resume the policy, at once. A module of its own so that the hot-path
build (gyre.compiled) compiles it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from gyre.sim.cluster.time_heap import heappop, heappush

_TIMER = 1 << 62  # the first timer's tie-break: above every engine event's
_INF = float("inf")


def _call(t: float, fn: Callable[[], None]) -> None:
    """A timer's entry in the heap: its callback takes no arguments."""
    fn()


class EventLoop:
    __slots__ = ("now", "heap", "tick", "_timers")

    def __init__(self) -> None:
        self.now = 0  # the clock: the time of the event running, or of the last one run (0 before any)
        self.heap: list[tuple[float, int, Callable, Any]] = []
        self.tick = itertools.count()  # engine events' tie-breaks
        self._timers = itertools.count(_TIMER)  # timers' tie-breaks

    def at(self, t: float, fn: Callable[[float, Any], None], arg: Any) -> None:
        """An engine event: fn(t, arg) at time t (not before now)."""
        heappush(self.heap, (t, next(self.tick), fn, arg))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        """A timer: fn() at now + dt (dt >= 0)."""
        if dt < 0:
            raise ValueError(f"negative delay {dt}")
        heappush(self.heap, (self.now + dt, next(self._timers), _call, fn))

    def idle(self) -> bool:
        """Nothing can run: no event, or only timers that never fire (at infinity)."""
        q = self.heap
        return not q or (q[0][0] == _INF and q[0][1] >= _TIMER)

    def run(self, deferred: list, dirty: list, plain: bool) -> int:
        """Run the events due as the module docstring says (at least one, unless it is idle); return how many
        ran (0: idle). `deferred` and `dirty` are the cluster's lists, which events append to and only its outer
        loop empties."""
        if self.idle():
            return 0
        q = self.heap
        events = 0
        while True:
            t, seq, fn, arg = heappop(q)
            self.now = t
            fn(t, arg)
            events += 1
            if not plain or seq >= _TIMER or deferred or dirty or not q:
                return events
            nxt = q[0]
            if nxt[1] >= _TIMER:
                return events
