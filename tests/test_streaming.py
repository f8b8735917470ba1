"""Streaming training steps on cells in the simulator: exact hand-computed timelines of micro-steps, joins,
leaves, batch growth and bursts; invariants over random workloads checked from the event log."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.cluster import ClusterError, Role
from gyre.policies import make_policy
from gyre.workload import GroupSpec
from tests.logcheck import check_staleness
from tests.simkit import ROUND_COSTS, cluster, spec
from tests.test_log_invariants import SLOW_OK, _groups

# ROUND_COSTS (decode 100 tokens/s per sequence, training 0.01 s per token on one GPU, trainer onload 0.5 s,
# engine wake 2 s + sync 1 s) plus links that move 100 bytes/s and 100 bytes of weights: a 1-GPU satellite's
# snapshot pull takes 1 s, its gradient send 1 s, and a reduction over two 1-GPU cells 2 x 1/2 x 1 s = 1 s.
COSTS = replace(ROUND_COSTS, train_weight_bytes=100.0, link_bytes_s=100.0)


def _two_groups() -> list[GroupSpec]:
    """Group 0: two executions of 100 tokens (done at t = 3 + 1); group 1: two of 500 (done at t = 3 + 5)."""
    def g(gid: int, gens: list[int], first: int) -> GroupSpec:
        return GroupSpec(group_id=gid, task_id=gid, step=0, executions=[spec(first + i, gid, [n]) for i, n in enumerate(gens)])

    return [g(0, [100, 100], 0), g(1, [500, 500], 2)]


def roll_out_two_groups(c):
    """Start an engine on GPU 0 and admit the next two groups' executions to it; returns the two groups."""
    eng = yield c.start_engine([0])
    gs = [c.next_group(), c.next_group()]
    for g in gs:
        for x in g.executions:
            c.admit(x, eng)
    return gs


class Hand:
    """One engine on GPU 0 rolls out both groups; a step opens on GPU 1 at once (all groups, or group 0 then
    group 1 by extend_step at `extend_at`); GPU 2 joins at `join_at` and leaves at `leave_at`."""

    name = "hand"

    def __init__(self, join_at=None, leave_at=None, extend_at=None) -> None:
        self.join_at, self.leave_at, self.extend_at = join_at, leave_at, extend_at

    def run(self, c, steps):
        gs = yield from roll_out_two_groups(c)
        h = c.open_step([1], gs if self.extend_at is None else gs[:1])
        for at, act in sorted([(t, a) for t, a in ((self.join_at, "join"), (self.leave_at, "leave"),
                                                     (self.extend_at, "extend")) if t is not None]):
            yield c.timeout(at - c.now)
            if act == "join":
                c.join_step([2])
            elif act == "leave":
                c.leave_step([2])
            else:
                c.extend_step(gs[1:])
        return (yield h)


def _timeline(c) -> list[tuple]:
    keep = ("step_open", "cell_join", "micro", "cell_leave", "step", "step_extend")
    return [r for r in c.log if r[0] in keep]


def test_each_group_trains_as_it_finishes_on_one_cell():
    """One core cell: group 0's micro-steps (200 tokens with the prompt, then 100) train from its finish at 4 s, group
    1's (600, 500) from 8 s; the version moves at 19 s, when the last is trained (no reduction for a lone core)."""
    c = cluster(_two_groups(), 3, 2, costs=COSTS)
    c.run(Hand(), 1)
    assert _timeline(c) == [
        ("step_open", 3.0, 0, (1,), 2), ("cell_join", 3.5, 0, (1,)),
        ("micro", 6.0, 0, 0, 4.0, 1, 200), ("micro", 7.0, 0, 1, 6.0, 1, 100),
        ("micro", 14.0, 0, 2, 8.0, 1, 600), ("micro", 19.0, 0, 3, 14.0, 1, 500),
        ("step", 19.0, 1, 1, 1400)], _timeline(c)
    assert [r[1] for r in c.log if r[0] == "trained"] == [19.0] * 4, "trained records at the step's end"


def test_a_satellite_joining_mid_step_shortens_it_by_the_hand_computed_amount():
    """A satellite asked at 5 s is ready at 6.5 s (onload 0.5 + pull 1); at 8 s it takes group 1's second micro-step
    (8 -> 13) while the core takes the first (8 -> 14); the reduction of two cells (1 s) ends the step at 15 s:
    4 s before the lone core's 19 s."""
    c = cluster(_two_groups(), 3, 2, costs=COSTS)
    c.run(Hand(join_at=5.0), 1)
    assert _timeline(c) == [
        ("step_open", 3.0, 0, (1,), 2), ("cell_join", 3.5, 0, (1,)),
        ("micro", 6.0, 0, 0, 4.0, 1, 200), ("cell_join", 6.5, 0, (2,)), ("micro", 7.0, 0, 1, 6.0, 1, 100),
        ("micro", 13.0, 0, 3, 8.0, 2, 500), ("micro", 14.0, 0, 2, 8.0, 1, 600),
        ("step", 15.0, 1, 2, 1400)], _timeline(c)


def test_a_leaving_satellite_finishes_its_micro_step_sends_its_gradients_and_frees_its_gpus():
    """Joined at 3 s (ready 4.5), the satellite trains group 0's second micro-step 4.5 -> 5.5; asked to leave at 5 s it
    sends its gradients (1 s) and is free at 6.5 s; group 1 then trains on the core alone: 8 -> 14 -> 19."""
    c = cluster(_two_groups(), 3, 2, costs=COSTS)
    c.run(Hand(join_at=3.0, leave_at=5.0), 1)
    assert _timeline(c) == [
        ("step_open", 3.0, 0, (1,), 2), ("cell_join", 3.5, 0, (1,)), ("cell_join", 4.5, 0, (2,)),
        ("micro", 5.5, 0, 1, 4.5, 2, 100), ("micro", 6.0, 0, 0, 4.0, 1, 200), ("cell_leave", 6.5, 0, (2,)),
        ("micro", 14.0, 0, 2, 8.0, 1, 600), ("micro", 19.0, 0, 3, 14.0, 1, 500),
        ("step", 19.0, 1, 1, 1400)], _timeline(c)
    roles = [r for r in c.log if r[0] == "role" and r[2] == (2,)]
    assert roles[-1] == ("role", 6.5, (2,), 0), f"GPU 2 idle and free once it left: {roles}"


def test_a_batch_opened_short_waits_for_the_groups_it_is_extended_with():
    """Opened with group 0 alone, the step trains it and waits (a batch is groups_per_step = 2 groups); group 1,
    added at 9 s after it finished at 8 s, trains 9 -> 15 -> 20, and the version moves then."""
    c = cluster(_two_groups(), 3, 2, costs=COSTS)
    c.run(Hand(extend_at=9.0), 1)
    assert _timeline(c)[-4:] == [
        ("step_extend", 9.0, 0, (1,)), ("micro", 15.0, 0, 2, 9.0, 1, 600), ("micro", 20.0, 0, 3, 15.0, 1, 500),
        ("step", 20.0, 1, 1, 1400)], _timeline(c)


def test_the_core_cannot_leave_and_a_step_is_refused_while_another_is_open():
    """Misuse is one ClusterError line: the core leaving, a second open step, a cell below the training minimum,
    a batch larger than groups_per_step."""
    c = cluster(_two_groups(), 4, 2, costs=replace(COSTS, min_train_gpus=2))
    errors = []

    class Misuse:
        name = "misuse"

        def run(self, cl, steps):
            gs = [cl.next_group(), cl.next_group()]
            for call in (lambda: cl.open_step([0], gs), lambda: cl.open_step([0, 1], gs + gs[:0] + [gs[0]])):
                try:
                    call()
                except ClusterError as e:
                    errors.append(str(e))
            h = cl.open_step([0, 1], gs)
            for call in (lambda: cl.leave_step([0, 1]), lambda: cl.open_step([2, 3], gs)):
                try:
                    call()
                except ClusterError as e:
                    errors.append(str(e))
            yield cl.timeout(0)
            return h

    c.run(Misuse(), 0)
    assert len(errors) == 4 and all("\n" not in e for e in errors), errors
    assert "needs >= 2 GPUs" in errors[0] and "twice" in errors[1], errors
    assert "core cell" in errors[2] and "still open" in errors[3], errors


def test_a_burst_of_three_steps_publishes_once():
    """steps_per_burst = 3: engines receive version 3 and no version between (every sync and engine start serves
    a multiple of 3), and an eta below mu - 1 is refused in one line."""
    from tests.simkit import tiny_config
    from gyre.config import override
    from gyre.sim.harness.runner import simulate

    cfg = override(tiny_config(steps=4, groups_per_step=2), **{"workload.steps_per_burst": 3})
    r = simulate(cfg, "async", {"eta": 2}, check=True)
    synced = {rec[3] for rec in r.log if rec[0] == "sync"}
    assert synced == {3}, f"engines served {synced}: a burst of 3 publishes once, at version 3"
    check_staleness(r.log, 2, exact=False, mu=3)
    with pytest.raises(ClusterError, match="steps_per_burst"):
        simulate(cfg, "async", {"eta": 1})


STREAMING = [("colocate", {"streaming": True}), ("async", {"streaming": True}), ("colocate", {}), ("async", {})]


@pytest.mark.invariants
@SLOW_OK
@given(seed=st.integers(0, 2**32 - 1), which=st.integers(0, len(STREAMING) - 1), eta=st.integers(0, 2),
       gpus=st.sampled_from([4, 6, 8]), cell=st.sampled_from([1, 2]), gps=st.integers(1, 3), size=st.integers(1, 3),
       mu=st.integers(1, 2))
def test_streaming_invariants_from_the_log(seed, which, eta, gpus, cell, gps, size, mu):
    """Random multi-turn workloads, colocate and async with and without streaming, cells of 1-2 GPUs, bursts of 1-2:
    GPUs conserved (checked run), every trained execution trained by exactly one micro-step after its group's last
    execution finished, never two micro-steps at once on a cell, every micro-step of a version before its step
    ends, each group trained once, and staleness within the bound (rebuilt from the log)."""
    policy, params = STREAMING[which]
    eta = max(eta, mu - 1)
    steps = 3
    groups = _groups(np.random.default_rng(seed), (steps * mu + eta + 3) * gps, size, turns=3, gen=(20, 300),
                     prompt=(50, 200))
    c = cluster(groups, n_gpus=gpus, groups_per_step=gps, costs=COSTS)
    c._cell_gpus, c._mu = cell, mu
    pol = make_policy(policy, **params, **({"eta": eta} if policy == "async" else {}))
    c.run(pol, steps)
    bound = eta if policy == "async" else mu - 1
    check_staleness(c.log, bound, exact=True, mu=mu)
    trained = [r for r in c.log if r[0] == "trained"]
    assert len({r[3] for r in trained}) == steps * gps and len(trained) == len({r[2] for r in trained}), \
        "every group trained once, every execution once"
    if not params:
        assert not any(r[0] == "micro" for r in c.log), "a plain step trains no micro-steps"
        return
    micro = [r for r in c.log if r[0] == "micro"]
    assert sorted(r[3] for r in micro) == sorted(r[2] for r in trained), "one micro-step per trained execution"
    finish = {r[2]: r[1] for r in c.log if r[0] == "finish"}
    group_of = {r[2]: r[3] for r in trained}
    group_end = defaultdict(float)
    for x, gid in group_of.items():
        group_end[gid] = max(group_end[gid], finish[x])
    step_end = {r[2] - 1: r[1] for r in c.log if r[0] == "step"}
    by_cell = defaultdict(list)
    for _, end, v, x, start, gpu, _tokens in micro:
        assert start >= group_end[group_of[x]] - 1e-9, f"exec {x} trained at {start} before its group ended"
        assert end <= step_end[v] + 1e-9, f"exec {x}'s micro-step ends after version {v + 1} was made"
        by_cell[(v, gpu)].append((start, end))
    for spans in by_cell.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:])), f"overlapping micro-steps {spans}"


def test_colocate_with_a_standalone_pool_keeps_the_pools_engine_up():
    """Colocate on 2 GPUs, GPU 1 a standalone pool; two steps of one group of two 100-token executions. Both engines
    start at 0 (wake 2 + sync 1 s: up at 3), one execution each, done at 4; GPU 0's engine sleeps (1 s: 5), GPU 0
    trains alone (onload 0.5 s, then 300 tokens x 0.01 s: 8.5). At 8.5 the pool's engine syncs to version 1 (1 s:
    9.5) while GPU 0 starts again (offload 0.5 + wake 2 + sync 1: 12.0); step 2 repeats from 12: done 13, sleep to
    14, trained at 17.5. GPU 1's engine comes up once and never trains."""
    def g(gid: int, first: int) -> GroupSpec:
        return GroupSpec(group_id=gid, task_id=gid, step=0, executions=[spec(first + i, gid, [100]) for i in range(2)])

    c = cluster([g(0, 0), g(1, 2), g(2, 4)], 2, 1)
    c._standalone = 1
    c.run(make_policy("colocate"), 2)
    events = [r[:4] if r[0] != "sync" else r[:3] for r in c.log if r[0] in ("engine_up", "engine_down", "sync", "step")]
    assert events == [("engine_up", 3.0, 0, (0,)), ("engine_up", 3.0, 1, (1,)), ("engine_down", 5.0, 0),
                      ("step", 8.5, 1, 1), ("sync", 9.5, 1), ("engine_up", 12.0, 2, (0,)), ("engine_down", 14.0, 2),
                      ("step", 17.5, 2, 1)], events
    assert all(1 not in r[2] for r in c.log if r[0] == "role" and r[3] == Role.TRAIN), "the pool never trains"


def test_under_role_bounded_sampling_a_streaming_step_trains_the_work_train_would():
    """With J_max = 1 each micro-step trains its execution's share of the paths `train` draws for the group (the
    same draw): a one-cell streaming step of the finished batch books the tokens `train` books and ends when it
    does (0.01 s per token), both below the exact work of the branching executions."""
    from gyre.handles import all_of
    from gyre.sim.cluster.backend import SimCluster
    from gyre.trajectory import SamplingConfig
    from gyre.workload import ExecutionSpec, ReplaySource
    from tests.simkit import workload

    def ex(i: int, gen: list[int], branches: list) -> ExecutionSpec:
        n = len(gen)
        return ExecutionSpec(exec_id=i, group_id=i // 2, task_id=i // 2, step=0, prompt=10, gen=gen,
                             tool_s=[1.0] * (n - 1), tool_out=[5] * (n - 1), kv=[100 * (k + 1) for k in range(n)],
                             branches=branches, capped=False, deadline_s=1e9)

    groups = [GroupSpec(group_id=0, task_id=0, step=0, executions=[ex(0, [30, 40, 50, 60], [(2, "compact")]),
                                                                   ex(1, [20, 20, 20, 20, 20, 20], [(2, "subagent")])]),
              GroupSpec(group_id=1, task_id=1, step=0, executions=[ex(2, [50, 10, 10, 10], [(2, "compact")]),
                                                                   ex(3, [10, 10, 10], [])])]
    exact = sum(g.executions[0].prompt + sum(x.tokens - x.prompt for x in g.executions) for g in groups)
    w = replace(workload(2, 2), subagent_turns=2, retry_back_turns=2)

    class Run:
        name = "sampled"

        def __init__(self, streaming: bool) -> None:
            self.streaming = streaming

        def run(self, c, steps):
            gs = yield from roll_out_two_groups(c)
            yield all_of([x.handle for g in gs for x in g.executions])
            return (yield (c.open_step if self.streaming else c.train)([1], gs))

    steps = {}
    for streaming in (False, True):
        c = SimCluster(n_gpus=2, costs=COSTS, source=ReplaySource(groups, w), check=True, seed=5,
                       sampling=SamplingConfig(mode="roles", j_max=1))
        c.run(Run(streaming), 1)
        steps[streaming] = [r for r in c.log if r[0] == "step"]
        if streaming:
            micro = [r for r in c.log if r[0] == "micro"]
            assert sum(r[6] for r in micro) == steps[True][0][4], "the micro-steps add up to the step's tokens"
    assert steps[True] == steps[False], f"streaming {steps[True]} != train {steps[False]}"
    assert steps[False][0][4] < exact, f"J_max = 1 trains {steps[False][0][4]} of {exact} tokens"
