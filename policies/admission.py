"""Ordered admission: within each window of groups drawn ahead, admit the longest-predicted first.

The staleness bound decides *when* a group may be admitted (policies.common.Batcher); this decides
*which*. The component draws the next `lookahead` steps' worth of groups from the cluster once the
previous window is all admitted (never more than the run must train, so a run trains exactly the groups
it would in drawn order) and hands the Batcher, each time, the group of the window its predictor
(policies.foresight) now scores longest; predictions are re-read at every pick, so what the run learns
while a window drains reorders the rest of it. Ties, and every group under the `none` predictor, go in
drawn order; with `none` nothing is drawn ahead, so the Batcher sees the cluster's groups exactly as
without this component. With a lookahead of the whole run it is a full sort by prediction.

Why windows, longest first: a group admitted at version a must be trained by step a + eta, so a long
rollout holds back the steps that follow it. Admitting a window's long groups together lets their
latencies overlap, one stall per window instead of one per eta + 1 steps (the oracle orders measured in
experiments/LOG.md, 2026-11-30, sorted the same way by true duration: within windows of h steps, or the
whole run; `git show f89bc94:experiments/elastic_vs_baselines/oracle.py`). Admitting a long group early without company gains nothing: its deadline
moves with it. A wrong prediction costs only order: every group of a window is admitted before the next
window is drawn.

Observations: the component registers each admitted group with the predictor and each execution's
finish (its turns) on the execution's handle; `Quality` gets the prediction at admission and the
observed longest turns when the group completes. `report` writes the run's quality as a "foresight"
note in the event log.

Async builds its Batcher with one (`ForesightParams` are its parameters); elastic admits in drawn order
(its predictor measured as no gain: experiments/LOG.md, 2026-12-05).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gyre.cluster import Cluster, Group
from gyre.handles import Handle
from gyre.policies.foresight import PREDICTORS, Quality, make_predictor


@dataclass(frozen=True, kw_only=True)
class ForesightParams:
    """The parameters of ordered admission (policies.async_split)."""

    predictor: str = "none"  # policies.foresight.PREDICTORS
    lookahead: int = 4  # steps' worth of groups per window drawn ahead of admission (with a predictor other than none)

    def __post_init__(self) -> None:
        if self.predictor not in PREDICTORS:
            raise ValueError(f"unknown predictor {self.predictor!r}; known: {', '.join(PREDICTORS)}")
        if self.lookahead < 1:
            raise ValueError(f"lookahead must be >= 1 step, got {self.lookahead}")


class OrderedAdmission:
    """Hands out groups for admission, longest-predicted first within each window drawn ahead."""

    def __init__(self, cluster: Cluster, steps: int, params: ForesightParams) -> None:
        self.cluster = cluster
        self.predictor = make_predictor(params.predictor)
        gps = cluster.groups_per_step
        self.window = 1 if params.predictor == "none" else params.lookahead * gps
        self.total = steps * gps  # the groups the run trains: never drawn past
        self.candidates: list[Group] = []  # drawn, not yet admitted, in drawn order
        self.drawn = 0
        self.quality = Quality()

    def next_group(self) -> Group:
        """The next group to admit (the caller admits every execution of it and calls `watch`)."""
        if not self.candidates:  # the next window (past the run's groups only if asked for one)
            self.candidates = [self.cluster.next_group()]
            while len(self.candidates) < self.window and self.drawn + len(self.candidates) < self.total:
                self.candidates.append(self.cluster.next_group())
            self.drawn += len(self.candidates)
        scores = [self.predictor.group(g) for g in self.candidates]
        best = max(range(len(self.candidates)), key=lambda i: (scores[i], -i))
        g = self.candidates.pop(best)
        self.predictor.admitted(g)
        self.quality.predicted(g.id, scores[best])
        return g

    def watch(self, group: Group, handles: Sequence[Handle]) -> None:
        """Observe each execution's finish; the group's longest turns once all have finished."""
        left = [len(handles)]
        longest = [0]

        def one(h: Handle) -> None:
            if h.error is not None:
                return
            x = h.value
            self.predictor.finished(group.id, x)
            longest[0] = max(longest[0], x.turns_done + 1)
            left[0] -= 1
            if left[0] == 0:
                self.quality.observed(group.id, longest[0])

        for h in handles:
            h.on_done(one)

    def report(self) -> None:
        """The run's prediction quality, as a "foresight" note in the event log (none with no predictor)."""
        if self.predictor.name != "none":
            self.cluster.note("foresight", predictor=self.predictor.name, **self.quality.summary())
