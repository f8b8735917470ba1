"""Invariants checked from the event log alone (tests/logcheck.py), never from the simulator's own counters:
staleness from admission, start and sync records; KV occupancy from admitted contexts and lengths; and the
checked run path (`check=True`) producing the very log of the fast one."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.policies import REGISTRY, make_policy, takes
from gyre.sim.harness.runner import simulate
from gyre.workload import GroupSpec
from tests.logcheck import check_staleness, decode_intervals, kv_occupancy
from tests.simkit import ROUND_COSTS, cluster, spec, tiny_config

RATE = 1.0 / ROUND_COSTS.step_a  # ROUND_COSTS decode 100 tokens/s per sequence whatever the batch, prefill free
POLICIES = sorted(REGISTRY)
SLOW_OK = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _groups(rng: np.random.Generator, n: int, size: int, turns: int, gen: tuple[int, int],
            prompt: tuple[int, int]) -> list[GroupSpec]:
    """`n` groups of `size` executions of 1..`turns` turns (tool calls of 0-4 s, outputs of 0-150 tokens)."""
    out, x = [], 0
    for g in range(n):
        execs = []
        for _ in range(size):
            k = int(rng.integers(1, turns + 1))
            execs.append(spec(x, g, gen=[int(v) for v in rng.integers(*gen, size=k)],
                              tool_s=[float(v) for v in rng.uniform(0, 4, size=k - 1)],
                              tool_out=[int(v) for v in rng.integers(0, 150, size=k - 1)],
                              prompt=int(rng.integers(*prompt))))
            x += 1
        out.append(GroupSpec(group_id=g, task_id=g, step=0, executions=execs))
    return out


def _run(policy: str, eta: int, groups: list[GroupSpec], gpus: int, gps: int, steps: int, costs, window: int):
    c = cluster(groups, n_gpus=gpus, groups_per_step=gps, costs=costs, window=window)
    c.check = False  # the log alone decides (SimCluster.check_invariants reads the engine's own counters)
    pol = make_policy(policy, **({"eta": eta} if takes(policy, "eta") else {}))
    c.run(pol, steps)
    return c, (eta if takes(policy, "eta") else 0)


@pytest.mark.invariants
@SLOW_OK
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(POLICIES), eta=st.integers(0, 2),
       gpus=st.integers(2, 4), gps=st.integers(1, 2), size=st.integers(2, 3))
def test_staleness_rebuilt_from_the_log_is_what_the_run_records(seed, policy, eta, gpus, gps, size):
    """Random multi-turn workloads, every registered policy, free prefill (an execution decodes the instant it
    starts): each trained execution's recorded oldest-token version is the version its engine served at its
    "start" record (from engine_up and sync records), and its staleness is <= eta."""
    steps = 3
    groups = _groups(np.random.default_rng(seed), (steps + eta + 3) * gps, size, turns=4, gen=(20, 400),
                     prompt=(50, 300))
    c, bound = _run(policy, eta, groups, gpus, gps, steps, ROUND_COSTS, window=131072)
    first_step = next((r[1] for r in c.log if r[0] == "step"), float("inf"))
    refreshed = any(r[0] == "sync" or (r[0] == "engine_up" and r[1] > first_step) for r in c.log)
    assert refreshed, "no engine received new weights (sync or restart): nothing tested"
    check_staleness(c.log, bound, exact=True)


@pytest.mark.invariants
@SLOW_OK
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(POLICIES), eta=st.integers(0, 2),
       gpus=st.integers(2, 4), gps=st.integers(1, 2), size=st.integers(2, 4))
def test_kv_rebuilt_from_the_log_never_exceeds_an_engine(seed, policy, eta, gpus, gps, size):
    """Random single-turn workloads whose contexts outgrow a small engine (6,000 KV tokens, 4 admitted at once,
    each up to 5,300 tokens), every registered policy: the KV each engine holds, rebuilt from each execution's
    prompt, its start, preemptions and finish at 100 tok/s, never exceeds its capacity."""
    cap = 6000
    costs = replace(ROUND_COSTS, kv_capacity_tokens=cap)
    steps = 2
    groups = _groups(np.random.default_rng(seed), (steps + eta + 3) * gps, size, turns=1, gen=(300, 4800),
                     prompt=(100, 500))
    c, _ = _run(policy, eta, groups, gpus, gps, steps, costs, window=cap // 4)
    prompts = {x.exec_id: x.prompt for g in groups for x in g.executions}
    ivs = decode_intervals(c.log, prompts, RATE, costs.sync_s)
    for e, kv in kv_occupancy(ivs, RATE, costs.sync_s, c.log).items():
        assert kv <= cap * (1 + 1e-9) + 1e-6, f"engine {e} held {kv:,.1f} KV tokens > capacity {cap:,}"


def test_kv_rebuilt_from_the_log_sees_a_full_engine():
    """The reconstruction is not vacuous: two 100-token prompts generating 2,900 tokens each at 100 tok/s on one
    5,000-token engine fill it at 27 s (both start at 3 s: 200 + 2 x 2,400), the newer is preempted, restarts when
    the older finishes (32 s) and finishes at 37 s; the log's peak is the capacity."""
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(i, 0, gen=[2900]) for i in range(2)])
    costs = replace(ROUND_COSTS, kv_capacity_tokens=5000)
    c, _ = _run("colocate", 0, [g], 1, 1, 1, costs, window=2500)
    pre = [r for r in c.log if r[0] == "preempt"]
    assert [(round(r[1], 6), r[2]) for r in pre] == [(27.0, 1)], pre
    fin = [(round(r[1], 6), r[2]) for r in c.log if r[0] == "finish"]
    assert fin == [(32.0, 0), (37.0, 1)], fin
    ivs = decode_intervals(c.log, {0: 100, 1: 100}, RATE, costs.sync_s)
    peak = kv_occupancy(ivs, RATE, costs.sync_s, c.log)[0]
    assert abs(peak - 5000) <= 1e-3, f"the log's peak is {peak}, not the 5,000-token capacity"


@pytest.mark.invariants
@SLOW_OK
@given(seed=st.integers(0, 10**6), policy=st.sampled_from(POLICIES), eta=st.integers(0, 2),
       gpus=st.sampled_from([4, 6]), math=st.booleans())
def test_checked_path_equals_fast_path(seed, policy, eta, gpus, math):
    """On random small workloads of a real preset, every policy: the run with the per-event invariant check and
    a progress callback (the loop's slow path) writes exactly the event log of the plain fast path."""
    cfg = tiny_config(gpus=gpus, steps=2, seed=seed, workload_name="math" if math else "xlong")
    params = {"eta": eta} if takes(policy, "eta") else {}
    fast = simulate(cfg, policy, params).log
    seen: list[int] = []
    checked = simulate(cfg, policy, params, check=True, progress=lambda v, t: seen.append(v)).log
    assert checked == fast, f"{policy}: the checked path's log differs from the fast path's"
    assert seen and seen[-1] == cfg.steps, f"progress saw versions {seen}"
