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
from gyre.policies.elastic_plan import StepRecord, assign_targets, choose_victims, next_target, plan_drain
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
    admit_limit: int = 10**6


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


def test_assign_targets_best_fit_and_plan():
    """Largest context goes to the target with the most free KV; the plan moves every victim's execution."""
    t = [Eng(0, (0,), kv_used=50.0), Eng(1, (1,), kv_used=10.0)]
    xs = [Ex(7, 9, 30), Ex(8, 9, 50)]
    moves, rest = assign_targets(xs, t, kv_fill=1.0)
    got = [(x.id, e.id) for x, e in moves]
    assert got == [(8, 1), (7, 0)] and rest == [], f"best fit by free KV: {got}"
    full = [Eng(0, (0,), n_live=1, kv_used=50.0, admit_limit=1), Eng(1, (1,), n_live=1, kv_used=10.0, admit_limit=2)]
    moves, rest = assign_targets(xs, full, kv_fill=1.0)
    assert [(x.id, e.id) for x, e in moves] == [(8, 1)] and [x.id for x in rest] == [7], \
        f"engine 0 is at its admission limit, engine 1 has one slot: the other migrant is parked ({moves}, {rest})"
    es = [Eng(0, (0,), n_live=2, kv_used=20.0), Eng(1, (1,), n_live=1, kv_used=5.0)]
    plan = plan_drain(es, [Ex(1, 0, 10), Ex(2, 0, 10), Ex(3, 1, 5)], 1)
    assert [e.id for e in plan.victims] == [1] and [(x.id, e.id) for x, e in plan.moves] == [(3, 0)], "plan"
    assert plan.gpus == [1], "the victim's GPUs come free"


# ---------------------------------------------------------------- an exact timeline


def _spec(eid, gid, gen, tool_s=(), tool_out=()):
    kv, ctx = [], 100
    for i, g in enumerate(gen):
        kv.append(ctx)
        ctx += g + (tool_out[i] if i < len(tool_out) else 0)
    return ExecutionSpec(exec_id=eid, group_id=gid, task_id=gid, step=gid, prompt=100, gen=list(gen),
                         tool_s=list(tool_s), tool_out=list(tool_out), kv=kv, branches=[], capped=False,
                         deadline_s=1e9)


def _tiny_cluster(kv_capacity: int = 250):
    """Two 1-GPU engines' worth of GPUs; KV for two of the three prompts at once, so the third queues."""
    costs = Costs(engine_gpus=1, kv_capacity_tokens=kv_capacity, step_a=1.0, step_b=0.0, step_c=0.0,
                  prefill_s_per_token=0.01, train_s_per_token_gpu=0.02, min_train_gpus=1, sync_s=0.0,
                  engine_wake_s=1.0, engine_sleep_s=1.0, trainer_onload_s=1.0, trainer_offload_s=0.0,
                  kv_transfer_s_per_token=0.0, migration="reprefill")
    groups = [
        GroupSpec(group_id=0, task_id=0, step=0, executions=[_spec(0, 0, [5])]),
        GroupSpec(group_id=1, task_id=1, step=1, executions=[
            _spec(1, 1, [3, 4], [2.0], [100]), _spec(2, 1, [6, 2], [1.0], [100])]),
    ]
    # a 125-token window: an engine of 250 KV tokens is handed 2 executions at once (policies.admit_queue)
    wl = override(get_preset("short-math"), **{"workload.groups_per_step": 1, "workload.context_window": 125,
                                               "workload.summary_tokens": 64}).workload
    return SimCluster(n_gpus=2, costs=costs, source=ReplaySource(groups, wl), check=True)


def test_exact_lend_rebalance_shrink_migrate_grow_timeline():
    """Two GPUs, eta=1, the trainer's largest size is 1 GPU (reserved): an execution waiting for room (an
    engine is handed 2 at once) makes elastic lend the reserved GPU and admit it there, never started before;
    each ready batch drains an engine back.

    The policy's times are hand-computed from its triggers (wake 1 s, sleep 1 s, trainer onload 1 s +
    tokens x 0.02 s on 1 GPU); the finish and preempt times are the engine model's (tested on its own)."""
    c = _tiny_cluster()
    c.run(Elastic(eta=1), 2)
    ev = [r[:4] if r[0] != "note" else ("note", r[1], r[2]) for r in c.log
          if r[0] in ("admit", "migrate", "engine_down", "engine_up", "step", "finish", "preempt")
          or (r[0] == "note" and r[2] in ("elastic_grow", "elastic_drain"))]
    f0 = next(r[1] for r in c.log if r[0] == "finish" and r[2] == 0)
    last = max(r[1] for r in c.log if r[0] == "finish")
    want = [
        ("note", 0.0, "elastic_grow"), ("engine_up", 1.0, 0, (0,)),  # GPU 1 is reserved for the trainer
        ("admit", 1.0, 0, 0), ("admit", 1.0, 1, 0),  # engine 0 is handed two: its admission limit
        ("note", 1.0, "elastic_grow"),  # exec 2 waits unstarted for room: lend GPU 1
        ("engine_up", 2.0, 1, (1,)),  # wake 1 s
        ("admit", 2.0, 2, 1),  # the waiting execution is admitted to the lent engine
        ("finish", f0, 0, 0),  # group 0 done: batch 0 ready
        ("note", f0, "elastic_drain"), ("migrate", f0, 1, 0),  # engine 0 (fewer... ties by id) drains, exec 1 moves
        ("engine_down", f0 + 1.0, 0),  # sleep 1 s
        ("preempt", 10.0, 2, 1),  # engine 1 now holds both: KV full, the newest is preempted (engine model)
        ("step", f0 + 1.0 + 1.0 + 105 * 0.02, 1, 1),  # onload 1 s + 105 tokens x 0.02 s
        ("note", f0 + 4.1, "elastic_grow"), ("engine_up", f0 + 5.1, 2, (0,)),  # GPU 0 back to rollout, wake 1 s
        ("migrate", f0 + 5.1, 2, 1),  # the preempted (queued) execution moves to the new engine at once
        ("finish", 18.66, 2, 0), ("finish", last, 1, 0),
        ("note", last, "elastic_drain"), ("engine_down", last + 1.0, 1),
        ("step", last + 1.0 + 1.0 + 315 * 0.02, 2, 1),
    ]
    assert len(ev) == len(want), f"event count: {ev}"
    for got, exp in zip(ev, want):
        assert got[0] == exp[0] and got[1] == pytest.approx(exp[1], abs=1e-5) and got[2:len(exp)] == exp[2:], \
            f"{got} != {exp}"


def test_no_pressure_no_move():
    """With KV to spare (nothing queues), the reserved GPU never runs an engine: no drain, no migration."""
    c = _tiny_cluster(kv_capacity=10_000)
    c.run(Elastic(eta=1), 2)
    kinds = {r[0] for r in c.log}
    assert "migrate" not in kinds and "engine_down" not in kinds, sorted(kinds)
    assert [r[3] for r in c.log if r[0] == "engine_up"] == [(0,)], "only GPU 0 ever runs an engine"


def _rec(interval: float, idle: float, train: float = 10.0, gpus: int = 32, waiting: int = 5) -> StepRecord:
    return StepRecord(interval=interval, idle=idle, train=train, gpus=gpus, waiting=waiting)


def test_next_target_exact_decisions():
    """The trainer target moves only on three steps' evidence: hand-computed cases."""
    kw = dict(top=60, floor=8, per=4)
    busy = _rec(10.5, 0.0)
    assert next_target(32, [busy, busy], backlog=True, **kw) == 32, "two backlogged steps are not yet evidence"
    assert next_target(32, [busy, busy, busy], backlog=True, **kw) == 60, "three without a wait: trainer-bound"
    assert next_target(32, [busy, busy, busy], backlog=False, **kw) == 32, "no batch waiting now: hold"
    burst = [_rec(10.5, 0.0, waiting=w) for w in (12, 8, 4)]  # ready batches behind a slow group, draining
    assert next_target(32, burst, backlog=True, **kw) == 32, "a draining queue of ready batches is a burst"
    assert next_target(32, burst[::-1], backlog=True, **kw) == 60, "a growing one is a trainer too small"
    slow = _rec(40.0, 29.5)  # one slow batch: the trainer waited 29.5 of 61 s in the window
    assert next_target(32, [busy, busy, slow], backlog=False, **kw) == 32, "one slow batch moves nothing"
    assert next_target(32, [slow, busy, busy], backlog=True, **kw) == 32, "a burst after a slow batch: hold"
    # waited 3 x 30 of 120 s: 32 GPUs x 30 s trained in 120 s = 8 GPUs' worth -> 8, but at least half of 32
    waits = [_rec(40.0, 30.0)] * 3
    assert next_target(32, waits, backlog=False, **kw) == 16, "rollout-bound: halves at most"
    # 24 GPUs x 10 s x 3 in 3 x 20 s = 12 GPUs, rounded up to engines of 4 = 12 (>= half of 24 = 12)
    assert next_target(24, [_rec(20.0, 11.0, gpus=24)] * 3, backlog=False, **kw) == 12
    # 20 GPUs x 10 s x 3 in 3 x 21 s = 9.5 -> 12 GPUs (3 engines of 4), above half of 20 (8 -> 8)
    assert next_target(20, [_rec(21.0, 11.0, gpus=20)] * 3, backlog=False, **kw) == 12
    assert next_target(8, waits, backlog=False, **kw) == 8, "never below the floor"


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(0.1, 100.0), st.floats(0.0, 1.0), st.floats(0.1, 50.0),
                                st.booleans(), st.integers(0, 20)), min_size=1, max_size=40),
       per=st.sampled_from([1, 4, 32]), floor_engines=st.integers(1, 4), top_engines=st.integers(4, 30))
def test_next_target_moves_at_most_once_per_window(steps, per, floor_engines, top_engines):
    """Fed step after step (the window restarting after each move), the target stays an engine multiple in
    [floor, top], shrinks at most by half per move, and moves at most once every three steps."""
    floor, top = floor_engines * per, top_engines * per
    target, window, moves = top, [], []
    for i, (interval, idle_share, train, backlog, waiting) in enumerate(steps):
        window.append(StepRecord(interval=interval, idle=idle_share * interval, train=train, gpus=target,
                                 waiting=waiting))
        new = next_target(target, window, backlog=backlog, top=top, floor=floor, per=per)
        assert new % per == 0 and floor <= new <= top, (new, floor, top)
        assert new >= min(target, max(floor, target // 2 // per * per)), f"shrank more than half: {target} -> {new}"
        if new != target:
            moves.append(i)
            window = []
        target = new
    assert all(b - a >= 3 for a, b in zip(moves, moves[1:])), f"moves closer than three steps: {moves}"


# ---------------------------------------------------------------- properties over seeds


def _small(preset: str, seed: int):
    """A small preset: 10 one-GPU engines (training needs 8, so drains move executions), 3 steps."""
    changes = {"steps": 3, "seed": seed, "workload.groups_per_step": 4, "cluster.gpus": 10}
    if preset == "short-math":
        changes["workload.group_size"] = 4
    else:  # xlong-swe's shape, 10x fewer turns, so a run takes a second
        changes.update({"workload.turns": LogNormal(median=12, p99_ratio=10.0), "workload.max_turns": 150})
    return override(get_preset(preset), **changes)


def _scarce(seed: int):
    """`_small` xlong-swe-small with long tool outputs: contexts fill the two engines' KV, so they queue."""
    return override(_small("xlong-swe-small", seed), **{"workload.tool_out_tokens": LogNormal(median=4000, p99_ratio=4.0)})


def _checked_run(cfg, eta, monkeypatch):
    phases = []
    orig = SimCluster._do_migrate

    def spy(self, ex, t):
        phases.append((ex.phase, ex.engine.id, ex.migrate_to.id))
        orig(self, ex, t)

    monkeypatch.setattr(SimCluster, "_do_migrate", spy)
    return simulate(cfg, "elastic", {"eta": eta}, check=True), phases


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), preset=st.sampled_from(["xlong-swe-small", "short-math", "scarce"]),
       eta=st.sampled_from([0, 1, 2]))
def test_properties_over_seeds(seed, preset, eta, monkeypatch):
    """No abort or restart, migrations only off the decode batch, GPUs conserved (checked per event), staleness <= eta."""
    r, phases = _checked_run(_scarce(seed) if preset == "scarce" else _small(preset, seed), eta, monkeypatch)
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
    r = simulate(_scarce(1), "elastic", {"eta": 1}, check=True)
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


def test_no_pressure_is_the_fixed_split_with_the_largest_trainer():
    """short-math: no engine queues and KV stays far from full, so the trainer keeps half the pool, no GPU
    moves, and elastic is exactly async with the same split (same makespan)."""
    cfg = override(get_preset("short-math"), steps=6)
    r = simulate(cfg, "elastic", {"eta": 4}, check=True)
    split = simulate(cfg, "async", {"eta": 4, "rollout_gpus": cfg.cluster.gpus // 2})
    assert r.metrics.summary()["reallocations"] == 0, "no GPU moved"
    assert set(r.metrics.steps["gpus"]) == {cfg.cluster.gpus // 2}, list(r.metrics.steps["gpus"])
    first_step = next(rec[1] for rec in r.log if rec[0] == "step")
    assert not [rec for rec in r.log if rec[0] == "note" and rec[2] == "elastic_drain" and rec[1] < first_step]
    assert r.makespan_s == pytest.approx(split.makespan_s, rel=1e-9)


def test_one_slow_batch_moves_no_gpu():
    """short-math over 16 steps: two batches are slow (steps 6 and 11 come ~38 s after the previous one
    where a step takes ~16 s) and bursts of ready batches follow; the trainer stays at half the pool, no
    GPU moves, and elastic is exactly the fixed split with that trainer (a rule sizing the trainer on one
    step's interval reallocated GPUs 97 times here, training on 15-63 GPUs)."""
    cfg = override(get_preset("short-math"), steps=16)
    r = simulate(cfg, "elastic", {"eta": 4})
    split = simulate(cfg, "async", {"eta": 4, "rollout_gpus": cfg.cluster.gpus // 2})
    waits = [b - a for a, b in zip(split.metrics.steps["t_end"], split.metrics.steps["t_end"][1:])]
    assert max(waits) > 1.3 * sorted(waits)[len(waits) // 2], f"the workload has no slow batch: {waits}"
    assert r.metrics.summary()["reallocations"] == 0, "no GPU moved"
    assert set(r.metrics.steps["gpus"]) == {cfg.cluster.gpus // 2}, list(r.metrics.steps["gpus"])
    assert r.makespan_s == pytest.approx(split.makespan_s, rel=1e-9)


def test_pressure_lends_the_reserve_and_shrinks_the_trainer():
    """KV-scarce rollout (xlong-swe-small's shape on 10 GPUs, engines queueing): the 8 reserved GPUs run
    engines until the batch is ready, which beats the fixed split with the same trainer by > 25%; the
    removed knobs are refused."""
    r = simulate(_scarce(1), "elastic", {"eta": 1}, check=True)
    first_step = next(rec[1] for rec in r.log if rec[0] == "step")
    ups = [rec for rec in r.log if rec[0] == "engine_up" and rec[1] < first_step]
    assert len(ups) == 10, f"all 8 reserved GPUs should be lent before the first step: {ups}"
    fixed = simulate(_scarce(1), "async", {"eta": 1, "rollout_gpus": 2})
    assert r.makespan_s < 0.75 * fixed.makespan_s, (r.makespan_s, fixed.makespan_s)
    from gyre.policies import UnknownPolicy, make_policy

    for knob in ("start_trainer", "decay", "greedy", "consolidate", "adapt_trainer"):
        with pytest.raises(UnknownPolicy, match=knob):
            make_policy("elastic", **{knob: 1})
