"""Cluster.trained_share: what the latest finished step trained over exact training of its batch (simulator)."""

from __future__ import annotations

import dataclasses

import pytest

from gyre.cluster import Role
from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.cluster.backend import SimCluster
from gyre.sim.harness.runner import simulate
from gyre.trajectory import SamplingConfig
from gyre.workload import GroupSpec, ReplaySource
from tests.simkit import ROUND_COSTS, spec, workload

J1 = SamplingConfig(mode="roles", j_max=1)


class OneEngineOneTrainer:
    """GPU 0 rolls out each group, GPU 1 trains it; `seen` gets (version, trained_share) before each step and at
    the end."""

    name = "one-one"

    def __init__(self) -> None:
        self.seen: list[tuple[int, tuple[float, float]]] = []

    def run(self, cluster, steps):
        eng = yield cluster.start_engine([0])
        for _ in range(steps):
            grp = cluster.next_group()
            yield from (h for h in [cluster.admit(x, eng) for x in grp.executions])
            self.seen.append((cluster.version, cluster.trained_share))
            yield cluster.train([1], [grp])
        self.seen.append((cluster.version, cluster.trained_share))


def _hand_run(sampling: SamplingConfig):
    """Group 0: one execution of 4 turns (gen 3, 4, 5, 6; 5 tool tokens per call; prompt 10) compacted at turn 2:
    two paths, (turns 0-1, main-summary) and (turns 2-3, main). Group 1: one execution of 2 turns, one path."""
    a = dataclasses.replace(spec(0, 0, [3, 4, 5, 6], prompt=10, tool_out=[5, 5, 5]), branches=[(2, "compact")])
    b = spec(1, 1, [3, 4], prompt=10, tool_out=[5])
    groups = [GroupSpec(group_id=i, task_id=i, step=i, executions=[x]) for i, x in enumerate((a, b))]
    c = SimCluster(n_gpus=2, costs=ROUND_COSTS, source=ReplaySource(groups, workload(1, 1)), check=True,
                   sampling=sampling)
    pol = OneEngineOneTrainer()
    c.run(pol, 2)
    return c, pol.seen


def _train_spans(log) -> list[float]:
    """Seconds GPU 1 spent in role TRAIN, span by span, from the role records."""
    spans, since = [], None
    for rec in log:
        if rec[0] == "role" and 1 in rec[2]:
            if since is not None:
                spans.append(rec[1] - since)
                since = None
            if rec[3] == int(Role.TRAIN):
                since = rec[1]
    return spans


def test_j_max_1_share_by_hand():
    """J_max 1 on group 0 trains its final main context: prompt 10 + turn 2 (5 + 5 tool) + turn 3 (6) = 26 of
    its 10 + 18 + 15 = 43 tokens, and attention 50 (prompt) + 320 (turn 2: 5 x 27 + 12.5 + 5 x 32 + 12.5) + 240
    (turn 3: 6 x 37 + 18) = 610 of 610 + 112 + 202.5 = 924.5; group 1 (10 + 3 + 5 + 4 = 22 tokens) has one path:
    all of it, share 1."""
    c, seen = _hand_run(J1)
    assert seen[0] == (0, (1.0, 1.0)), f"before any step: {seen[0]}"
    assert seen[1][0] == 1 and seen[1][1] == pytest.approx((26 / 43, 610 / 924.5), rel=1e-12), f"step 1: {seen[1]}"
    assert seen[2] == (2, (1.0, 1.0)), f"step 2 (one path): {seen[2]}"
    steps = [rec[4] for rec in c.log if rec[0] == "step"]
    assert steps == [26, 22], f"trained tokens booked per step: {steps}"
    # ROUND_COSTS: 0.01 s per token on one GPU, attention free: the charged step is what the share counts
    assert _train_spans(c.log) == pytest.approx([0.26, 0.22]), f"GPU 1's TRAIN spans {_train_spans(c.log)}"


def test_exact_training_shares_one_after_every_step():
    """Exact training: trained_share is exactly (1.0, 1.0) before and after each step, group 0's 43 tokens train."""
    c, seen = _hand_run(SamplingConfig())
    assert seen == [(0, (1.0, 1.0)), (1, (1.0, 1.0)), (2, (1.0, 1.0))], seen
    assert [rec[4] for rec in c.log if rec[0] == "step"] == [43, 22], "exact training trains every token"


class Watch:
    """Runs `inner` unchanged; records trained_share per version as the policy sees it at each of its yields."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.shares = inner, inner.name, {}

    def run(self, cluster, steps):
        gen, value = self.inner.run(cluster, steps), None
        while True:
            self.shares[cluster.version] = cluster.trained_share
            try:
                h = gen.send(value)
            except StopIteration as stop:
                self.shares[cluster.version] = cluster.trained_share
                return stop.value
            value = yield h


@pytest.mark.parametrize("streaming", [False, True])
def test_share_is_the_step_logs_trained_over_the_exact_runs_tokens(streaming):
    """xlong-swe-small with sub-agents and retries frequent, colocate (streaming or not), 2 steps: after step k
    the J_max 1 run's token share is its "step" record's tokens over those of the exact run of the same seed
    (same batches: the "trained" records name the same executions), below 1; the exact run's is (1.0, 1.0)."""
    from gyre.policies.colocate import Colocate

    base = override(get_preset("xlong-swe-small"), **{"steps": 2, "workload.subagent_p": 0.05,
                                                      "workload.retry_p": 0.05, "workload.groups_per_step": 2})
    runs = {}
    for name, samp in (("exact", SamplingConfig()), ("j1", J1)):
        w = Watch(Colocate(streaming=streaming))
        r = simulate(dataclasses.replace(base, sampling=samp), w)
        runs[name] = (w.shares, [rec[4] for rec in r.log if rec[0] == "step"],
                      sorted((rec[4], rec[2]) for rec in r.log if rec[0] == "trained"))
    (sx, tx, bx), (s1, t1, b1) = runs["exact"], runs["j1"]
    assert bx == b1, "the two runs trained other executions per version"
    assert sx == {0: (1.0, 1.0), 1: (1.0, 1.0), 2: (1.0, 1.0)}, f"exact shares {sx}"
    for k in (1, 2):
        assert s1[k][0] == pytest.approx(t1[k - 1] / tx[k - 1], rel=1e-12), f"step {k}: {s1[k]} vs {t1}/{tx}"
        assert s1[k][0] < 1 and 0 < s1[k][1] < 1, f"step {k}: J_max 1 trained everything? {s1[k]}"


class _Blind:
    """The cluster with trained_share pinned to (1.0, 1.0): elastic predicting from exact training's counts."""

    trained_share = (1.0, 1.0)

    def __init__(self, cluster) -> None:
        self._cluster = cluster

    def __getattr__(self, name):
        return getattr(self._cluster, name)


def test_elastic_predicts_a_sampled_step_end_closer_with_the_share():
    """xlong-swe-small, sub-agents and retries at 5%, J_max 1, 6 steps: the "elastic_train" note's predicted step end
    minus the "step" record's time is smaller in median over steps 2-6 with trained_share than with it pinned to 1
    (step 1, with no step to observe, is predicted alike)."""
    from gyre.policies.elastic import Elastic

    cfg = override(get_preset("xlong-swe-small"), **{"steps": 6, "workload.subagent_p": 0.05, "workload.retry_p": 0.05})
    cfg = dataclasses.replace(cfg, sampling=J1)

    class Blind(Elastic):
        def run(self, cluster, steps):
            return super().run(_Blind(cluster), steps)

    err = {}
    for name, pol in (("observed", Elastic()), ("blind", Blind())):
        log = simulate(cfg, pol).log
        notes = [x[3]["step_end"] for x in log if x[0] == "note" and x[2] == "elastic_train"]
        ends = [x[1] for x in log if x[0] == "step"]
        assert len(notes) == len(ends) == 6, f"{name}: {len(notes)} predictions, {len(ends)} steps"
        err[name] = [p - e for p, e in zip(notes, ends)]
    assert err["observed"][0] == err["blind"][0], err
    med = {k: sorted(abs(x) for x in v[1:])[2] for k, v in err.items()}
    assert med["observed"] < med["blind"] / 4, f"median |predicted - actual| over steps 2-6: {med}"
