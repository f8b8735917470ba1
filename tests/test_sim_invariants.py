"""Invariants over many random workloads: GPUs conserved at every event (SimCluster.check_invariants runs
after each one), every admitted execution finishes exactly once, staleness within eta (rebuilt from the log:
tests/logcheck.py), lower bound holds."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.policies import REGISTRY, takes
from gyre.sim.harness.runner import simulate
from tests.logcheck import check_staleness
from tests.simkit import tiny_config


def _check_run(r, eta: int | None) -> None:
    log = r.log
    admitted = [rec[2] for rec in log if rec[0] == "admit"]
    finished = Counter(rec[2] for rec in log if rec[0] == "finish")
    trained = Counter(rec[2] for rec in log if rec[0] == "trained")
    assert len(admitted) == len(set(admitted)), "an execution was admitted twice (restarted)"
    assert set(finished) == set(admitted), "an admitted execution never finished (lost)"
    assert all(n == 1 for n in finished.values()), f"finished more than once: {finished.most_common(1)}"
    assert all(n == 1 for n in trained.values()), "an execution was trained twice"
    assert set(trained) == set(admitted), "an admitted execution was never trained"
    if eta is not None:
        check_staleness(log, eta, exact=False)
    steps = [rec[2] for rec in log if rec[0] == "step"]
    assert steps == list(range(1, r.config.steps + 1)), f"versions out of order: {steps}"
    assert r.makespan_s >= r.bound.makespan_s * (1 - 1e-9), (r.makespan_s, r.bound)


@pytest.mark.invariants
@given(seed=st.integers(0, 10_000), gpus=st.sampled_from([4, 6, 8]), eta=st.integers(0, 3),
       kind=st.sampled_from(["xlong", "math"]), name=st.sampled_from(sorted(REGISTRY)))
def test_every_policy_keeps_invariants(seed, gpus, eta, kind, name):
    """Every registered policy conserves GPUs, loses no execution and respects eta on random workloads."""
    cfg = tiny_config(gpus=gpus, seed=seed, workload_name=kind)
    bounded = takes(name, "eta")  # a policy without a staleness bound is on-policy
    r = simulate(cfg, name, {"eta": eta} if bounded else {}, check=True)
    _check_run(r, eta if bounded else 0)


def test_same_seed_same_log_and_different_seed_differs():
    """Determinism: the same seed gives an identical event log; another seed gives another."""
    cfg = tiny_config(seed=7)
    for name in REGISTRY:
        params = {"eta": 1} if takes(name, "eta") else {}
        a = simulate(cfg, name, params).log
        b = simulate(cfg, name, params).log
        assert a == b, f"{name}: same seed produced different logs"
    c = simulate(tiny_config(seed=8), "colocate").log
    assert c != simulate(cfg, "colocate").log, "different seeds produced identical logs"
