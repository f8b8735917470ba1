"""The simulated cluster's invariants, asserted between events when a run is checked (SimCluster(check=True)).

What it checks: GPUs conserved (one role and at most one owner each), executions in exactly one place, and
each engine's KV books (gyre.sim.cluster.kv_ledger) against its members: decode count, resident context,
pending prefill, the state holders of a hybrid model, and capacity. It reads every owner's state and writes
none, so it lives apart from all of them; the log-only checks (tests/test_log_invariants.py) trust even less.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from gyre.cluster import Phase, Role
from gyre.gpu_roles import TRAINER

if TYPE_CHECKING:
    from gyre.sim.cluster.backend import SimCluster
    from gyre.sim.cluster.engine import SimEngine


def check_cluster(c: SimCluster, engines: Iterable[SimEngine]) -> None:
    """GPUs conserved (one role and at most one owner each); executions in exactly one place; the KV books of
    each of `engines` (every engine holding GPUs, stopping ones included) match the members they count."""
    seen: dict[int, int] = {}
    for e in engines:
        for g in e.gpus:
            assert c.gpu_roles.owner[g] == e.id, f"GPU {g} owner {c.gpu_roles.owner[g]} != engine {e.id}"
        books = e.kv
        assert books.n_dec == sum(1 for x in e.members.values() if x.phase == Phase.DECODE), "n_dec drift"
        assert books.n_dec == len(e.batch), "heap size != decoding count"
        assert books.n_dec + len(e.prefill) <= (c.costs.max_num_seqs or books.n_dec + len(e.prefill)), \
            f"engine {e.id} runs {books.n_dec + len(e.prefill)} > max_num_seqs {c.costs.max_num_seqs}"
        assert books.mem_fixed >= -1e-6, f"engine {e.id} negative memory"
        assert e.kv_used <= c.costs.kv_capacity_tokens * (1 + 1e-12), f"engine {e.id} KV over capacity"
        held = sum(x.resident for x in e.members.values() if x.phase != Phase.DECODE)
        assert abs(held - books.mem_fixed) <= 1e-6 * (1 + held), f"engine {e.id} KV accounting {held} != {books.mem_fixed}"
        if c.costs.state_tokens:  # counted from the members, not from the engine's sums
            v = e.V + (c.now - e.t_last) * e.rate
            kv = sum(x.ctx + v - x.v_start if x.phase == Phase.DECODE else x.resident for x in e.members.values())
            holders = sum(1 for x in e.members.values() if x.phase == Phase.DECODE or x.resident > 0)
            assert holders == books.holders, f"engine {e.id} counts {books.holders} state holders, its members {holders}"
            total = kv + holders * c.costs.state_tokens
            assert total <= c.costs.kv_capacity_tokens * (1 + 1e-9), \
                f"engine {e.id} KV {kv:,.0f} + {holders} states over capacity {c.costs.kv_capacity_tokens:,}"
        pending = sum(x.pf_left for x in e.prefill)
        assert abs(pending - books.pf_pending) <= 1e-6 * (1 + pending), f"engine {e.id} prefill {pending} != {books.pf_pending}"
        for x in e.members.values():
            assert x.engine is e and x.phase != Phase.DONE, f"{x} misplaced"
            assert x.id not in seen, f"exec {x.id} on two engines"
            seen[x.id] = e.id
    for g in range(c.gpu_roles.n):
        o = c.gpu_roles.owner[g]
        if o is None:
            assert c.gpu_roles.role[g] in (Role.IDLE, Role.SWITCHING), f"GPU {g} unowned but {c.gpu_roles.role[g].name}"
        elif o == TRAINER:  # IDLE: a cell of an open streaming step waiting for a micro-step
            ok = (Role.TRAIN, Role.SWITCHING, Role.IDLE) if c.training is not None else (Role.TRAIN, Role.SWITCHING)
            assert c.gpu_roles.role[g] in ok, f"GPU {g} training but {c.gpu_roles.role[g].name}"
        else:
            assert c.gpu_roles.role[g] in (Role.ROLLOUT, Role.SWITCHING), f"GPU {g} engine but {c.gpu_roles.role[g].name}"
