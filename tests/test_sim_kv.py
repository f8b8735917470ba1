"""KV memory is a hard limit: on workloads whose contexts overflow the engines many times over, no engine
ever holds more KV than it has (SimCluster.check_invariants asserts it after every event), preemption
recomputes instead of losing work, and every execution still finishes exactly once."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.config import ConfigError, override
from gyre.hardware import CostConfig
from gyre.policies import REGISTRY
from gyre.roofline import Coefficients
from gyre.sim.runner import simulate
from tests.simkit import tiny_config


def _tight(cfg, util: float, reserve: bool):
    """dense-7b on one H200 with only `util` of its HBM for vLLM: 141 GB x util - 2 GB - 15.2 GB of weights."""
    cost = CostConfig(engine=Coefficients(gpu_memory_utilization=util), kv_reserve=reserve)
    return replace(cfg, cluster=replace(cfg.cluster, cost=cost))


def _check(r) -> None:
    log = r.log
    admitted = [rec[2] for rec in log if rec[0] == "admit"]
    finished = Counter(rec[2] for rec in log if rec[0] == "finish")
    assert len(admitted) == len(set(admitted)), "an execution was admitted twice"
    assert set(finished) == set(admitted) and all(n == 1 for n in finished.values()), "lost or finished twice"
    # nothing lost: every finished execution generated all its tokens (none of these hit a deadline)
    spec = {e.exec_id: e for g in r.groups for e in g.executions}
    for rec in log:
        if rec[0] == "finish" and rec[3] != 2:
            assert rec[4] == sum(spec[rec[2]].gen), f"exec {rec[2]}: {rec[4]} tokens of {sum(spec[rec[2]].gen)}"
    s = r.metrics.summary()
    assert s["kv_peak_frac"] <= 1.0, f"{r.policy}: KV peak {s['kv_peak_frac']}"
    assert s["preemptions"] == sum(1 for x in log if x[0] == "preempt")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), gpus=st.sampled_from([8, 10]), eta=st.integers(0, 2),
       util=st.floats(0.1256, 0.14), reserve=st.booleans())
def test_kv_never_overcommits_and_every_execution_completes(seed, gpus, eta, util, reserve):
    """Every registered policy, engines of 9-44K KV tokens and 9 executions of up to ~4K-token contexts each."""
    cfg = override(tiny_config(gpus=gpus, seed=seed, groups_per_step=3, group_size=3),
                   **{"workload.deadline_s": float("inf")})
    cfg = _tight(cfg, util, reserve)
    for name in REGISTRY:
        r = simulate(cfg, name, {} if name == "colocate" else {"eta": eta}, check=True)
        _check(r)


def test_contexts_overflow_and_preempt():
    """The tight configuration does overflow: without preemption some engine would exceed its KV."""
    cfg = override(tiny_config(gpus=8, seed=1, groups_per_step=4, group_size=4), **{"workload.deadline_s": float("inf")})
    cfg = _tight(cfg, 0.1255, False)
    total = 0
    for name in REGISTRY:
        r = simulate(cfg, name, {} if name == "colocate" else {"eta": 2}, check=True)
        _check(r)
        total += r.metrics.summary()["preemptions"]
        assert r.metrics.summary()["preempt_gpu_s"] >= 0
    assert total > 0, "no policy ever filled an engine's KV: the test does not exercise preemption"


def test_context_larger_than_an_engine_is_a_config_error():
    """An execution whose context can never fit one engine stops the run with a message naming it."""
    cfg = _tight(tiny_config(gpus=8, seed=1), 0.1225, False)  # ~100 KV tokens
    with pytest.raises(ConfigError, match="context; an engine holds"):
        simulate(cfg, "colocate")
