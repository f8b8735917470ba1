"""The paper's other setups as presets: the 122B NL2RepoBench run reproduces the two durations the paper states
(mean execution 1.93 h, mean query 2.96 h) on one colocate step, read from the event log."""

from __future__ import annotations

import numpy as np

from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate


def _durations(r, group_size: int) -> tuple[float, float]:
    start, fin = {}, {}
    for e in r.log:
        if e[0] == "start":
            start.setdefault(e[2], e[1])
        elif e[0] == "finish":
            fin[e[2]] = e[1]
    execution = np.mean([fin[x] - start[x] for x in fin])
    groups = {x // group_size for x in fin}
    query = np.mean([max(fin[x] for x in fin if x // group_size == g) - min(start[x] for x in fin if x // group_size == g)
                     for g in groups])
    return execution / 3600, query / 3600


def test_nl2repo_preset_matches_the_papers_mean_execution_and_query():
    cfg = override(get_preset("nl2repo-122b"), steps=1).validate()
    r = simulate(cfg, "colocate")
    execution, query = _durations(r, cfg.workload.group_size)
    assert abs(execution - 1.93) / 1.93 < 0.05, execution
    assert abs(query - 2.96) / 2.96 < 0.05, query


def test_paper_presets_validate_and_name_their_steps():
    assert get_preset("nl2repo-122b").steps == 48
    assert get_preset("deepswe-122b").steps == 24
    for name in ("nl2repo-122b", "deepswe-122b"):
        get_preset(name).validate()
