"""Tools as a service: tool calls run on a pool of Ray tool workers, bounded, timed out, retried.

What it models: an agent's tool calls (and the verifier calls that score it) are remote work that may be
slow, hang, raise, or lose the process running it. `ToolService` lives on the driver inside the run loop of
gyre.real.backend.RealCluster (it submits Ray futures and timers through the cluster's `submit` and
`call_after`, so nothing blocks): at most `max_inflight` calls run at once (the rest wait, in order), each
on the least busy of `workers` `ToolWorker` actors spread over the cluster. An attempt that does not answer
within `timeout_s` is cancelled; one whose worker died is retried on a replacement worker, which takes the
dead one's place and serves once it answers a ping (a worker's start never counts against a call's timeout). A call is tried `1 + retries` times when it times out or loses its worker; a call that
raises is not retried (a tool's own error is its answer). When no attempt succeeds the episode receives a
gyre.real.task_api.ToolError saying why, and the run goes on.

A `ToolWorker` is an asyncio actor: a call with `async arun()` is awaited, one with a blocking `run()` runs
in a worker thread, so a slow call never blocks the others.

Simplifications: a timed-out blocking `run()` keeps its thread until it returns (the sandbox bounds its own
wall time, gyre.real.sandbox); workers are not load-balanced by measured cost, only by calls in flight.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import ray

from gyre.real.component_config import ToolConfig
from gyre.real.task_api import ToolError


class ToolWorker:
    """Runs tool calls concurrently (an asyncio Ray actor)."""

    async def call(self, call) -> Any:
        if hasattr(call, "arun"):
            return await call.arun()
        return await asyncio.to_thread(call.run)

    def ping(self) -> bool:
        return True


def spawn_tool_worker():
    """A fresh tool worker actor, placed by Ray's SPREAD strategy."""
    actor = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=0)(ToolWorker)
    return actor.options(scheduling_strategy="SPREAD").remote()


class _Call:
    __slots__ = ("call", "done", "attempt", "ref", "worker", "over")

    def __init__(self, call, done) -> None:
        self.call, self.done, self.attempt = call, done, 0
        self.ref = self.worker = None
        self.over = False  # the current attempt is resolved (answered, failed or timed out)


class ToolService:
    """The driver's side of the tool pool (see the module docstring)."""

    def __init__(self, cfg: ToolConfig, workers: list, submit: Callable, call_after: Callable,
                 spawn: Callable[[], Any] = spawn_tool_worker, log: Callable[[str, dict], None] | None = None) -> None:
        self.cfg = cfg
        self.workers = workers  # shared with the actor pool: a replacement takes the dead one's slot
        self._submit, self._after, self._spawn = submit, call_after, spawn
        self._log = log or (lambda kind, info: None)
        self._queue: deque[_Call] = deque()
        self._busy: dict[int, int] = {}  # worker slot -> attempts in flight
        self._ready: set[int] = set()  # slots whose worker answered its ping: a start never eats a call's timeout
        self.inflight = 0
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "retries": 0, "replaced": 0}
        for slot in range(cfg.workers):
            if slot == len(self.workers):
                self.workers.append(spawn())
            self._probe(slot)

    def _probe(self, slot: int) -> None:
        worker = self.workers[slot]

        def up(_v, err) -> None:
            if self.workers[slot] is not worker:
                return
            if err is not None:  # it died before serving: another one
                self._replace(slot)
                return
            self._ready.add(slot)
            self._pump()

        self._submit(worker.ping.remote(), up)

    def _replace(self, slot: int) -> None:
        self._ready.discard(slot)
        self.workers[slot] = self._spawn()
        self.counts["replaced"] += 1
        self._log("tool_worker_replaced", {"slot": slot})
        self._probe(slot)

    def call(self, call, done: Callable[[Any], None]) -> None:
        """Run `call`; `done(result)` gets its output or a ToolError."""
        self.counts["calls"] += 1
        self._queue.append(_Call(call, done))
        self._pump()

    def _pump(self) -> None:
        while self._queue and self._ready and self.inflight < self.cfg.max_inflight:
            self._attempt(self._queue.popleft())

    def _attempt(self, c: _Call) -> None:
        slot = min(self._ready, key=lambda s: (self._busy.get(s, 0), s))
        worker = self.workers[slot]
        c.ref, c.worker, c.over = worker.call.remote(c.call), worker, False
        self.inflight += 1
        self._busy[slot] = self._busy.get(slot, 0) + 1
        ref = c.ref
        self._submit(ref, lambda val, err: self._answered(c, ref, slot, val, err))
        self._after(self.cfg.timeout_s, lambda: self._timed_out(c, ref, slot))

    def _release(self, c: _Call, slot: int) -> None:
        c.over = True
        self.inflight -= 1
        self._busy[slot] -= 1

    def _answered(self, c: _Call, ref, slot: int, val, err) -> None:
        if c.ref is not ref or c.over:
            return  # an attempt that timed out answered late
        self._release(c, slot)
        if isinstance(err, ray.exceptions.RayActorError):
            if self.workers[slot] is c.worker:
                self._replace(slot)
            self._retry_or_fail(c, f"tool worker lost ({type(err).__name__})")
        elif err is not None:
            cause = getattr(err, "cause", None) or err
            lines = [ln for ln in str(cause).strip().splitlines() if ln.strip()]
            self._fail(c, f"{type(cause).__name__}: {lines[-1] if lines else ''}"[:300])
        else:
            c.done(val)
        self._pump()

    def _timed_out(self, c: _Call, ref, slot: int) -> None:
        if c.ref is not ref or c.over:
            return
        self._release(c, slot)
        self.counts["timeouts"] += 1
        try:
            ray.cancel(ref)
        except Exception:  # noqa: BLE001 - already finished or its worker gone: nothing to cancel
            pass
        self._retry_or_fail(c, f"tool call timed out after {self.cfg.timeout_s:g}s")
        self._pump()

    def _retry_or_fail(self, c: _Call, why: str) -> None:
        if c.attempt < self.cfg.retries:
            c.attempt += 1
            self.counts["retries"] += 1
            self._queue.appendleft(c)
        else:
            self._fail(c, f"{why} (attempt {c.attempt + 1} of {self.cfg.retries + 1})")

    def _fail(self, c: _Call, message: str) -> None:
        self.counts["errors"] += 1
        self._log("tool_error", {"message": message})
        c.done(ToolError(message))
