"""The driver's view of one engine actor: what a policy observes (EngineView) and what the backend tracks.

What it models: an engine's membership and load are bookkept on the driver, from the requests it
sent and the results it received, so a policy reads them without a remote call (and the same inputs
give the same observations). KV use is the summed context of the executions it holds; admission waits
in `queue` while the KV budget is full, as an engine's scheduler would.

Simplifications: the KV budget is in tokens (the driver's count, not the engine's allocator).
"""

from __future__ import annotations

from collections import deque

from gyre.engine_lifecycle import EngineLifecycle
from gyre.cluster import Phase


class RealEngine(EngineLifecycle):
    """One engine actor as the driver books it (its lifecycle and served version: EngineLifecycle)."""

    def __init__(self, engine_id: int, gpus: tuple[int, ...], actor, version: int, kv_capacity: int,
                 admit_limit: int) -> None:
        super().__init__(version)
        self.id = engine_id
        self.gpus = gpus
        self.actor = actor
        self.members: dict[int, object] = {}  # execution id -> RealExecution (any phase but DONE)
        self.queue: deque = deque()
        self._kv_capacity = kv_capacity
        self._limit = admit_limit  # gyre.hardware.admission_limit of its KV and the task's window
        self.busy = False  # has a decoding sequence (the "busy" log record)
        self.stop_after_restart = None  # a stop_engine handle waiting for a restart to finish
        self.fault_t = 0.0  # when its actor was last found dead

    @property
    def n_live(self) -> int:
        return len(self.members)

    @property
    def n_decoding(self) -> int:
        return sum(1 for x in self.members.values() if x.phase == Phase.DECODE)

    @property
    def n_queued(self) -> int:
        return len(self.queue)

    @property
    def kv_used(self) -> float:
        return float(sum(x.context_tokens for x in self.members.values() if x.phase != Phase.QUEUED))

    @property
    def kv_capacity(self) -> int:
        return self._kv_capacity

    @property
    def admit_limit(self) -> int:
        return self._limit

    def fits(self, tokens: int) -> bool:
        if self.n_live == len(self.queue):  # nothing running: always take one
            return True
        return self.kv_used + tokens <= self._kv_capacity

    def __repr__(self) -> str:
        return f"<real engine {self.id} {self.state.value} gpus={self.gpus} live={self.n_live}>"
