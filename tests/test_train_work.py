"""The simulator's training work follows role-bounded path sampling: exact trees of a spec, uncapped = exact."""

import dataclasses

import numpy as np
import pytest

from gyre.hardware import group_train_attention_ctx
from gyre.presets import xlong_swe
from gyre.train_work import selected_work
from gyre.trajectory import SamplingConfig
from gyre.workload import ExecutionSpec, execution_tree, sample_group

W = dataclasses.replace(xlong_swe(), subagent_turns=2, retry_back_turns=2)


def spec(gen, branches):
    n = len(gen)
    return ExecutionSpec(exec_id=0, group_id=0, task_id=0, step=0, prompt=10, gen=list(gen), tool_s=[1.0] * (n - 1),
                         tool_out=[5] * (n - 1), kv=[100 * (i + 1) for i in range(n)], branches=branches,
                         capped=False, deadline_s=1e9)


def test_execution_tree_of_a_hand_built_spec():
    """Turns 0-1 main; a sub-agent of 2 turns (2, 3); main 4, 5; a retry at 6 rolling back 2 turns (6 continues
    under 1, beside 4); a compaction at 8; main 8, 9."""
    s = spec([1] * 10, [(2, "subagent"), (6, "retry"), (8, "compact")])
    parent, leaves = execution_tree(s, W)
    assert parent == [-1, 0, -1, 2, 1, 4, 1, 6, -1, 8], f"parents {parent}"
    assert leaves == [(3, "sub-agent"), (5, "main"), (7, "main-summary"), (9, "main")], f"leaves {leaves}"


def test_role_order_and_j_max_choose_the_trained_segments():
    """J_max = 1 trains the final main context only; 2 adds the main-summary path (the longest unmasked
    main-class path is drawn by weight, so the leaves here are one per class apart from main)."""
    s = spec([3, 4, 5, 6], [(2, "compact")])  # leaves: (1, main-summary), (3, main)
    t1, _, n1 = selected_work([s], W, SamplingConfig(mode="roles", j_max=1), np.random.default_rng(0))
    assert n1 == 1 and t1 == 10 + (5 + 5) + 6, f"J_max 1: {t1} tokens, {n1} paths"
    t2, a2, n2 = selected_work([s], W, SamplingConfig(mode="roles", j_max=2), np.random.default_rng(0))
    assert n2 == 2 and t2 == s.tokens, f"J_max 2: {t2} tokens of {s.tokens}, {n2} paths"
    assert abs(a2 - group_train_attention_ctx([s])) < 1e-9, "every segment: the exact attention sum"


@pytest.mark.parametrize("group", [0, 1, 2])
def test_uncapped_equals_exact_and_caps_shrink_the_work(group):
    """On xlong-swe groups with sub-agents and retries made frequent: uncapped sampling trains the exact work;
    J_max = 1 <= 5 <= uncapped in tokens; a seed fixes the draw."""
    w = dataclasses.replace(xlong_swe(), subagent_p=0.05, retry_p=0.05, group_size=4)
    g = sample_group(w, group, 0, seed=3).executions
    exact_t = g[0].prompt + sum(x.tokens - x.prompt for x in g)
    exact_a = group_train_attention_ctx(g)
    work = {j: selected_work(g, w, SamplingConfig(mode="roles", j_max=j), np.random.default_rng(group))
            for j in (1, 5, None)}
    assert work[None][0] == exact_t, f"uncapped tokens {work[None][0]} != exact {exact_t}"
    assert abs(work[None][1] / exact_a - 1) < 1e-12, "uncapped attention != exact"
    assert work[1][0] <= work[5][0] <= work[None][0], {j: w_[0] for j, w_ in work.items()}
    assert work[1][0] < exact_t, "J_max 1 should drop some branch of a branching group"
    again = selected_work(g, w, SamplingConfig(mode="roles", j_max=1), np.random.default_rng(group))
    assert again == work[1], "same seed, other work"


def test_sim_step_trains_less_under_j_max_1():
    """A simulated run with J_max = 1 books fewer trained tokens than the exact run of the same workload."""
    from gyre.config import override
    from gyre.presets import get_preset
    from gyre.sim.harness.runner import simulate

    base = override(get_preset("xlong-swe-small"), **{"steps": 1, "workload.subagent_p": 0.05,
                                                      "workload.retry_p": 0.05, "workload.groups_per_step": 2})
    tok = {}
    for name, samp in (("exact", SamplingConfig()), ("j1", SamplingConfig(mode="roles", j_max=1))):
        r = simulate(dataclasses.replace(base, sampling=samp), "colocate")
        tok[name] = sum(rec[4] for rec in r.log if rec[0] == "step")
    assert tok["j1"] < tok["exact"], f"trained tokens {tok}"
