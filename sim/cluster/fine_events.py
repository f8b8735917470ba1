"""The simulator's innermost loop: the fine events (engine wakeups and other SimCluster.schedule calls) run in
time order until one leaves work for the cluster's outer loop (gyre.sim.cluster.backend.SimCluster._run).

A fine event is a heap entry (time, tie-break, fn, arg); running it sets the environment's clock to its time
and calls fn(time, arg). In the plain case (no invariant checks, no progress reports, no faults) the run goes
on while nothing was deferred (a handle to complete), no engine waits for a re-plan and the next fine event is
not later than `ts`, the next coarse (SimPy) event's time; otherwise it stops after one. A module of its own so
that the hot-path build (gyre.compiled) compiles it.
"""

from __future__ import annotations

from typing import Any

from gyre.sim.cluster.time_heap import heappop


def run_fine(q: list, env: Any, ts: float, deferred: list, dirty: list, plain: bool) -> int:
    """Run the fine events due as the module docstring says (at least one); return how many ran. `deferred` and
    `dirty` are the cluster's lists, which events append to and only the outer loop empties."""
    events = 0
    while True:
        t, _, fn, arg = heappop(q)
        env._now = t
        fn(t, arg)
        events += 1
        if not plain or deferred or dirty or not q or q[0][0] > ts:
            return events
