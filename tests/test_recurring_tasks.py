"""Recurring tasks (WorkloadConfig.task_set): epochs visit every task once, a task keeps its prompt and its
difficulty spread, correlated across epochs; without a task set each group is its own task."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from gyre.presets import xlong_swe
from gyre.workload import WorkloadSource, sample_group


def test_recurring_tasks_visit_each_task_once_per_epoch_with_its_prompt():
    """With a task set, every epoch is a permutation of the tasks, and a task keeps its prompt."""
    w = replace(xlong_swe(), groups_per_step=4, group_size=2, task_set=6, task_epoch_corr=0.9)
    src = WorkloadSource(w, seed=3)
    groups = [src.next_group() for _ in range(18)]
    for k in range(3):
        tasks = [g.task_id for g in groups[6 * k: 6 * k + 6]]
        assert sorted(tasks) == list(range(6)), f"epoch {k} visits {tasks}"
    prompts = {}
    for g in groups:
        assert all(e.task_id == g.task_id for e in g.executions), "an execution's task differs from its group's"
        assert prompts.setdefault(g.task_id, g.executions[0].prompt) == g.executions[0].prompt, "prompt changed"
    assert [g.task_id for g in groups[:6]] != [g.task_id for g in groups[6:12]], "epochs not reshuffled"


def test_task_difficulty_keeps_its_spread_and_epoch_correlation():
    """Over many tasks, log-difficulty has the fresh-task spread in every epoch and corr rho between epochs."""
    from gyre.workload import task_difficulty

    w = replace(xlong_swe(), task_set=4000, task_epoch_corr=0.7)
    z = np.log([[task_difficulty(w, t, k, 0) for k in range(3)] for t in range(4000)])
    sigma = math.log(w.difficulty_p99_ratio) / 2.3263478740408408
    for k in range(3):
        assert abs(z[:, k].std() / sigma - 1) < 0.05, f"epoch {k} spread {z[:, k].std()} != {sigma}"
    for k in range(2):
        r = np.corrcoef(z[:, k], z[:, k + 1])[0, 1]
        assert abs(r - 0.7) < 0.04, f"epochs {k},{k + 1} correlate {r}"


def test_without_a_task_set_each_group_is_its_own_task():
    w = replace(xlong_swe(), groups_per_step=2, group_size=2)
    g = sample_group(w, 5, 2, seed=1)
    assert g.task_id == 5 and all(e.task_id == 5 for e in g.executions)
