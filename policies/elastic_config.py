"""Elastic's configuration: every threshold of the controller (policies.elastic), each with its reason."""

from __future__ import annotations

from dataclasses import dataclass

from gyre.policies.admission import ForesightParams


@dataclass(frozen=True, kw_only=True)
class ElasticConfig(ForesightParams):
    eta: int = 1  # staleness bound: the learning algorithm's choice
    # a staying engine is filled by migrants to at most this share of its KV: a live context about doubles
    # before it ends (its expected remaining length equals its length so far, as `unseen_residual` assumes)
    kv_fill: float = 0.5
    # an execution longer than every finished one expects this many times its segments so far still to
    # come: the mean residual life of a heavy (Pareto, index 2) tail grows as its age
    unseen_residual: float = 1.0
    # a decoding execution asked to move is expected this share of a segment from its next tool call
    # (uniformly far into its current segment)
    boundary_share: float = 0.5
    # an engine holding less than this share of the most executions it held is consolidated onto others:
    # a quarter of a full engine's load re-prefills little and leaves the targets most of their room
    load_share: float = 0.25
    # a trainer size may be expected to cut this share of a step's executions more than the least-cutting
    # size: equal work allows 1% of a run's executions (DESIGN.md), one decision per step spends 1% of a step's
    cut_share: float = 0.01
    # executions an engine is handed at once, at most (None: its admission limit). Not derived: which
    # concurrency lets a rollout's length tail meet its deadline depends on how much each added sequence
    # slows an engine's step (the chunked prefill of tool outputs included), which the estimate does not
    # give; like async's `max_running`, it is a choice the equal-work search makes (`grid`: the limit and
    # its halvings at each eta, every one tried, the fastest within 1% of the least-cutting one kept)
    max_running: int | None = None
    # the deadline cap protects each live execution's remaining segments up to this quantile level of their
    # conditional distribution (None: their expected number). 1 - cut_share: an execution the cap protects
    # then runs past its predicted remaining length with probability cut_share, the cut equal work allows
    protect_level: float | None = None
    # placement by age (policies.elastic_tiers): ((age_s, n), ...), ages ascending from 0, n descending: an
    # engine holding an execution that has run age_s seconds runs at most n sequences, and an execution over
    # its tier moves to an engine within it. None: one concurrency (`max_running`) for every execution. Not
    # derived, like `max_running` (which ages the long tail reaches depends on the workload's lengths and
    # deadline), and not in `grid`: on xlong-swe-kv they sit on the uniform cap's frontier (README)
    tiers: tuple[tuple[float, int], ...] | None = None
    # where no trainer size's migrants fit and parking does not pay, admission holds until they fit (policies.
    # elastic, 1.); False: it goes on while the batch waits. Holding pays where the staleness bound would keep
    # admitting for many steps (xlong-swe-kv, 48 steps) and costs where admission stops soon anyway (6 steps at
    # eta 4): experiments/elastic_vs_baselines/README.md
    hold: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eta < 0:
            raise ValueError(f"elastic: eta must be >= 0, got {self.eta}")
        for name in ("kv_fill", "boundary_share", "load_share", "cut_share"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"elastic: {name} must be in (0, 1], got {v}")
        if self.max_running is not None and (isinstance(self.max_running, bool) or not isinstance(self.max_running, int)
                                             or self.max_running < 1):
            raise ValueError(f"elastic: max_running must be an integer >= 1, got {self.max_running!r}")
        if self.protect_level is not None and not 0 < self.protect_level < 1:
            raise ValueError(f"elastic: protect_level must be in (0, 1), got {self.protect_level}")
        t = self.tiers
        if t is not None and (not t or t[0][0] != 0 or any(n < 1 for _, n in t)
                              or any(b[0] <= a[0] or b[1] > a[1] for a, b in zip(t, t[1:]))):
            raise ValueError(f"elastic: tiers must start at age 0, ages ascending, n >= 1 descending, got {t!r}")
        if not isinstance(self.hold, bool):
            raise ValueError(f"elastic: hold must be true or false, got {self.hold!r}")
        if not 0 < self.unseen_residual < float("inf"):
            raise ValueError(f"elastic: unseen_residual must be a positive number, got {self.unseen_residual}")
