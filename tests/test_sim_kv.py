"""KV memory is a hard limit: on workloads whose contexts overflow the engines many times over, no engine
ever holds more KV than it has (SimCluster.check_invariants asserts it after every event), preemption
recomputes instead of losing work, and every execution still finishes exactly once."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gyre.config import ConfigError, override
from gyre.hardware import CostConfig
from gyre.policies import REGISTRY
from gyre.roofline import Coefficients
from gyre.sim.harness.runner import simulate
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


@pytest.mark.invariants
@settings(deadline=None)
@given(seed=st.integers(0, 10_000), gpus=st.sampled_from([8, 10]), eta=st.integers(0, 2),
       util=st.floats(0.1256, 0.14), reserve=st.booleans(), name=st.sampled_from(sorted(REGISTRY)))
def test_kv_never_overcommits_and_every_execution_completes(seed, gpus, eta, util, reserve, name):
    """Every registered policy, engines of 9-44K KV tokens and 9 executions of up to ~4K-token contexts each."""
    cfg = override(tiny_config(gpus=gpus, seed=seed, groups_per_step=3, group_size=3),
                   **{"workload.deadline_s": float("inf")})
    cfg = _tight(cfg, util, reserve)
    r = simulate(cfg, name, {} if name == "colocate" else {"eta": eta}, check=True)
    _check(r)


def _hybrid(cfg):
    """dense-7b with every 4th layer full attention and Qwen3-Next's linear layers on the other 21: 14,336 B of
    KV per token and a 23.0 MB state (1,608 KV tokens) per sequence holding KV."""
    m = replace(cfg.cluster.model, name="dense-7b-hybrid", full_attention_interval=4, linear_key_heads=16,
                linear_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4)
    return replace(cfg, cluster=replace(cfg.cluster, model=m))


@pytest.mark.invariants
@settings(deadline=None)
@given(seed=st.integers(0, 10_000), eta=st.integers(0, 2), util=st.floats(0.1231, 0.1262), reserve=st.booleans(),
       name=st.sampled_from(sorted(REGISTRY)))
@example(seed=0, eta=0, util=0.1231, reserve=True, name="colocate")  # a reserved execution back from its tool call
@example(seed=0, eta=0, util=0.1231, reserve=True, name="async")  # behind a head that could not start until it
@example(seed=0, eta=0, util=0.1231, reserve=True, name="elastic")  # left: the two waited on each other
def test_kv_and_states_never_overcommit_on_a_hybrid_model(seed, eta, util, reserve, name):
    """Every registered policy on a hybrid model, engines of 10-44K KV tokens, each sequence holding KV also
    holding a 1,608-token state: KV plus states never exceed an engine (checked after every event from the
    members' own contexts), and every execution still finishes exactly once with all its tokens."""
    cfg = override(tiny_config(gpus=8, seed=seed, groups_per_step=3, group_size=3),
                   **{"workload.deadline_s": float("inf")})
    cfg = _tight(_hybrid(cfg), util, reserve)
    assert cfg.costs().state_tokens == 1608.0
    r = simulate(cfg, name, {} if name == "colocate" else {"eta": eta}, check=True)
    _check(r)


def test_state_counts_against_kv_exact_timeline():
    """As the preemption timeline below, with 1,100 KV tokens and a 100-token state per sequence: KV and states
    fill at 6.5 s (2 x (450 + 100)), so exec 1 is preempted with 450 tokens of context, a second earlier than
    without states (7.5 s, with 550); exec 0 ends at 11 s, exec 1 decodes its last 450 tokens by 15.5 s
    (without states its last 350 by 14.5 s). The window is 450 tokens: an admission limit of 1,100 // (450 + 100)
    = 2 (1,100 // 450 without states)."""
    from gyre.policies import make_policy
    from gyre.workload import GroupSpec
    from tests.simkit import ROUND_COSTS, cluster, spec

    def run(state):
        g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, gen=[800]), spec(1, 0, gen=[800])])
        c = cluster([g], n_gpus=1, groups_per_step=1,
                    costs=replace(ROUND_COSTS, kv_capacity_tokens=1100, state_tokens=state), window=450)
        c.run(make_policy("colocate"), steps=1)
        assert c.kv_peak_frac() <= 1.0
        return [(r[0], round(r[1], 6), r[2], r[3], round(r[4], 3)) for r in c.log if r[0] in ("preempt", "finish")]

    assert run(100.0) == [("preempt", 6.5, 1, 0, 450.0), ("finish", 11.0, 0, 0, 800), ("finish", 15.5, 1, 0, 800)]
    assert run(0.0) == [("preempt", 7.5, 1, 0, 550.0), ("finish", 11.0, 0, 0, 800), ("finish", 14.5, 1, 0, 800)]


def test_contexts_overflow_and_preempt():
    """A step's contexts overflow the whole cluster's KV at least 3 times over: every policy fills KV (the fixed
    ones preempt), none
    ever holds more KV than an engine has, and every execution still finishes with all its tokens."""
    cfg = override(tiny_config(gpus=4, seed=1, groups_per_step=10, group_size=4), **{"workload.deadline_s": float("inf")})
    cfg = _tight(cfg, 0.1256, False)
    costs = cfg.costs()
    for name in REGISTRY:
        r = simulate(cfg, name, {} if name == "colocate" else {"eta": 2}, check=True)
        _check(r)
        first_step = r.groups[: cfg.workload.groups_per_step]
        demand = sum(max(k + g for k, g in zip(e.kv, e.gen)) for grp in first_step for e in grp.executions)
        assert demand >= 3 * cfg.cluster.gpus // costs.engine_gpus * costs.kv_capacity_tokens, (demand, costs)
        s = r.metrics.summary()
        if name == "elastic":  # it rolls out on every GPU not training: its engines may fill without preempting
            assert s["preemptions"] > 0 or s["kv_peak_frac"] > 0.95, f"{name} never filled an engine's KV"
            continue
        assert s["preemptions"] > 0, f"{name} never filled an engine's KV"
        assert s["preempt_gpu_s"] > 0


def test_context_larger_than_an_engine_is_a_config_error():
    """An execution whose context can never fit one engine stops the run with a message naming it."""
    cfg = _tight(tiny_config(gpus=8, seed=1), 0.1225, False)  # ~100 KV tokens
    with pytest.raises(ConfigError, match="context; an engine holds"):
        simulate(cfg, "colocate")


def test_preemption_exact_timeline():
    """1,000 KV tokens, two 100-token prompts decoding 800 tokens each at 100 tok/s: KV fills at 7 s (2 x 500),
    the newer (exec 1) is preempted with 500 tokens of context, exec 0 ends at 11 s, exec 1 resumes with its
    400 remaining tokens and ends at 15 s (without the limit both would end at 11 s). The window is 500 tokens
    (an admission limit of 2): both contexts outgrow it, the case preemption is for."""
    from gyre.policies import make_policy
    from gyre.workload import GroupSpec
    from tests.simkit import ROUND_COSTS, cluster, spec

    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, gen=[800]), spec(1, 0, gen=[800])])
    c = cluster([g], n_gpus=1, groups_per_step=1, costs=replace(ROUND_COSTS, kv_capacity_tokens=1000), window=500)
    c.run(make_policy("colocate"), steps=1)
    got = [(r[0], round(r[1], 6), r[2], r[3], round(r[4], 3)) for r in c.log if r[0] in ("preempt", "finish")]
    assert got == [("preempt", 7.0, 1, 0, 500.0), ("finish", 11.0, 0, 0, 800), ("finish", 15.0, 1, 0, 800)], got
    assert c.kv_peak_frac() <= 1.0


def test_deadline_passing_during_prefill_ends_the_execution():
    """A 1,000-token prompt at 0.01 s per prefill token (one 10.01 s step) and a 5 s deadline: it never decodes."""
    from gyre.policies import make_policy
    from gyre.workload import GroupSpec
    from tests.simkit import ROUND_COSTS, cluster, spec

    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, gen=[10], prompt=1000, deadline_s=5.0)])
    c = cluster([g], n_gpus=1, groups_per_step=1, costs=replace(ROUND_COSTS, prefill_s_per_token=0.01))
    c.run(make_policy("colocate"), steps=1)
    fin = [(round(r[1], 6), r[3], r[4]) for r in c.log if r[0] == "finish"]
    assert fin == [(3.0 + 10.01, 2, 0)], fin
