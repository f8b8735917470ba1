"""Rewards off the driver: a finished group is scored on the tool workers, its step waits for it, a failure that
outlasts its retries leaves training."""

from __future__ import annotations

import dataclasses
import os
import types

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from gyre.real.agent import AgentTask  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.task_api import ToolError  # noqa: E402
from gyre.real.verify import Verifier  # noqa: E402
from gyre.trajectory import Score  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")


class RemoteOnly(AgentTask):
    """The agent task, whose scoring refuses to run in the process that built it and fails for task 1."""

    def __init__(self, config, seed: int) -> None:
        super().__init__(config, seed)
        self.home = os.getpid()

    def score(self, group):
        if os.getpid() == self.home:
            raise AssertionError("scored on the driver")
        if group.spec.task_id == 1:
            raise ValueError("verifier down for task 1")
        return super().score(group)


def test_groups_are_scored_on_tool_workers_before_their_step_and_a_failed_scoring_leaves_training(pool):
    """Each group is sent for scoring when its last execution finishes and is scored (off the driver) before its
    train step is enqueued; the group whose verifier raises is retried once, then gets a score_error note naming
    it, every execution "failed" and a group_left note, and the run trains every step."""
    from gyre.real.runner import run_real

    cfg = preset_tiny_test()
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, task_class=f"{__name__}:RemoteOnly"))
    r = run_real(cfg, "colocate", pool=pool)
    log = r.log
    assert len(r.metrics.steps) == cfg.steps, f"{len(r.metrics.steps)} steps of {cfg.steps}"
    notes = lambda kind: [x for x in log if x[0] == "note" and x[2] == kind]  # noqa: E731
    group_of = {x[3]["exec"]: x[3]["group"] for x in notes("reward")}
    last_finish = {}
    for x in log:
        if x[0] == "finish":
            last_finish[group_of[x[2]]] = x[1]
    sent = {x[3]["group"]: x[1] for x in notes("verify")}
    scored = {x[3]["group"]: (x[1], x[3]["rewards"]) for x in notes("scored")}
    assert set(sent) == set(scored) == set(last_finish), f"sent {sent}, scored {scored}, groups {last_finish}"
    for g, t in sent.items():
        assert t >= last_finish[g] and t <= scored[g][0], f"group {g}: finished {last_finish[g]}, sent {t}, scored {scored[g]}"
    batches = notes("train_batch")
    assert len(batches) == cfg.steps, f"train batches {batches}"
    for b in batches:
        late = [g for g in b[3]["groups"] if scored[g][0] > b[1]]
        assert not late, f"step {b[3]['version']} enqueued at {b[1]:.2f}s before groups {late} were scored"
    task1 = [g for g, grp in r.cluster.groups.items() if grp.task_id == 1]
    errors = notes("score_error")
    assert [(e[3]["group"], e[3]["task"]) for e in errors] == [(task1[0], 1)], f"score errors {errors}"
    assert "verifier down for task 1" in errors[0][3]["message"], errors[0][3]["message"]
    assert scored[task1[0]][1] == [0.0] * cfg.cluster.group_size, f"failed group's rewards {scored[task1[0]]}"
    outcomes = {x[3]["group"]: x[3]["outcomes"] for x in notes("scored")}
    assert outcomes[task1[0]] == ["failed"] * cfg.cluster.group_size, f"failed group's outcomes {outcomes}"
    assert [x[3]["group"] for x in notes("score_retry")] == [task1[0]], "one retry of the failed group"
    left = [(x[3]["group"], x[3]["whole"]) for x in notes("group_left")]
    assert left == [(task1[0], True)], f"groups that left training {left}"
    assert not any("driver" in e[3]["message"] for e in errors), "a group was scored on the driver"


class InlineTools:
    """Tool service stand-in: runs a call at once, or answers the ToolError of `fail` for the calls it names."""

    def __init__(self) -> None:
        self.held: list = []

    def call(self, call, done) -> None:
        self.held.append((call, done))

    def answer(self, i: int, error: str | None = None) -> None:
        call, done = self.held[i]
        done(ToolError(error) if error else call.run())


class Fixed:
    def __init__(self, rule=None) -> None:
        if rule is not None:
            self.score_failed = rule

    def score(self, group):
        return [Score(execution=0, reward=float(group.value), truncated=False)]


@dataclasses.dataclass
class G:  # a RealGroup's face: id, task_id, env (the task's group)
    id: int
    task_id: int
    env: object


@dataclasses.dataclass
class Env:
    value: float
    # one finished execution (what the verifier reads of a group: its executions' ids and status)
    recorder: object = dataclasses.field(default_factory=lambda: types.SimpleNamespace(
        executions=[types.SimpleNamespace(id=0, status="finished")]))


def test_steps_take_their_scores_in_the_order_asked_and_the_task_rule_scores_a_failure():
    """Scores arriving out of order release the waiting steps in the order they were asked for; a failed
    scoring (no retries left) takes the task's score_failed rule."""
    tools, log, got = InlineTools(), [], []
    rule = lambda group, message: [Score(execution=0, reward=-1.0, truncated=False)]  # noqa: E731
    v = Verifier(Fixed(rule), tools, lambda kind, info: log.append((kind, info)), lambda: 0.0, retries=0)
    groups = [G(i, 10 + i, Env(i)) for i in range(3)]
    for g in groups:
        v.start(g)
    v.when(groups[:2], lambda s: got.append(("a", [x[0].reward for x in s])))
    v.when(groups[2:], lambda s: got.append(("b", [x[0].reward for x in s])))
    tools.answer(2)
    assert got == [], f"the second step ran before the first: {got}"
    tools.answer(1, "tool call timed out after 60s (attempt 2 of 2)")
    tools.answer(0)
    assert got == [("a", [0.0, -1.0]), ("b", [2.0])], f"released {got}"
    errs = [i for k, i in log if k == "score_error"]
    assert errs == [{"group": 1, "task": 11, "message": "tool call timed out after 60s (attempt 2 of 2)",
                     "failed": [0]}], errs
