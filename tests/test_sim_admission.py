"""Admission by room (policies.admit_queue) in the simulator: exact timelines and, over random small workloads
and every registered policy, the invariants reconstructed from the event log alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.config import ConfigError, override
from gyre.policies import REGISTRY, make_policy
from gyre.workload import GroupSpec
from tests.logcheck import check_staleness, occupancy
from tests.simkit import ROUND_COSTS, cluster, spec, tiny_config


def test_queued_execution_starts_its_deadline_clock_when_it_first_runs():
    """One engine handed one execution at a time (1,000 KV tokens, a 1,000-token window), two 500-token rollouts at
    100 tok/s with a 6 s deadline: exec 1 waits unstarted from 3 s to 8 s, then runs 5 s and finishes at 13 s
    uncut (a clock started at its queueing would have cut it at 9 s)."""
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, gen=[500], deadline_s=6.0),
                                                             spec(1, 0, gen=[500], deadline_s=6.0)])
    c = cluster([g], n_gpus=1, groups_per_step=1, costs=replace(ROUND_COSTS, kv_capacity_tokens=1000), window=1000)
    c.run(make_policy("colocate"), steps=1)
    got = [(r[0], round(r[1], 6), r[2]) + ((r[3],) if r[0] == "finish" else ()) for r in c.log
           if r[0] in ("admit", "start", "finish")]
    assert got == [("admit", 3.0, 0), ("start", 3.0, 0), ("finish", 8.0, 0, 0),
                   ("admit", 8.0, 1), ("start", 8.0, 1), ("finish", 13.0, 1, 0)], got
    assert c.executions[1].deadline_at == 14.0, "exec 1's 6 s budget runs from its start at 8 s"


def test_engine_is_handed_no_more_than_its_limit_and_takes_the_next_as_room_frees():
    """1,000 KV tokens and a 500-token window: the engine holds 2 at once. Four rollouts of 100, 250, 200 and 100
    tokens at 100 tok/s from 3 s: 0 and 1 start at 3 s, 2 when 0 ends (4 s), 3 when 1 ends (5.5 s)."""
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(i, 0, gen=[n]) for i, n in
                                                             enumerate([100, 250, 200, 100])])
    c = cluster([g], n_gpus=1, groups_per_step=1, costs=replace(ROUND_COSTS, kv_capacity_tokens=1000), window=500)
    c.run(make_policy("colocate"), steps=1)
    got = [(r[0], round(r[1], 6), r[2]) for r in c.log if r[0] in ("admit", "finish")]
    assert got == [("admit", 3.0, 0), ("admit", 3.0, 1), ("finish", 4.0, 0), ("admit", 4.0, 2),
                   ("finish", 5.5, 1), ("admit", 5.5, 3), ("finish", 6.0, 2), ("finish", 6.5, 3)], got
    assert max(n for _, n in occupancy(c.log)[0]) == 2, "the log never shows the engine holding more than 2"


def test_async_per_engine_cap_admits_one_at_a_time_below_the_engine_limit():
    """The engine of the test above admits 2 at once; async capped at max_running=1 runs the same four rollouts
    one after another, each admitted when the one before ends: 3-4, 4-6.5, 6.5-8.5, 8.5-9.5 s."""
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(i, 0, gen=[n]) for i, n in
                                                             enumerate([100, 250, 200, 100])])
    c = cluster([g], n_gpus=2, groups_per_step=1, costs=replace(ROUND_COSTS, kv_capacity_tokens=1000), window=500)
    c.run(make_policy("async", rollout_gpus=1, eta=0, max_running=1), steps=1)
    got = [(r[0], round(r[1], 6), r[2]) for r in c.log if r[0] in ("admit", "finish")]
    assert got == [("admit", 3.0, 0), ("finish", 4.0, 0), ("admit", 4.0, 1), ("finish", 6.5, 1),
                   ("admit", 6.5, 2), ("finish", 8.5, 2), ("admit", 8.5, 3), ("finish", 9.5, 3)], got


@pytest.mark.invariants
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), k=st.integers(0, 3), eta=st.integers(0, 2), math=st.booleans())
def test_every_cap_of_async_grid_is_honoured_from_the_log(seed, k, eta, math):
    """Random small workloads, async at each per-engine cap its grid holds (the halvings of the engine's
    admission limit of 8): from the log alone no engine ever holds more executions than the cap, and every
    execution of the trained groups finishes."""
    from gyre.policies import sweep
    from gyre.sim.harness.compare import shape_of
    from gyre.sim.harness.runner import simulate

    cfg = tiny_config(gpus=4, groups_per_step=4, steps=2, seed=seed, workload_name="math" if math else "xlong")
    cfg = override(cfg, **{"cluster.cost.admission_fill": 0.0175})  # 33,478 KV tokens / 4,000-token window
    assert _limit(cfg) == 8 and shape_of(cfg).admit_limit == 8, _limit(cfg)
    caps = sorted({p["max_running"] for p in sweep("async", shape_of(cfg), (eta,))}, reverse=True)
    assert caps == [8, 4, 2, 1], caps
    r = simulate(cfg, "async", {"eta": eta, "rollout_gpus": 2, "max_running": caps[k]}, check=True)
    held = {e: max(n for _, n in series) for e, series in occupancy(r.log).items()}
    assert held and max(held.values()) <= caps[k], f"cap {caps[k]}: engines held {held}"
    must = {x.exec_id for g in r.groups[: cfg.steps * cfg.workload.groups_per_step] for x in g.executions}
    assert must <= {x[2] for x in r.log if x[0] == "finish"}, "an execution of a trained group never finished"


def test_bad_admission_fill_and_deadline_are_config_errors():
    """An admission fill outside (0, 1] and a deadline that is not a positive number are one-line ConfigErrors
    naming the field."""
    cfg = tiny_config()
    for fill in (0, 1.5, -0.1, float("nan"), "half"):
        with pytest.raises(ConfigError, match="admission_fill"):
            override(cfg, **{"cluster.cost.admission_fill": fill})
    for d in (0, -5.0, float("nan"), "soon"):
        with pytest.raises(ConfigError, match="deadline_s"):
            override(cfg, **{"workload.deadline_s": d})


def _limit(cfg) -> int:
    from gyre.hardware import admission_limit

    c = cfg.costs()
    return admission_limit(c.kv_capacity_tokens, cfg.workload.max_context, c.admission_fill)


@pytest.mark.invariants
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), fill=st.sampled_from([0.0015, 0.006, 0.012]),
       policy=st.sampled_from(sorted(REGISTRY)), eta=st.integers(0, 2), math=st.booleans())
def test_admission_invariants_from_the_log(seed, fill, policy, eta, math):
    """Random small workloads, every registered policy, admission limits of 1-4: from the log alone, no engine
    ever holds more than its limit, every execution of the trained groups finishes once and is trained once,
    its staleness (trained version - the version its engine served when it started) is <= eta, and it
    generated all its tokens unless cut by its deadline."""
    from gyre.sim.harness.runner import simulate

    cfg = tiny_config(gpus=4, steps=2, seed=seed, workload_name="math" if math else "xlong")
    cfg = override(cfg, **{"cluster.cost.admission_fill": fill})
    limit = _limit(cfg)
    params = {} if policy == "colocate" else {"eta": eta}
    r = simulate(cfg, policy, params, check=True)
    log = r.log
    for e, series in occupancy(log).items():
        assert max(n for _, n in series) <= limit, f"engine {e} held {max(n for _, n in series)} > limit {limit}"
    must = {x.exec_id: x for g in r.groups[: cfg.steps * cfg.workload.groups_per_step] for x in g.executions}
    fin = [x for x in log if x[0] == "finish"]
    assert len(fin) == len({x[2] for x in fin}), "an execution finished twice"
    trained = [x for x in log if x[0] == "trained"]
    assert sorted(x[2] for x in trained) == sorted(must), "the trained executions are exactly the run's groups"
    check_staleness(log, 0 if policy == "colocate" else eta, exact=False)  # from engine_up, sync and start records
    for x in fin:
        full = sum(must[x[2]].gen) if x[2] in must else None
        if full is not None and x[3] != 2:
            assert x[4] == full, f"exec {x[2]} ended {x[3]} with {x[4]} of its {full} tokens"
        elif full is not None:
            assert x[4] <= full, f"exec {x[2]} cut with {x[4]} > {full} tokens"


@pytest.mark.parametrize("table, needle", [
    ("[cluster]\nadmission_fill = 2.0\n", "cluster: RealClusterConfig.admission_fill"),
    ("[cluster.task]\ndeadline_s = -1\n", "cluster.task: TaskConfig.deadline_s"),
])
def test_real_cli_bad_fill_or_deadline_is_one_line_exit_2(tmp_path, table, needle):
    """gyre-real with a TOML config whose admission fill or deadline is impossible: exit 2, one line naming it."""
    pytest.importorskip("ray")
    from typer.testing import CliRunner

    from gyre.bridge.cli import app

    p = tmp_path / "bad.toml"
    p.write_text(table)
    res = CliRunner().invoke(app, ["run", "-c", str(p), "--policy", "async"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], (res.exit_code, res.output)
