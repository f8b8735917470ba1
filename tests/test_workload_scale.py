"""A group's `scale` is the scale its turn counts were drawn at: the task's difficulty times the step's growth."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from gyre.presets import get_preset
from gyre.workload import LogNormal, sample_group


@dataclass(frozen=True, kw_only=True)
class Recording(LogNormal):
    """LogNormal that records the scale of every draw."""

    seen: list

    def sample(self, rng, size, scale=1.0):
        self.seen.append(scale)
        return super().sample(rng, size, scale)


@pytest.mark.parametrize("preset", ["xlong-swe-kv", "xlong-swe-epochs"])
def test_group_scale_is_the_turn_draws_scale(preset):
    w = get_preset(preset).workload
    seen: list = []
    w = replace(w, turns=Recording(median=w.turns.median, p99_ratio=w.turns.p99_ratio, seen=seen))
    groups = [sample_group(w, gid, step, seed=3) for gid, step in [(0, 0), (5, 0), (40, 1), (200, 6)]]
    assert [g.scale for g in groups] == seen
    assert len(set(seen)) == 4  # each group its own difficulty


def test_group_scale_grows_with_the_step_at_the_drift():
    """The same group drawn at step 0 and step 10 (one difficulty draw): the scale grows by (1 + drift)^10."""
    w = get_preset("xlong-swe-kv").workload
    assert w.drift_per_step > 0
    a, b = sample_group(w, 7, 0, seed=1), sample_group(w, 7, 10, seed=1)
    assert b.scale / a.scale == pytest.approx((1 + w.drift_per_step) ** 10, rel=1e-12)
    assert sum(map(len, (e.gen for e in b.executions))) > sum(map(len, (e.gen for e in a.executions)))
