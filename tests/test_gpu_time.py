"""gyre.gpu_time: a run's GPU-time split into terms, checked against hand timelines and against the log."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.config import override
from gyre.gpu_time import TERMS, counts, decompose
from gyre.hardware import Coefficients, CostConfig
from gyre.policies import make_policy
from gyre.sim.harness.runner import simulate
from tests.simkit import cluster, spec, tiny_config
from tests.test_sim_timeline import group


def _total(terms: dict[str, float]) -> float:
    return sum(terms[k] for k in TERMS)


def test_colocate_hand_timeline_terms():
    """On the hand-checked colocate timeline (tests/test_sim_timeline.py) every term is what the timeline says."""
    a = spec(0, 0, gen=[100, 50], tool_s=[1.0])  # engine 0: decode 3-4 s, tool 4-5 s, decode 5-5.5 s, empty 5.5-6 s
    b = spec(1, 0, gen=[300])  # engine 1: decode 3-6 s
    c = cluster([group(0, a, b)], n_gpus=2, groups_per_step=1)
    c.run(make_policy("colocate"), steps=1)
    got = decompose(c.log, 2, sync_s=1.0)
    # switching: wake + sync 0-3 s, sleep 6-7 s, onload 7-7.5 s on both GPUs = 2 x 4.5; train 7.5-10.25 s x 2
    want = {"rollout_decoding": 1.5 + 3.0, "rollout_thin": 0.0, "weight_sync": 0.0, "kv_reprefill": 0.0, "request_discarded": 0.0,
            "rollout_waiting": 1.0, "rollout_empty": 0.5, "train": 5.5, "switching": 9.0, "idle_first_batch": 0.0,
            "idle": 0.0}
    assert got == pytest.approx(want, abs=1e-9), got
    assert _total(got) == pytest.approx(2 * 10.25, abs=1e-9), "terms do not add up to GPUs x makespan"
    # each engine holds one execution: thin when a full engine holds 4 (1 < 4 / 2), not when it holds 2
    thin = decompose(c.log, 2, sync_s=1.0, full_at=4)
    assert (thin["rollout_thin"], thin["rollout_decoding"]) == pytest.approx((4.5, 0.0)), thin
    assert decompose(c.log, 2, sync_s=1.0, full_at=2) == pytest.approx(want, abs=1e-9)


def test_async_hand_timeline_sync_and_idle():
    """Async with one rollout GPU and one trainer GPU: the trainer waits idle for its batches, the engine sits
    empty while it trains, and each weight sync is sync_s of the engine's GPU (the last one ends after the run)."""
    a = spec(0, 0, gen=[200])  # both decode 3-5 s on engine 0 (100 tokens/s each)
    b = spec(1, 1, gen=[200])
    c = cluster([group(0, a), group(1, b)], n_gpus=2, groups_per_step=1)
    c.run(make_policy("async", rollout_gpus=1, eta=1), steps=2)
    got = decompose(c.log, 2, sync_s=1.0)
    # GPU 0: wake + sync 0-3 s, decoding 3-5 s, empty 5-8.5 s, sync 8.5-9.5 s, empty 9.5-12.5 s (the sync ending
    # at 13.5 s lies after the last step). GPU 1: idle 0-5 s, onload 5-5.5 s, train 5.5-8.5 s (300 tokens x
    # 0.01 s), idle 8.5-9.5 s (the second group is trained after the sync), train 9.5-12.5 s.
    want = {"rollout_decoding": 2.0, "rollout_thin": 0.0, "weight_sync": 1.0, "kv_reprefill": 0.0, "request_discarded": 0.0,
            "rollout_waiting": 0.0, "rollout_empty": 3.5 + 3.0, "train": 6.0, "switching": 3.0 + 0.5,
            "idle_first_batch": 5.0, "idle": 1.0}
    assert got == pytest.approx(want, abs=1e-9), got
    assert _total(got) == pytest.approx(2 * 12.5, abs=1e-9), "terms do not add up to GPUs x makespan"


def _tight(cfg, util: float):
    """dense-7b on one H200 with `util` of its HBM for vLLM (KV of a few hundred tokens: contexts overflow)."""
    return replace(cfg, cluster=replace(cfg.cluster, cost=CostConfig(engine=Coefficients(gpu_memory_utilization=util))))


@pytest.mark.parametrize("policy", ["colocate", "async", "elastic"])
def test_kv_pressure_run_adds_up(policy):
    """A run whose contexts overflow KV: the terms add up to GPUs x makespan, the re-prefill term is the log's
    preemption GPU-seconds, and the role terms equal gyre.metrics' role accounting."""
    cfg = tiny_config(gpus=4, seed=1, groups_per_step=10, group_size=4)
    cfg = override(cfg, **{"workload.deadline_s": float("inf")})
    cfg = _tight(cfg, 0.1256)
    r = simulate(cfg, policy, {} if policy == "colocate" else {"eta": 2})
    got = decompose(r.log, cfg.cluster.gpus, r.costs.sync_s, full_at=4)
    assert _total(got) == pytest.approx(cfg.cluster.gpus * r.makespan_s, rel=1e-12), got
    preempt = sum(x[5] for x in r.log if x[0] == "preempt")
    assert preempt > 0 or policy == "elastic", f"{policy} never preempted: the scenario lost its KV pressure"
    assert got["kv_reprefill"] == pytest.approx(min(preempt, got["kv_reprefill"] + got["rollout_decoding"])), got
    gs = r.metrics.gpu_seconds
    got_idle = dict(got, idle=got["idle"] + got["idle_first_batch"])
    for term in ("train", "switching", "idle"):
        assert got_idle[term] == pytest.approx(gs[term], abs=1e-6), (term, got_idle[term], gs[term])
    rollout = sum(got[k] for k in TERMS if k not in ("train", "switching", "idle", "idle_first_batch"))
    assert rollout == pytest.approx(gs["rollout_busy"] + gs["rollout_idle"], abs=1e-6), (rollout, gs)


@pytest.mark.invariants
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), gpus=st.sampled_from([4, 6, 8]),
       policy=st.sampled_from(["colocate", "async", "elastic"]), eta=st.integers(0, 3))
def test_terms_add_up_on_random_runs(seed, gpus, policy, eta):
    """On random tiny runs under every policy each term is >= 0 and the terms add up to GPUs x makespan."""
    cfg = tiny_config(gpus=gpus, seed=seed, steps=2)
    r = simulate(cfg, policy, {} if policy == "colocate" else {"eta": eta})
    got = decompose(r.log, gpus, r.costs.sync_s, full_at=3)
    assert all(v >= -1e-9 for v in got.values()), got
    assert _total(got) == pytest.approx(gpus * r.makespan_s, rel=1e-12), (got, r.makespan_s)
    assert counts(r.log)["migrate"] == r.metrics.migrations


def test_rollout_outside_engine_lives_is_refused():
    """A log whose rollout role time lies outside any engine's life is refused with one clear message."""
    log = [("role", 0.0, (0,), 1), ("step", 5.0, 1, 1, 10)]  # rollout for 5 s, no engine ever up
    with pytest.raises(ValueError, match="outside one engine life"):
        decompose(log, 1, sync_s=0.0)
