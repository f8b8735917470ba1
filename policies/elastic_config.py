"""Elastic's configuration (policies.elastic): six fields, each with its reason and its range."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    # >= 0. The staleness bound: the learning algorithm's choice, not the scheduler's.
    eta: int = 1
    # (0, 1]. A staying engine takes migrants while its KV stays below this share of capacity: a live context
    # about doubles before it ends (its expected remaining length equals its length so far).
    kv_fill: float = 0.5
    # (0, inf). An execution longer than every finished one expects this many times its segments so far still
    # to come: the mean residual life of a heavy (Pareto, index 2) tail grows as its age.
    unseen_residual: float = 1.0
    # (0, 1]. A decoding execution asked to move is this share of a segment from its next tool call
    # (uniformly far into its current segment).
    boundary_share: float = 0.5
    # (0, 1]. An engine whose live executions fall below this share of the most it has carried is consolidated:
    # a quarter of a full engine re-prefills little and leaves the targets most of their KV.
    load_share: float = 0.25
    # >= 1, or None (the engine's admission limit). The most executions an engine is handed. Not derived: which
    # concurrency lets a length tail meet its deadline depends on how much each added sequence slows a step,
    # which the estimate does not give; like async's, the equal-work search chooses it (`Elastic.grid`).
    max_running: int | None = None

    def __post_init__(self) -> None:
        if self.eta < 0:
            raise ValueError(f"elastic: eta must be >= 0, got {self.eta}")
        for name in ("kv_fill", "boundary_share", "load_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"elastic: {name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 < self.unseen_residual < float("inf"):
            raise ValueError(f"elastic: unseen_residual must be a positive number, got {self.unseen_residual}")
        m = self.max_running
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"elastic: max_running must be an integer >= 1, got {m!r}")
