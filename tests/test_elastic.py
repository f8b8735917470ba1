"""The elastic scheduler: pure drain planning, an exact hand-computed timeline, and properties over seeds
(no abort or restart, migrations only at tool-call boundaries, GPUs conserved, staleness within eta)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.cluster import Phase, Role
from gyre.config import override
from gyre.hardware import Costs
from gyre.policies.elastic import Elastic
from gyre.policies.elastic_plan import assign_targets, choose_victims, plan_drain, spare_engines
from gyre.presets import get_preset
from gyre.sim.backend import SimCluster
from gyre.sim.runner import simulate
from gyre.presets import short_math
from gyre.workload import ExecutionSpec, GroupSpec, LogNormal, ReplaySource


@dataclass
class Eng:
    id: int
    gpus: tuple[int, ...]
    n_live: int = 0
    n_decoding: int = 0
    kv_used: float = 0.0
    kv_capacity: int = 100
    n_queued: int = 0
    ready: bool = True
    version: int = 0


@dataclass
class Ex:
    id: int
    engine_id: int
    context_tokens: int


def test_choose_victims_fewest_live_first_and_keeps_one():
    """Victims are the fewest-live engines (ties: fewest decoding, then id) and one engine always stays."""
    es = [Eng(0, (0,), n_live=3), Eng(1, (1,), n_live=1, n_decoding=1), Eng(2, (2,), n_live=1), Eng(3, (3,), n_live=0)]
    assert [e.id for e in choose_victims(es, 2)] == [3, 2], "two GPUs: the empty engine, then the idle one"
    assert [e.id for e in choose_victims(es, 99)] == [3, 2, 1], "never drains the last engine"
    assert choose_victims(es, 0) == [], "nothing needed, nothing drained"


def test_choose_victims_greedy_stops_at_kv_fill():
    """Greedy drains past the need only while the staying engines hold all KV at kv_fill."""
    es = [Eng(i, (i,), n_live=i, kv_used=40.0) for i in range(4)]  # 160 tokens resident, 100 per engine
    assert len(choose_victims(es, 1, kv_fill=0.9, greedy=True)) == 2, "160 tokens fit on 2 engines at 90%"
    assert len(choose_victims(es, 1, kv_fill=0.5, greedy=True)) == 1, "at 50% only the needed one goes"
    assert len(choose_victims(es, 1, kv_fill=0.9, greedy=False)) == 1, "not greedy: only the need"


def test_assign_targets_best_fit_and_plan():
    """Largest context goes to the target with the most free KV; the plan moves every victim's execution."""
    t = [Eng(0, (0,), kv_used=50.0), Eng(1, (1,), kv_used=10.0)]
    xs = [Ex(7, 9, 30), Ex(8, 9, 50)]
    got = [(x.id, e.id) for x, e in assign_targets(xs, t, kv_fill=1.0)]
    assert got == [(8, 1), (7, 0)], f"best fit by free KV: {got}"
    es = [Eng(0, (0,), n_live=2, kv_used=20.0), Eng(1, (1,), n_live=1, kv_used=5.0)]
    plan = plan_drain(es, [Ex(1, 0, 10), Ex(2, 0, 10), Ex(3, 1, 5)], 1)
    assert [e.id for e in plan.victims] == [1] and [(x.id, e.id) for x, e in plan.moves] == [(3, 0)], "plan"
    assert plan.gpus == [1], "the victim's GPUs come free"
    assert spare_engines(es, kv_fill=0.5) == 1, "25 tokens need one engine of 100 at 50%"


# ---------------------------------------------------------------- an exact timeline


def _spec(eid, gid, gen, tool_s=(), tool_out=()):
    kv, ctx = [], 100
    for i, g in enumerate(gen):
        kv.append(ctx)
        ctx += g + (tool_out[i] if i < len(tool_out) else 0)
    return ExecutionSpec(exec_id=eid, group_id=gid, task_id=gid, step=gid, prompt=100, gen=list(gen),
                         tool_s=list(tool_s), tool_out=list(tool_out), kv=kv, branches=[], capped=False,
                         deadline_s=1e9)


def _tiny_cluster():
    costs = Costs(engine_gpus=1, kv_capacity_tokens=10_000, step_a=1.0, step_b=0.0, step_c=0.0,
                  prefill_s_per_token=0.01, train_s_per_token_gpu=0.02, min_train_gpus=1, sync_s=0.0,
                  engine_wake_s=1.0, engine_sleep_s=1.0, trainer_onload_s=1.0, trainer_offload_s=0.0,
                  kv_transfer_s_per_token=0.0, migration="reprefill")
    groups = [
        GroupSpec(group_id=0, task_id=0, step=0, executions=[_spec(0, 0, [5])]),
        GroupSpec(group_id=1, task_id=1, step=1, executions=[
            _spec(1, 1, [3, 4], [2.0], [100]), _spec(2, 1, [6, 2], [1.0], [100])]),
    ]
    wl = override(get_preset("short-math"), **{"workload.groups_per_step": 1}).workload
    return SimCluster(n_gpus=2, costs=costs, source=ReplaySource(groups, wl), check=True)


def test_exact_shrink_migrate_grow_timeline():
    """Two 1-GPU engines, eta=1: a tool-waiting execution migrates at once, engines shrink and grow at hand-computed times."""
    c = _tiny_cluster()
    c.run(Elastic(eta=1), 2)
    ev = [r for r in c.log if r[0] in ("migrate", "engine_down", "engine_up", "step", "finish")]
    want = [
        ("engine_up", 1.0, 0, (0,)), ("engine_up", 1.0, 1, (1,)),
        # engine 0 holds execs 0 and 2; a step is 1 s + 0.01 s per prefill token (chunked prefill):
        # both prompts (200 tokens) share 3 s steps until exec 0's is done at 2.5; exec 0 then decodes
        # 1 token in the 2 s step that finishes exec 2's prompt (4.5), and 4 more at 1 s
        ("finish", 8.5, 0, 0, 5),
        ("migrate", 8.5, 1, 1, 0),            # exec 1 (prompt 1..3, 3 tokens to 6, tool to 8, prefilling) moves
        ("engine_down", 9.5, 1),              # engine 1 sleeps 1 s
        ("step", 12.6, 1, 1, 105),            # onload 1 s, 105 tokens x 0.02 s on 1 GPU
        ("engine_up", 13.6, 2, (1,)),         # grow: wake 1 s
        # exec 1 re-prefills 203 tokens in one 3.03 s step (8.5..11.53) beside exec 2's decode, then 4 tokens,
        # one of them in the 2 s step of exec 2's tool-output prefill (13.53..15.53)
        ("finish", 16.53, 1, 0, 7),
        ("finish", 17.53, 2, 0, 8),           # exec 2: 6 tokens to 12.53, tool 1 s, 100-token prefill 2 s, 2 tokens
        ("engine_down", 18.53, 0),            # step 1 drains engine 0 (empty, lowest id)
        ("step", 25.83, 2, 1, 315),           # onload 1 s, 315 tokens x 0.02 s
    ]
    assert len(ev) == len(want), f"event count: {ev}"
    for got, exp in zip(ev, want):
        assert got[0] == exp[0] and got[1] == pytest.approx(exp[1], abs=1e-6) and got[2:] == exp[2:], f"{got} != {exp}"


# ---------------------------------------------------------------- properties over seeds


def _small(preset: str, seed: int):
    """A small preset: 10 one-GPU engines (training needs 8, so drains move executions), 3 steps."""
    changes = {"steps": 3, "seed": seed, "workload.groups_per_step": 4, "cluster.gpus": 10}
    if preset == "short-math":
        changes["workload.group_size"] = 4
    else:  # xlong-swe's shape, 10x fewer turns, so a run takes a second
        changes.update({"workload.turns": LogNormal(median=12, p99_ratio=10.0), "workload.max_turns": 150})
    return override(get_preset(preset), **changes)


def _checked_run(cfg, eta, monkeypatch):
    phases = []
    orig = SimCluster._do_migrate

    def spy(self, ex, t):
        phases.append((ex.phase, ex.engine.id, ex.migrate_to.id))
        orig(self, ex, t)

    monkeypatch.setattr(SimCluster, "_do_migrate", spy)
    return simulate(cfg, "elastic", {"eta": eta}, check=True), phases


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), preset=st.sampled_from(["xlong-swe-small", "short-math"]),
       eta=st.sampled_from([0, 1, 2]))
def test_properties_over_seeds(seed, preset, eta, monkeypatch):
    """No abort or restart, migrations only off the decode batch, GPUs conserved (checked per event), staleness <= eta."""
    r, phases = _checked_run(_small(preset, seed), eta, monkeypatch)
    assert all(p != Phase.DECODE for p, _, _ in phases), f"a migration interrupted decoding: {phases}"
    starts = [rec[2] for rec in r.log if rec[0] == "start"]
    finishes = [rec[2] for rec in r.log if rec[0] == "finish"]
    assert len(starts) == len(set(starts)), "an execution was started twice (restart)"
    assert sorted(starts) == sorted(finishes), "every started execution finishes exactly once (no abort)"
    trained = [rec for rec in r.log if rec[0] == "trained"]
    assert sorted(t[2] for t in trained) == sorted(finishes), "every execution is trained exactly once"
    assert max(t[5] for t in trained) <= eta, f"staleness above eta={eta}"
    assert r.metrics.summary()["steps"] == 3, "all steps done"


def test_elastic_moves_gpus_and_migrates():
    """GPUs hold both roles during a run, reallocations and migrations are counted."""
    r = simulate(_small("xlong-swe-small", 1), "elastic", {"eta": 1}, check=True)
    s = r.metrics.summary()
    roles = {rec[3] for rec in r.log if rec[0] == "role"}
    assert {int(Role.ROLLOUT), int(Role.TRAIN)} <= roles, f"roles seen: {roles}"
    assert s["reallocations"] > 0, "no GPU moved between rollout and train"
    assert s["migrations"] > 0, "no execution migrated"
    assert s["migrations"] == sum(1 for rec in r.log if rec[0] == "migrate"), "migrations counted from the log"


def test_same_seed_identical_log():
    """Same seed, same config: identical event log (determinism)."""
    cfg = _small("short-math", 3)
    a = simulate(cfg, "elastic", {"eta": 1}).log
    b = simulate(cfg, "elastic", {"eta": 1}).log
    assert a == b, "two runs with the same seed diverged"


def test_bad_params_one_line():
    """Impossible parameters are a clear ValueError."""
    with pytest.raises(ValueError, match="eta"):
        Elastic(eta=-1)
    with pytest.raises(ValueError, match="kv_fill"):
        Elastic(kv_fill=0.0)
    assert short_math().max_turns == 1, "short-math is single-turn"


def test_trainer_grows_under_backlog():
    """On a trainer-bound workload (short-math, eta 4) the trainer's GPU count grows from the minimum."""
    p = {"eta": 4, "start_trainer": "min"}
    r = simulate(override(get_preset("short-math"), steps=6), "elastic", p, check=False)
    gpus = [rec[3] for rec in r.log if rec[0] == "step"]
    assert gpus[0] == r.costs.min_train_gpus, f"starts at the minimum: {gpus}"
    assert max(gpus) >= 4 * gpus[0], f"backlog should grow the trainer: {gpus}"
    off = simulate(override(get_preset("short-math"), steps=6), "elastic", {**p, "adapt_trainer": False})
    assert off.makespan_s > r.makespan_s, "adapting the trainer should pay off when training is the bottleneck"


def test_trainer_starts_at_its_largest_size_on_gpus_kept_free():
    """start_trainer="max" (default): the first step trains on half the pool, on GPUs that never ran an engine
    (no drain, no migration before it), and finishes sooner than the ramp up from the minimum."""
    cfg = override(get_preset("short-math"), steps=6)
    r = simulate(cfg, "elastic", {"eta": 4}, check=True)
    gpus = [rec[3] for rec in r.log if rec[0] == "step"]
    assert gpus[0] == cfg.cluster.gpus // 2, f"first step on half the pool: {gpus}"
    first_step = next(rec[1] for rec in r.log if rec[0] == "step")
    drains = [rec for rec in r.log if rec[0] == "note" and rec[2] == "elastic_drain" and rec[1] < first_step]
    assert not drains, f"drained before the first step: {drains}"
    ramp = simulate(cfg, "elastic", {"eta": 4, "start_trainer": "min"})
    assert r.metrics.steps["duration_s"].iloc[0] < ramp.metrics.steps["duration_s"].iloc[0]
    assert r.makespan_s < ramp.makespan_s
    with pytest.raises(ValueError, match="start_trainer"):
        Elastic(start_trainer="half")
    with pytest.raises(ValueError, match="decay"):
        Elastic(decay="never")


def test_pressure_decay_keeps_the_trainer_when_rollout_has_no_pressure():
    """decay="pressure": with no engine queueing and KV far from full (short-math), the trainer keeps its
    largest size and no GPU moves, which is the fixed split with the same trainer: the same makespan; the
    default decay gives GPUs back to rollout and moves them again."""
    cfg = override(get_preset("short-math"), steps=8)
    r = simulate(cfg, "elastic", {"eta": 4, "decay": "pressure"}, check=True)
    split = simulate(cfg, "async", {"eta": 4, "rollout_gpus": cfg.cluster.gpus // 2})
    assert r.metrics.summary()["reallocations"] == 0 and set(r.metrics.steps["gpus"]) == {cfg.cluster.gpus // 2}
    assert r.makespan_s == pytest.approx(split.makespan_s, rel=1e-9)
    moving = simulate(cfg, "elastic", {"eta": 4})
    assert moving.metrics.summary()["reallocations"] > 0
