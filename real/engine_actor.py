"""The engine actor contract: what the real backend calls on an inference engine, and nothing more.

Why exactly this surface: the backend (gyre.real.backend, gyre.real.flow, gyre.real.weights) drives an
engine through a role switch (`wake` / `sleep`), a weight update in place (`load_weights` from the object
store, `receive_weights` from a broadcast over a standalone group), one generation request per segment
(`generate`) and its cancellation when the request moves to another engine (`cancel`), a hint that a sequence's cached KV may go (`release`), its timing profile for calibration
(`get_profile`), a liveness probe (`ping`) and a clean end of its processes (`shutdown`). Both engines,
gyre.real.engine_torch.TorchEngine and gyre.real.engine_vllm.VllmEngine, implement it; a test checks
each class against it, signature by signature.

Every method runs inside a Ray actor; coroutine methods run on the actor's event loop, so a weight load
lands between two decode steps. Seconds returned are wall-clock seconds spent in the call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable


@runtime_checkable
class EngineActor(Protocol):
    version: int  # policy version of the served weights (-1: none loaded yet)

    async def wake(self, weights: Mapping | None, version: int) -> float:
        """Start serving; load `weights` if given (None: they follow by `receive_weights`)."""
        ...

    async def sleep(self) -> float:
        """Stop serving and free what a role switch frees; refused while requests are in flight."""
        ...

    async def load_weights(self, weights: Mapping, version: int) -> float:
        """Replace the served weights in place with a state dict."""
        ...

    async def receive_weights(self, group: dict, version: int) -> float:
        """Replace the served weights in place with a broadcast from the sender of `group`."""
        ...

    async def release(self, seq_id: str) -> None:
        """The sequence will not be continued here: its cached KV may be dropped."""
        ...

    async def cancel(self, seq_id: str) -> bool:
        """Abandon the sequence's request in flight (its `generate` returns {"cancelled": True}); False: none."""
        ...

    async def generate(self, seq_id: str, context: list[int], max_new: int, stop: list[int], seed: int) -> dict:
        """Sample up to `max_new` tokens after `context`, stopping after a token in `stop`.

        Returns {"tokens", "logprobs", "version" (the oldest version that produced a token),
        "prefill_tokens", "prefill_s"}."""
        ...

    def get_profile(self) -> dict:
        """{"prefill": [(tokens, s)], "decode": [(batch, kv_tokens, s)], "load": [(s,)]} since the last call."""
        ...

    def ping(self) -> int:
        """The served version (a liveness probe)."""
        ...

    def shutdown(self) -> None:
        """Stop the engine's own processes and free its memory; the actor may then be killed."""
        ...
