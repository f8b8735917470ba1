"""Injected trainer faults during streaming steps in the simulator: exact hand-computed timelines of a satellite and
of the core lost mid-step (and during the final reduction), and invariants over random workloads with faults,
checked from the event log."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gyre.handles import all_of
from gyre.policies import make_policy
from gyre.sim.cluster.backend import SimCluster
from gyre.workload import ReplaySource
from tests.logcheck import check_staleness
from tests.simkit import workload
from tests.test_log_invariants import SLOW_OK, _groups
from tests.test_streaming import COSTS, Hand, _two_groups, roll_out_two_groups

# test_streaming's costs (training 0.01 s per token on one GPU, trainer onload 0.5 s, a 1-GPU satellite's snapshot
# pull 1 s, a reduction over two 1-GPU cells 1 s) with a trainer worker back 5 s after it is killed
FCOSTS = replace(COSTS, trainer_restart_s=5.0)
KEEP = ("step_open", "cell_join", "micro", "cell_leave", "step")
NOTES = ("trainer_fault", "cell_lost", "trainer_recovered")
SATELLITE_SEED, CORE_SEED = 0, 4  # the seeds whose kill-trainer picks GPU 2 (the satellite), GPU 1 (the core)


def _cluster(groups, n_gpus: int, gps: int, faults: tuple[str, ...], seed: int, every: int = 0) -> SimCluster:
    src = ReplaySource(groups, workload(gps, len(groups[0].executions)))
    return SimCluster(n_gpus=n_gpus, costs=FCOSTS, source=src, check=True, faults=faults, seed=seed,
                      checkpoint_every=every)


def _timeline(c) -> list[tuple]:
    return [r for r in c.log if r[0] in KEEP or (r[0] == "note" and r[2] in NOTES)]


def _victim(c) -> int:
    return next(r[3]["worker"] for r in c.log if r[0] == "note" and r[2] == "fault")


def test_a_satellite_killed_mid_step_returns_its_micro_steps_and_the_core_trains_them():
    """The satellite (ready at 4.5 s) trained execution 1 (4.5 -> 5.5) and trains execution 3 from 8 s when it is
    killed at 10 s: both go back to the queue's head (its gradient is lost with it), its GPU switches until its
    worker is back at 15 s and is then free; the core, busy with execution 2 until 14 s, trains 1 (14 -> 15) and 3
    (15 -> 20), and the version moves at 20 s with no reduction (the core is alone)."""
    c = _cluster(_two_groups(), 3, 2, ("kill-trainer@10",), SATELLITE_SEED)
    c.run(Hand(join_at=3.0), 1)
    assert _victim(c) == 2, "the seed's kill picks the satellite"
    assert _timeline(c) == [
        ("step_open", 3.0, 0, (1,), 2), ("cell_join", 3.5, 0, (1,)), ("cell_join", 4.5, 0, (2,)),
        ("micro", 5.5, 0, 1, 4.5, 2, 100), ("micro", 6.0, 0, 0, 4.0, 1, 200),
        ("note", 10.0, "trainer_fault", {"worker": 2, "version": 0, "in_step": True, "record": False}),
        ("note", 10.0, "cell_lost", {"version": 0, "gpus": [2], "micro": [1]}),
        ("micro", 14.0, 0, 2, 8.0, 1, 600), ("cell_leave", 15.0, 0, (2,)),
        ("micro", 15.0, 0, 1, 14.0, 1, 100), ("micro", 20.0, 0, 3, 15.0, 1, 500),
        ("step", 20.0, 1, 1, 1400)], _timeline(c)
    roles = [r[1:] for r in c.log if r[0] == "role" and r[2] == (2,)]
    assert roles[-2:] == [(10.0, (2,), 3), (15.0, (2,), 0)], f"GPU 2 switches 10 -> 15, then idle and free: {roles}"


def test_a_satellite_asked_to_leave_then_killed_returns_its_micro_steps_and_its_leave_completes_once_free():
    """Ready at 4.5 s, the satellite trained execution 1 (4.5 -> 5.5) and trains execution 3 from 8 s when it is asked
    to leave at 9 s: it leaves only after that micro-step, so nothing is sent yet. Killed at 10 s, it sends nothing:
    1 and 3 go back to the queue's head, its GPU switches until its worker is back at 15 s, and only then is it free
    and its leave complete (None); the core trains 2 (8 -> 14), 1 (14 -> 15), 3 (15 -> 20) and the version moves at
    20 s without a reduction, as if the leave had not been asked."""
    left = []

    class LeaveThenKill(Hand):
        def run(self, c, steps):
            gs = yield from roll_out_two_groups(c)
            h = c.open_step([1], gs)
            yield c.timeout(3.0 - c.now)
            c.join_step([2])
            yield c.timeout(9.0 - c.now)
            lv = c.leave_step([2])
            lv.on_done(lambda lv: left.append((c.now, lv.value, c.training.cells)))
            return (yield h)

    c = _cluster(_two_groups(), 3, 2, ("kill-trainer@10",), SATELLITE_SEED)
    c.run(LeaveThenKill(), 1)
    assert _victim(c) == 2, "the seed's kill picks the satellite"
    assert _timeline(c) == [
        ("step_open", 3.0, 0, (1,), 2), ("cell_join", 3.5, 0, (1,)), ("cell_join", 4.5, 0, (2,)),
        ("micro", 5.5, 0, 1, 4.5, 2, 100), ("micro", 6.0, 0, 0, 4.0, 1, 200),
        ("note", 10.0, "trainer_fault", {"worker": 2, "version": 0, "in_step": True, "record": False}),
        ("note", 10.0, "cell_lost", {"version": 0, "gpus": [2], "micro": [1]}),
        ("micro", 14.0, 0, 2, 8.0, 1, 600), ("cell_leave", 15.0, 0, (2,)),
        ("micro", 15.0, 0, 1, 14.0, 1, 100), ("micro", 20.0, 0, 3, 15.0, 1, 500),
        ("step", 20.0, 1, 1, 1400)], _timeline(c)
    assert left == [(15.0, None, [(1,)])], f"the leave completes once GPU 2 is free, the core alone left: {left}"
    roles = [r[1:] for r in c.log if r[0] == "role" and r[2] == (2,)]
    assert roles[-3:] == [(8.0, (2,), 2), (10.0, (2,), 3), (15.0, (2,), 0)], \
        f"GPU 2 trains from 8 s, switches 10 -> 15, then idle and free: {roles}"


def test_a_satellite_killed_while_switching_in_never_trains_and_its_join_completes_false():
    """Asked at 3 s, the satellite switches in until 4.5 s (onload 0.5 + pull 1); killed at 4 s, it trains nothing,
    switches until its worker is back at 9 s, and is then free, its join completing False; the core alone trains
    0 (4 -> 6), 1 (6 -> 7), 2 (8 -> 14), 3 (14 -> 19)."""
    joined = []

    class JoinOnce(Hand):
        def run(self, c, steps):
            gs = yield from roll_out_two_groups(c)
            h = c.open_step([1], gs)
            j = c.join_step([2])
            j.on_done(lambda j: joined.append((c.now, j.value)))
            return (yield h)

    c = _cluster(_two_groups(), 3, 2, ("kill-trainer@4",), SATELLITE_SEED)
    c.run(JoinOnce(), 1)
    assert _victim(c) == 2, "the seed's kill picks the satellite"
    assert _timeline(c) == [
        ("step_open", 3.0, 0, (1,), 2), ("cell_join", 3.5, 0, (1,)),
        ("note", 4.0, "trainer_fault", {"worker": 2, "version": 0, "in_step": True, "record": False}),
        ("note", 4.0, "cell_lost", {"version": 0, "gpus": [2], "micro": []}),
        ("micro", 6.0, 0, 0, 4.0, 1, 200), ("micro", 7.0, 0, 1, 6.0, 1, 100), ("cell_leave", 9.0, 0, (2,)),
        ("micro", 14.0, 0, 2, 8.0, 1, 600), ("micro", 19.0, 0, 3, 14.0, 1, 500),
        ("step", 19.0, 1, 1, 1400)], _timeline(c)
    assert joined == [(9.0, False)], f"the join completes False once the GPU is free: {joined}"


class TrainThenStream:
    """Group 0 (done at 4 s) trains with `train` on GPU 1 (onload 0.5 s, 300 tokens: 4.5 -> 7.5), so GPU 1's worker
    holds version 1, the only copy; group 1 then streams on the core GPU 1 (nothing to switch in), GPU 2 joining
    at once if `join` (onload 0.5 + pull 1: ready at 9 s)."""

    name = "train-then-stream"

    def __init__(self, join: bool) -> None:
        self.join = join

    def run(self, c, steps):
        gs = yield from roll_out_two_groups(c)
        yield all_of([x.handle for x in gs[0].executions])
        yield c.train([1], gs[:1])
        h = c.open_step([1], gs[1:])
        if self.join:
            c.join_step([2])
        return (yield h)


def test_the_core_killed_mid_step_is_rebuilt_from_the_checkpoint_and_trains_the_step_again():
    """The core alone trains execution 2 from 8 s; killed at 10 s it held the only copy of version 1, so the state
    is rebuilt: without a checkpoint from the starting weights by replaying step 1 (3 s) after the worker's restart
    (5 s): back at 18 s, it trains 2 (18 -> 24) and 3 (24 -> 29); with a checkpoint every step nothing is replayed:
    back at 15 s, the step ends at 26 s."""
    for every, back, replayed in ((0, 18.0, 1), (1, 15.0, 0)):
        c = _cluster(_two_groups(), 3, 1, ("kill-trainer@10",), CORE_SEED, every)
        c.run(TrainThenStream(join=False), 2)
        assert _timeline(c) == [
            ("step", 7.5, 1, 1, 300), ("step_open", 7.5, 1, (1,), 1), ("cell_join", 7.5, 1, (1,)),
            ("note", 10.0, "trainer_fault", {"worker": 1, "version": 1, "in_step": True, "record": True}),
            ("note", 10.0, "cell_lost", {"version": 1, "gpus": [1], "micro": []}),
            ("note", back, "trainer_recovered", {"worker": 1, "version": 1, "from_version": every,
                                                 "replayed": replayed, "recovery_s": back - 10.0}),
            ("cell_join", back, 1, (1,)), ("micro", back + 6, 1, 2, back, 1, 600),
            ("micro", back + 11, 1, 3, back + 6, 1, 500), ("step", back + 11, 2, 1, 1100)], (every, _timeline(c))
        roles = [r[1:] for r in c.log if r[0] == "role" and r[2] == (1,) and 10.0 <= r[1] <= back]
        assert roles == [(10.0, (1,), 3), (back, (1,), 2)], f"the core switches while it recovers: {roles}"


def test_while_the_core_recovers_the_satellite_trains_its_lost_micro_step():
    """With a satellite (ready at 9 s, training execution 3 from 9 to 14 s), the core killed at 10 s loses execution
    2; the satellite takes it at 14 s (-> 20 s) while the core is rebuilt (back at 18 s, idle); the reduction of
    the two cells (1 s) ends the step at 21 s, 8 s before the lone core's 29 s."""
    c = _cluster(_two_groups(), 3, 1, ("kill-trainer@10",), CORE_SEED)
    c.run(TrainThenStream(join=True), 2)
    assert _timeline(c)[3:] == [
        ("cell_join", 9.0, 1, (2,)),
        ("note", 10.0, "trainer_fault", {"worker": 1, "version": 1, "in_step": True, "record": True}),
        ("note", 10.0, "cell_lost", {"version": 1, "gpus": [1], "micro": []}),
        ("micro", 14.0, 1, 3, 9.0, 2, 500),
        ("note", 18.0, "trainer_recovered", {"worker": 1, "version": 1, "from_version": 0, "replayed": 1,
                                             "recovery_s": 8.0}),
        ("cell_join", 18.0, 1, (1,)), ("micro", 20.0, 1, 2, 14.0, 2, 600), ("step", 21.0, 2, 2, 1100)], _timeline(c)


def test_a_kill_during_the_reduction_voids_it_and_the_step_trains_the_lost_cell_s_micro_steps_again():
    """The satellite (asked at 5 s, ready at 6.5 s) trains execution 3 (8 -> 13) and the core 0, 1, 2 (until 14 s);
    the reduction runs 14 -> 15 s. The core killed at 14.5 s voids it and loses 0, 1, 2 (its gradient): the
    satellite trains them again, 14.5 -> 16.5 -> 17.5 -> 23.5, the core is back at 19.5 s (its worker restarted;
    GPU 0 still holds the state of record, version 0), and the reduction of two cells ends the step at 24.5 s."""
    c = _cluster(_two_groups(), 3, 2, ("kill-trainer@14.5",), CORE_SEED)
    c.run(Hand(join_at=5.0), 1)
    assert _victim(c) == 1, "the seed's kill picks the core"
    assert _timeline(c)[5:] == [
        ("micro", 13.0, 0, 3, 8.0, 2, 500), ("micro", 14.0, 0, 2, 8.0, 1, 600),
        ("note", 14.5, "trainer_fault", {"worker": 1, "version": 0, "in_step": True, "record": False}),
        ("note", 14.5, "cell_lost", {"version": 0, "gpus": [1], "micro": [0, 1, 2]}),
        ("micro", 16.5, 0, 0, 14.5, 2, 200), ("micro", 17.5, 0, 1, 16.5, 2, 100),
        ("cell_join", 19.5, 0, (1,)), ("micro", 23.5, 0, 2, 17.5, 2, 600),
        ("step", 24.5, 1, 2, 1400)], _timeline(c)
    assert [r[1] for r in c.log if r[0] == "trained"] == [24.5] * 4, "the batch is trained once, at the step's end"
    voids = [r[1:] for r in c.log if r[0] == "note" and r[2] == "reduction_void"]
    assert voids == [(14.5, "reduction_void", {"version": 0, "lost": [[1]], "errors": []})], voids


def check_micro_steps_from_the_log(log: list[tuple], restart_s: float) -> None:
    """Every trained execution has exactly one micro-step in its version's final successful attempt: a cell's
    micro-steps stand until a "cell_lost" note voids exactly those it trained in the step and still held (not
    handed over by leaving), and the standing ones are one per trained execution. A lost satellite's GPUs switch
    from its loss and are free exactly `restart_s` later; the core of a step is never freed before the step ends."""
    core = {r[2]: r[3] for r in log if r[0] == "step_open"}
    held: dict[tuple[int, int], list[int]] = defaultdict(list)  # (version, cell's first GPU) -> micro-steps it holds
    standing: Counter = Counter()
    lost_at: dict[tuple[int, tuple[int, ...]], float] = {}
    role: dict[int, int] = {}  # GPU -> its role now
    switching: list[tuple[float, tuple[int, ...]]] = []  # lost cells that must be switching once their moment is over
    for r in log + [("end", float("inf"))]:
        for t, gpus in [x for x in switching if r[1] > x[0]]:
            assert all(role[g] == 3 for g in gpus), f"lost cell {gpus} does not switch at {t}"
            switching.remove((t, gpus))
        if r[0] == "role":
            role.update((g, r[3]) for g in r[2])
        elif r[0] == "micro":
            held[(r[2], r[5])].append(r[3])
            standing[r[3]] += 1
        elif r[0] == "cell_leave":
            v, gpus = r[2], r[3]
            held.pop((v, gpus[0]), None)  # handed over (or lost before)
            if (v, gpus) in lost_at:
                assert abs(r[1] - lost_at.pop((v, gpus)) - restart_s) < 1e-9, f"lost cell {gpus} freed at {r[1]}"
            assert gpus != core[v], f"the core of version {v + 1} left its step"
        elif r[0] == "note" and r[2] == "cell_lost":
            v, gpus = r[3]["version"], tuple(r[3]["gpus"])
            assert r[3]["micro"] == held.pop((v, gpus[0]), []), f"cell {gpus} lost other micro-steps than it held"
            for x in r[3]["micro"]:
                standing[x] -= 1
            switching.append((r[1], gpus))
            if gpus != core[v]:
                lost_at[(v, gpus)] = r[1]
    trained = [r[2] for r in log if r[0] == "trained"]
    assert sorted(standing.elements()) == sorted(trained), "one standing micro-step per trained execution"
    assert not lost_at, f"lost satellites never freed: {lost_at}"


STREAMING = [("colocate", {"streaming": True}), ("async", {"streaming": True}), ("waterlevel", {})]
FAULTS = ["random-trainers:1", "random-trainers:3", "random-engines:2", "kill-trainer@20", "kill-trainer@60",
          "kill-engine@15", "delay-sync:5@0", "drop-sync@30"]


@SLOW_OK
@given(seed=st.integers(0, 2**32 - 1), which=st.integers(0, len(STREAMING) - 1), eta=st.integers(0, 2),
       gpus=st.sampled_from([4, 6, 8]), cell=st.sampled_from([1, 2]), gps=st.integers(1, 3), size=st.integers(1, 3),
       mu=st.integers(1, 2), faults=st.lists(st.sampled_from(FAULTS), min_size=1, max_size=3),
       every=st.sampled_from([0, 1]))
def test_streaming_under_faults_invariants_from_the_log(seed, which, eta, gpus, cell, gps, size, mu, faults, every):
    """Random multi-turn workloads with random engine and trainer faults, colocate and async streaming and
    waterlevel, cells of 1-2 GPUs, bursts of 1-2: GPUs conserved (checked run), each group and each execution
    trained once, exactly one micro-step per trained execution standing in the final attempt (from the log),
    every kill respawned, and staleness within the bound."""
    policy, params = STREAMING[which]
    eta = max(eta, mu - 1)
    steps = 3
    groups = _groups(np.random.default_rng(seed), (steps * mu + eta + 3) * gps, size, turns=3, gen=(20, 300),
                     prompt=(50, 200))
    c = _cluster(groups, gpus, gps, tuple(faults), seed % 1000, every)
    c._cell_gpus, c._mu = cell, mu
    pol = make_policy(policy, **params, **({} if policy == "colocate" else {"eta": eta}))
    c.run(pol, steps)
    check_staleness(c.log, mu - 1 if policy == "colocate" else eta, exact=True, mu=mu)
    trained = [r for r in c.log if r[0] == "trained"]
    assert len({r[3] for r in trained}) == steps * gps and len(trained) == len({r[2] for r in trained}), \
        "every group trained once, every execution once"
    check_micro_steps_from_the_log(c.log, FCOSTS.trainer_restart_s)
    notes = Counter(r[3]["fault"] for r in c.log if r[0] == "note" and r[2] == "fault")
    kinds = Counter(r[2] for r in c.log if r[0] == "note")
    assert kinds["engine_fault"] == notes["kill-engine"] and kinds["trainer_fault"] == notes["kill-trainer"], kinds
