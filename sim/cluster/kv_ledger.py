"""One simulated engine's KV books: the only writer of its KV counters and of its members' resident context.

What it models: KV in use on an engine is the resident context of its non-decoding members (`mem_fixed`), the
growing contexts of its decodes (`kv_dec_base + n_dec * V`, V the engine's token clock), and, for a hybrid
linear-attention model, one fixed state (`st` KV-token units) per member that holds KV (`holders`: decoding, or
with a resident context; a cached context is resumable only with the state at its end). The prefill queue's
reserved KV (`pf_resident`) and tokens still to compute (`pf_pending`) are kept beside it, and in reservation
mode the members' largest contexts (`reserved`).

Every change to those counters, and to an execution's `resident`, `pf_left`, `reserved` and `holds`, is one of
the methods below; the engine's event loop (gyre.sim.cluster.engine), KV pressure (gyre.sim.cluster.kv_pressure:
preemption, eviction), migrations and crashes (gyre.sim.cluster.engine_moves) call them. Each method does the same float
operations, in the same order, as the code it replaced, so a run's numbers do not move.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyre.sim.cluster.execution import SimExecution


class KvLedger:
    __slots__ = ("mem_fixed", "n_dec", "kv_dec_base", "pf_pending", "pf_resident", "reserved", "holders", "st")

    def __init__(self, state_tokens: float) -> None:
        self.st = state_tokens  # a KV holder's linear-attention state, in KV tokens (0: none)
        self.clear()

    def clear(self) -> None:
        """Nothing held (a new engine, or one whose process died)."""
        self.n_dec = 0
        self.holders = 0  # members holding KV (decoding, or a resident context)
        self.kv_dec_base = self.mem_fixed = self.reserved = self.pf_pending = self.pf_resident = 0.0

    # --- reads ---
    def states(self) -> float:
        """KV of the holders' linear-attention states (0 without them)."""
        return self.st * self.holders if self.st else 0.0

    def used(self, V: float) -> float:
        """KV in use at token clock V."""
        return self.mem_fixed + self.kv_dec_base + self.n_dec * V + (self.st * self.holders if self.st else 0.0)

    def _mark(self, ex: SimExecution, holds: bool) -> None:
        if holds != ex.holds:
            ex.holds = holds
            self.holders += 1 if holds else -1

    # --- the decode batch ---
    def join_decode(self, ex: SimExecution, V: float) -> None:
        """Its context is all in KV: it decodes from clock V, its context growing with the batch's."""
        self.mem_fixed -= ex.resident
        ex.resident = 0
        self.n_dec += 1
        self.kv_dec_base += ex.ctx - V
        if not ex.holds:  # _mark(ex, True), inline on this hot path
            ex.holds = True
            self.holders += 1

    def leave_decode(self, ex: SimExecution) -> None:
        """It leaves the decode batch (its segment ended, or it is preempted): its growing context goes."""
        self.n_dec -= 1
        self.kv_dec_base -= ex.ctx - ex.v_start
        self._mark(ex, False)

    def end_turn(self, ex: SimExecution, ctx: int) -> None:
        """leave_decode, then cache(ex, ctx): its segment ended and `ctx` tokens of its context stay resident
        between turns (the wakeup's common case, in one call)."""
        self.n_dec -= 1
        self.kv_dec_base -= ex.ctx - ex.v_start
        ex.resident = ctx
        self.mem_fixed += ctx
        h = ctx > 0  # _mark(ex, False), then _mark(ex, h)
        if h != ex.holds:
            ex.holds = h
            self.holders += 1 if h else -1

    # --- resident contexts ---
    def cache(self, ex: SimExecution, ctx: int) -> None:
        """A segment ended: its whole context (`ctx` tokens) stays resident between turns."""
        ex.resident = ctx
        self.mem_fixed += ctx
        self._mark(ex, ctx > 0)

    def shrink(self, ex: SimExecution, keep: int) -> None:
        """Its next context is rebuilt smaller: only the first `keep` tokens of its resident context stay."""
        self.mem_fixed -= ex.resident - keep
        ex.resident = keep
        self._mark(ex, keep > 0)

    def load(self, ex: SimExecution, need: float) -> None:
        """It leaves the wait queue: the `need` tokens of its context not yet resident are reserved."""
        self.mem_fixed += need
        ex.resident = ex.ctx
        self._mark(ex, ex.resident > 0)

    def arrive(self, ex: SimExecution, tokens: int) -> None:
        """A migrated context arrives resident (`tokens` of it, transferred)."""
        ex.resident = tokens
        self.mem_fixed += tokens
        self._mark(ex, tokens > 0)

    def free(self, ex: SimExecution) -> None:
        """Its resident context (not decoding) is freed: it left, was preempted or evicted."""
        self.mem_fixed -= ex.resident
        ex.resident = 0
        self._mark(ex, False)

    # --- the prefill queue ---
    def load_prefill(self, ex: SimExecution, need: float) -> None:
        """load, then queue_prefill: it leaves the wait queue to prefill `need` tokens (drain's common case)."""
        self.mem_fixed += need
        ex.resident = r = ex.ctx
        if (r > 0) != ex.holds:  # _mark(ex, r > 0)
            ex.holds = r > 0
            self.holders += 1 if r > 0 else -1
        ex.pf_left = need
        self.pf_pending += need
        self.pf_resident += r

    def queue_prefill(self, ex: SimExecution, need: float) -> None:
        """It joins the prefill queue with `need` tokens to compute; its resident context is reserved for it."""
        ex.pf_left = need
        self.pf_pending += need
        self.pf_resident += ex.resident

    def prefill_progress(self, head: SimExecution, done: float) -> None:
        """The queue's head computed `done` more tokens."""
        head.pf_left = head.pf_left - done if head.pf_left > done else 0.0
        self.pf_pending = self.pf_pending - done if self.pf_pending > done else 0.0

    def prefill_due(self, head: SimExecution) -> None:
        """The queue's head is done at its planned time: what it has left (a residue below what the clock
        resolves) is dropped."""
        head.pf_left = 0.0

    def unprefill(self, ex: SimExecution) -> None:
        """It leaves the prefill queue (done, preempted or gone): what it had left is no longer pending."""
        self.pf_pending -= ex.pf_left
        self.pf_resident -= ex.resident
        ex.pf_left = 0.0

    def prefill_empty(self) -> None:
        """The prefill queue is empty: no float residue stays in its sums."""
        self.pf_pending = self.pf_resident = 0.0

    # --- reservation mode ---
    def reserve(self, ex: SimExecution, tokens: float) -> None:
        ex.reserved = tokens
        self.reserved += tokens

    def unreserve(self, ex: SimExecution) -> None:
        if ex.reserved:
            self.reserved -= ex.reserved
            ex.reserved = 0

    # --- a crash ---
    def wipe(self, members: list[SimExecution]) -> None:
        """The engine's process died: its members hold nothing, and neither does it."""
        for ex in members:
            ex.resident = ex.reserved = 0
            ex.pf_left = 0.0
            ex.holds = False
        self.clear()
