"""Exact timelines of tiny scenarios, computed by hand from ROUND_COSTS (100 tokens/s per sequence,
engine wake 2 s + weight sync 1 s, engine sleep 1 s, trainer onload 0.5 s, 0.01 GPU-s per trained token)."""

from __future__ import annotations

from gyre.cluster import Role
from gyre.policies import make_policy
from gyre.workload import GroupSpec
from tests.simkit import cluster, spec

R, T, S, I = int(Role.ROLLOUT), int(Role.TRAIN), int(Role.SWITCHING), int(Role.IDLE)


def timeline(log, kinds=("role", "start", "finish", "step", "sync", "migrate")):
    return [(rec[0], round(rec[1], 9), *rec[2:]) for rec in log if rec[0] in kinds]


def group(gid: int, *execs) -> GroupSpec:
    return GroupSpec(group_id=gid, task_id=gid, step=0, executions=list(execs))


def test_colocate_exact_timeline():
    """Colocate: engines wake, executions run with a tool call, all GPUs switch to training, the step ends."""
    a = spec(0, 0, gen=[100, 50], tool_s=[1.0])  # decode 1 s, tool 1 s, decode 0.5 s
    b = spec(1, 0, gen=[300])  # decode 3 s
    c = cluster([group(0, a, b)], n_gpus=2, groups_per_step=1)
    c.run(make_policy("colocate"), steps=1)
    assert timeline(c.log) == [
        ("role", 0.0, (0,), S), ("role", 0.0, (1,), S),  # wake 2 s + weight sync 1 s
        ("role", 3.0, (0,), R), ("role", 3.0, (1,), R),
        ("start", 3.0, 0, 0), ("start", 3.0, 1, 1),
        ("finish", 5.5, 0, 0, 150),
        ("finish", 6.0, 1, 0, 300),
        ("role", 6.0, (0,), S), ("role", 6.0, (1,), S),  # engines sleep 1 s
        ("role", 7.0, (0,), I), ("role", 7.0, (1,), I),
        ("role", 7.0, (0, 1), S),  # trainer onload 0.5 s
        ("role", 7.5, (0, 1), T),  # (100 prompt + 150 + 300) tokens * 0.01 / 2 GPUs = 2.75 s
        ("role", 10.25, (0, 1), I),
        ("step", 10.25, 1, 2, 550),
    ], timeline(c.log)


def test_async_exact_timeline():
    """Async (R=2, eta=0): one group in flight, train on the third GPU, sync in place, admit the next group."""
    g0 = group(0, spec(0, 0, gen=[200]))
    g1 = group(1, spec(1, 1, gen=[100]))
    c = cluster([g0, g1], n_gpus=3, groups_per_step=1)
    c.run(make_policy("async", rollout_gpus=2, eta=0), steps=2)
    assert timeline(c.log) == [
        ("role", 0.0, (0,), S), ("role", 0.0, (1,), S),
        ("role", 3.0, (0,), R), ("role", 3.0, (1,), R),
        ("start", 3.0, 0, 0),
        ("finish", 5.0, 0, 0, 200),
        ("role", 5.0, (2,), S),  # trainer onload
        ("role", 5.5, (2,), T),  # 300 tokens * 0.01 s on one GPU
        ("role", 8.5, (2,), I),
        ("step", 8.5, 1, 1, 300),
        ("sync", 9.5, 0, 1), ("sync", 9.5, 1, 1),  # eta=0: the next group waits for the new weights
        ("start", 9.5, 1, 0),
        ("finish", 10.5, 1, 0, 100),
        ("role", 10.5, (2,), T),  # trainer state already resident: no onload
        ("role", 12.5, (2,), I),
        ("step", 12.5, 2, 1, 200),
        ("sync", 13.5, 0, 2), ("sync", 13.5, 1, 2),
    ], timeline(c.log)
    stale = [rec[5] for rec in c.log if rec[0] == "trained"]
    assert stale == [0, 0], f"eta=0 must train on-policy, got staleness {stale}"


def test_decode_rate_shared_by_batch():
    """Fluid decode: two sequences on one engine slow each other per the step-time model, exactly."""
    from dataclasses import replace

    from tests.simkit import ROUND_COSTS

    costs = replace(ROUND_COSTS, step_b=0.01)  # step = 0.01 + 0.01 * batch: 50 tok/s with 2, 100 tok/s alone
    a, b = spec(0, 0, gen=[100]), spec(1, 0, gen=[300])
    c = cluster([group(0, a, b)], n_gpus=1, groups_per_step=1, costs=costs)
    c.run(make_policy("colocate"), steps=1)
    fin = {rec[2]: round(rec[1], 9) for rec in c.log if rec[0] == "finish"}
    # both start at 3: 100 tokens at 2*0.01+0.01=0.03 s/step -> 3 s; then 200 left alone at 0.02 s/step -> 4 s
    assert fin == {0: 6.0, 1: 10.0}, fin


def test_tool_wait_frees_the_batch_and_deadline_truncates():
    """A sequence in a tool call leaves the decode batch; an execution past its deadline ends truncated."""
    a = spec(0, 0, gen=[100, 100, 100], tool_s=[10.0, 10.0], deadline_s=5.0)
    c = cluster([group(0, a)], n_gpus=1, groups_per_step=1)
    c.run(make_policy("colocate"), steps=1)
    fin = [rec for rec in c.log if rec[0] == "finish"]
    # starts 3, decodes to 4, tool returns at 14 > deadline 8: ends at the boundary with 100 tokens, deadline hit (2)
    assert [(round(r[1], 9), r[3], r[4]) for r in fin] == [(14.0, 2, 100)], fin


def test_staleness_aware_bound_by_hand():
    """The eta-bound sums each step's longest solo group along chains eta+1 steps apart, and holds."""
    from gyre.sim.cluster.bound import lower_bound
    from tests.simkit import ROUND_COSTS

    g0 = group(0, spec(0, 0, gen=[200]))  # alone: 2 s
    g1 = group(1, spec(1, 1, gen=[100, 100], tool_s=[1.0]))  # alone: 1 + 1 + 1 = 3 s
    # trained tokens 300 + 300 at 0.01 GPU-s each on 2 GPUs: 3 s in all; the last step alone 1.5 s
    on_policy = lower_bound([g0, g1], ROUND_COSTS, n_gpus=2, groups_per_step=1, eta=0)
    assert round(on_policy.staleness_s, 9) == 8.0, on_policy  # (3 + 2) + 3
    assert round(on_policy.critical_path_s, 9) == 4.5, on_policy  # 3 + 1.5
    one_stale = lower_bound([g0, g1], ROUND_COSTS, n_gpus=2, groups_per_step=1, eta=1)
    assert round(one_stale.staleness_s, 9) == 4.0 and round(one_stale.makespan_s, 9) == 4.5, one_stale
    c = cluster([g0, g1], n_gpus=2, groups_per_step=1)
    c.run(make_policy("colocate"), steps=2)
    end = max(rec[1] for rec in c.log if rec[0] == "step")
    assert end >= on_policy.makespan_s, (end, on_policy)


def test_request_latency_delays_each_turn_of_its_execution_alone():
    """Costs.request_s = 0.25 s: each turn's request reaches the engine 0.25 s late (on admission and after
    each tool call); the engine's step is unchanged, so the other execution decodes at full speed meanwhile."""
    from dataclasses import replace

    from tests.simkit import ROUND_COSTS

    a = spec(0, 0, gen=[100, 50], tool_s=[1.0])  # 0.25 + decode 1 s, tool 1 s + 0.25, decode 0.5 s
    b = spec(1, 0, gen=[300])  # 0.25 + decode 3 s
    c = cluster([group(0, a, b)], n_gpus=2, groups_per_step=1, costs=replace(ROUND_COSTS, request_s=0.25))
    c.run(make_policy("colocate"), steps=1)
    assert timeline(c.log, kinds=("start", "finish", "step")) == [
        ("start", 3.25, 0, 0), ("start", 3.25, 1, 1),
        ("finish", 6.0, 0, 0, 150),
        ("finish", 6.25, 1, 0, 300),
        ("step", 10.5, 1, 2, 550),  # sleep 1 s, onload 0.5 s, train 2.75 s
    ], timeline(c.log)


def test_a_deadline_cut_trains_only_what_it_produced():
    """A cut execution trains its prompt, the turns it generated and the outputs of the tool calls it started,
    never the turns its spec planned after the cut; the view never shows those either."""
    # cut when its first tool call returns (14 > deadline 3 + 5): 100 prompt + 100 generated + 40 tool output
    at_return = spec(0, 0, gen=[100, 100, 100], tool_s=[10.0, 10.0], tool_out=[40, 40], deadline_s=5.0)
    # cut as its second turn ends (8 > deadline 3 + 3.5): 100 + (100 + 300) generated + 40; its second tool unrun
    at_turn_end = spec(1, 1, gen=[100, 300, 100], tool_s=[1.0, 1.0], tool_out=[40, 40], deadline_s=3.5)
    for ex, finish, trained in ((at_return, 14.0, 240), (at_turn_end, 8.0, 540)):
        c = cluster([group(ex.group_id, ex)], n_gpus=1, groups_per_step=1)
        c.run(make_policy("colocate"), steps=1)
        # the engine sleeps 1 s, the trainer onloads 0.5 s, then trains `trained` tokens at 0.01 s each on 1 GPU
        assert timeline(c.log, kinds=("finish", "step")) == [
            ("finish", finish, ex.exec_id, 2, trained - 100 - 40),
            ("step", round(finish + 1.5 + trained * 0.01, 9), 1, 1, trained),
        ], timeline(c.log)
        view = c.executions[ex.exec_id]
        assert view.trajectory_tokens == trained, view.trajectory_tokens
