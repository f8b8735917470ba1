"""Rollout-length foresight: recurring tasks, predictors, ordered admission, per-token version lag."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.cluster import Phase
from gyre.policies.admission import ForesightParams, OrderedAdmission
from gyre.policies.foresight import History, HistorySiblings, Predictor, spearman, top_share
from gyre.presets import xlong_swe
from gyre.sim.harness.runner import simulate
from gyre.workload import GroupSpec, WorkloadSource, sample_group
from tests.simkit import cluster, spec, tiny_config


# ---------------------------------------------------------------------------- recurring tasks
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


# ---------------------------------------------------------------------------- predictors (stand-ins)
@dataclass
class X:
    id: int
    turns_done: int
    phase: Phase = Phase.DONE


@dataclass
class G:
    id: int
    task_id: int
    executions: list = field(default_factory=list)


def _observe(p: Predictor, gid: int, task: int, turns: list[int]) -> None:
    xs = [X(gid * 10 + i, t) for i, t in enumerate(turns)]
    p.admitted(G(gid, task, xs))
    for x in xs:
        p.finished(gid, x)


def test_history_ranks_known_long_tasks_above_unknown_above_known_short():
    """history: a task's earlier groups set its score; an unseen task scores the mean over finished groups."""
    p = History()
    assert p.group(G(0, 7)) == 0.0, "no observation yet: no opinion"
    _observe(p, 0, 7, [9, 99])
    assert p.group(G(1, 7)) == pytest.approx(100.0), "one group: predicted longest = its longest (turns + 1)"
    _observe(p, 1, 8, [0, 0])
    long, unknown, short = p.group(G(2, 7)), p.group(G(3, 9)), p.group(G(4, 8))
    mean7, mean8 = (math.log(10) + math.log(100)) / 2, 0.0
    ratio = ((math.log(100) - mean7) + 0.0) / 2
    assert long == pytest.approx(math.exp(mean7 + ratio))
    assert unknown == pytest.approx(math.exp((mean7 + mean8) / 2 + ratio))
    assert long > unknown > short


def test_history_weighs_recent_epochs_more():
    p = History()
    _observe(p, 0, 1, [9, 9])  # log 10
    _observe(p, 1, 1, [999, 999])  # log 1000, the latest epoch
    assert p.estimate(1) == pytest.approx((0.5 * math.log(10) + math.log(1000)) / 1.5)


def test_siblings_raise_a_task_whose_live_group_runs_long():
    """history+siblings: running siblings' turns so far are a lower bound that lifts the history estimate."""
    hist, sib = History(), HistorySiblings()
    for p in (hist, sib):
        _observe(p, 0, 3, [9, 9])
        live = G(1, 3, [X(10, 499, Phase.TOOL), X(11, 0, Phase.DECODE)])
        p.admitted(live)
    assert hist.estimate(3) == pytest.approx(math.log(10))
    assert sib.estimate(3) == pytest.approx((math.log(500) + math.log(1)) / 2)
    live.executions[0].turns_done = 1  # below history: history wins
    assert sib.estimate(3) == pytest.approx(math.log(10))


def test_quality_scores_match_independent_references():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    a = rng.integers(0, 20, 200).astype(float)
    p = a + rng.normal(0, 5, 200)
    assert spearman(p, a) == pytest.approx(spearmanr(p, a).statistic)
    assert math.isnan(spearman(np.zeros(5), np.arange(5.0))), "a constant prediction has no rank correlation"
    actual = np.arange(40.0)
    assert top_share(actual, actual) == 1.0
    assert top_share(-actual, actual) == 0.0
    pred = actual.copy()
    pred[39], pred[0] = 0.0, 39.0  # the longest swapped with the shortest: 1 of the top 2 found
    assert top_share(pred, actual) == 0.5


# ---------------------------------------------------------------------------- ordered admission (stand-in cluster)
class StubCluster:
    groups_per_step = 2

    def __init__(self, tasks: list[int]) -> None:
        self.tasks, self.drawn, self.notes = tasks, 0, []

    def next_group(self):
        g = G(self.drawn, self.tasks[self.drawn], [X(100 * self.drawn, 0, Phase.QUEUED)])
        self.drawn += 1
        return g

    def note(self, kind, **fields):
        self.notes.append((kind, fields))


def test_none_keeps_drawn_order_and_draws_nothing_ahead():
    c = StubCluster(list(range(8)))
    order = OrderedAdmission(c, steps=4, params=ForesightParams())
    for i in range(8):
        assert order.next_group().id == i and c.drawn == i + 1, "none must pass groups through one by one"


def test_longest_predicted_first_within_each_window_never_past_the_run():
    """history: within a window of lookahead steps, known-long tasks first, unknown ones (the mean) in drawn
    order, known-short last; the next window is drawn only once this one is admitted, never past the run."""
    tasks = [0, 1, 2, 3, 4, 5, 0, 1, 3, 3]  # 4 steps of 2 groups (the last two never drawn)
    c = StubCluster(tasks)
    order = OrderedAdmission(c, steps=4, params=ForesightParams(predictor="history", lookahead=3))
    for gid, task, turns in [(100, 3, [999]), (101, 1, [499]), (102, 0, [0])]:
        _observe(order.predictor, gid, task, turns)
    first = [order.next_group().id for _ in range(6)]
    assert c.drawn == 6 and first == [3, 1, 2, 4, 5, 0], first
    rest = [order.next_group().id for _ in range(2)]
    assert c.drawn == 8 and rest == [7, 6], f"drew {c.drawn}, order {rest}"


# ---------------------------------------------------------------------------- the simulator
@pytest.mark.invariants
@given(seed=st.integers(0, 10_000), eta=st.integers(0, 2), lookahead=st.integers(1, 3),
       predictor=st.sampled_from(["history", "history+siblings"]), policy=st.sampled_from(["async"]))
@settings(deadline=None)
def test_ordered_admission_loses_nothing_and_keeps_the_bound(seed, eta, lookahead, predictor, policy):
    """With a predictor: every drawn group is trained exactly once (the same groups as drawn order), no
    execution lost or repeated, staleness <= eta, and every token's lag within [0, its execution's staleness]."""
    cfg = tiny_config(gpus=6, seed=seed, steps=4)
    cfg = replace(cfg, workload=replace(cfg.workload, task_set=4, task_epoch_corr=0.9))
    r = simulate(cfg, policy, {"eta": eta, "predictor": predictor, "lookahead": lookahead}, check=True)
    log = r.log
    admitted = [x[2] for x in log if x[0] == "admit"]
    trained = [x for x in log if x[0] == "trained"]
    assert len(admitted) == len(set(admitted)) == len(trained) == len({x[2] for x in trained}), "lost or repeated"
    assert r.metrics.extra["trained_other_groups"] == 0, "ordered admission trained other groups than drawn order"
    gen = {x[2]: x[4] for x in log if x[0] == "finish"}
    for x in trained:
        assert x[5] <= eta, f"staleness {x[5]} > eta {eta}"
        assert x[7] == gen[x[2]], "lag counted over other tokens than the execution generated"
        assert -1e-6 <= x[6] <= x[5] * x[7] + 1e-6, f"token lag {x[6]} outside [0, {x[5]} x {x[7]}]"
    notes = [x[3] for x in log if x[0] == "note" and x[2] == "foresight"]
    assert len(notes) == 1 and notes[0]["groups"] == cfg.steps * cfg.workload.groups_per_step, notes


def test_none_predictor_leaves_the_run_unchanged():
    """The default (no predictor) gives the same event log as a policy without ordered admission would:
    groups drawn one at a time, no foresight note."""
    cfg = tiny_config(seed=5, steps=3)
    a = simulate(cfg, "async", {"eta": 1}).log
    b = simulate(cfg, "async", {"eta": 1, "predictor": "none", "lookahead": 7}).log
    assert a == b and not any(x[0] == "note" and x[2] == "foresight" for x in a)


class SyncMidSegment:
    """Group 1's short execution finishes, is trained (version 1) and the engine syncs while group 0's long
    execution decodes: its tokens before the sync are version 0's, after it version 1's."""

    name = "sync-mid-segment"

    def run(self, cluster, steps):
        e = yield cluster.start_engine([0])
        g0, g1 = cluster.next_group(), cluster.next_group()
        long = cluster.admit(g0.executions[0], e)
        yield cluster.admit(g1.executions[0], e)
        yield cluster.train([1], [g1])
        yield cluster.sync([e])
        yield long
        yield cluster.train([1], [g0])


def test_token_lag_splits_a_segment_at_a_mid_segment_sync():
    """Exact per-token lag: tokens decoded before the sync pause (100 tokens/s from the start) lag 1 version."""
    c = cluster([GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, [1000])]),
                 GroupSpec(group_id=1, task_id=1, step=0, executions=[spec(1, 1, [100])])], n_gpus=2, groups_per_step=1)
    c.run(SyncMidSegment(), 2)
    start = next(x[1] for x in c.log if x[0] == "start" and x[2] == 0)
    sync_end = next(x[1] for x in c.log if x[0] == "sync")
    before = (sync_end - 1.0 - start) * 100  # sync_s = 1: the engine pauses for the last second
    rec = {x[2]: x for x in c.log if x[0] == "trained"}
    assert 0 < before < 1000, f"the sync did not fall mid-segment: {before}"
    assert rec[0][4:] == (1, 1, pytest.approx(before), 1000), rec[0]
    assert rec[1][4:] == (0, 0, 0, 100), rec[1]
    counts = Counter(x[0] for x in c.log)
    assert counts["trained"] == 2 and counts["finish"] == 2


@pytest.mark.parametrize("policy", ["async"])
def test_without_recurring_tasks_a_predictor_degrades_to_drawn_order(policy):
    """Every task is new, so every group scores the same: the same admissions at the same times as none."""
    cfg = tiny_config(seed=11, steps=4)
    runs = [simulate(cfg, policy, {"eta": 2, "predictor": p, "lookahead": 2}) for p in ("none", "history+siblings")]
    admits = [[x for x in r.log if x[0] in ("admit", "finish", "step")] for r in runs]
    assert admits[0] == admits[1], f"{policy}: a predictor with nothing to go on changed the schedule"


# ---------------------------------------------------------------------------- park and resume
@pytest.mark.invariants
@given(seed=st.integers(0, 10_000), eta=st.integers(0, 2), period=st.sampled_from([2.0, 10.0, 40.0]))
@settings(deadline=None)
def test_parking_loses_nothing_and_keeps_every_token_within_the_bound(seed, eta, period):
    """Executions parked at random tool-call boundaries and resumed on random engines: every admitted execution
    finishes and is trained exactly once, parks and resumes pair up, staleness <= eta, every token's lag is
    within [0, its execution's staleness], and the lag counts exactly the tokens it generated."""
    from tests.simkit import ParkingAsync

    cfg = tiny_config(gpus=6, seed=seed, steps=3)
    r = simulate(cfg, ParkingAsync(eta, seed, period), check=True)
    log = r.log
    kinds = Counter(x[0] for x in log)
    admitted = Counter(x[2] for x in log if x[0] == "admit")
    finished = Counter(x[2] for x in log if x[0] == "finish")
    trained = {x[2]: x for x in log if x[0] == "trained"}
    assert max(admitted.values()) == max(finished.values()) == 1, "an execution restarted or finished twice"
    assert set(admitted) == set(finished) == set(trained), "an execution was lost"
    assert kinds["trained"] == len(trained), "an execution was trained twice"
    assert kinds["park"] == kinds["resume"], f"{kinds['park']} parks, {kinds['resume']} resumes"
    assert not r.metrics.extra["trained_other_groups"]
    gen = {x[2]: x[4] for x in log if x[0] == "finish"}
    for x in trained.values():
        assert x[5] <= eta and x[7] == gen[x[2]], x
        assert -1e-6 <= x[6] <= x[5] * x[7] + 1e-6, f"token lag {x[6]} outside [0, {x[5]} x {x[7]}]"


def test_a_parked_execution_resumes_where_it_stopped():
    """Exact timeline: parked during its tool call (KV freed), resumed on the other engine after the tool
    returned, it re-prefills there and decodes its last segment; its tokens are all counted once."""

    class ParkOnce:
        name = "park-once"

        def run(self, cluster, steps):
            from gyre.handles import all_of

            a, b = yield all_of([cluster.start_engine([0]), cluster.start_engine([1])])
            g = cluster.next_group()
            x = g.executions[0]
            done = cluster.admit(x, a)
            yield cluster.timeout(2.0)  # t = 5: its first segment (100 tokens at 100/s) ended at 4, tool until 14
            parked = yield cluster.park(x)
            assert parked and cluster.parked() == [x] and x.phase == Phase.PARKED and a.kv_used == 0
            yield cluster.timeout(20.0)
            yield cluster.resume(x, b)
            yield done
            yield cluster.train([2], [g])

    c = cluster([GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, [100, 300], tool_s=[10.0])])],
                n_gpus=3, groups_per_step=1)
    c.run(ParkOnce(), 1)
    got = [(x[0], x[1], *x[2:4]) for x in c.log if x[0] in ("start", "park", "resume", "finish")]
    assert got == [("start", 3.0, 0, 0), ("park", 5.0, 0, 0), ("resume", 25.0, 0, 1), ("finish", 28.0, 0, 0)], got
    trained = next(x for x in c.log if x[0] == "trained")
    assert trained[4:] == (0, 0, 0, 400), trained
