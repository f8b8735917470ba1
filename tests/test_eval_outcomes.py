"""Evaluation outcomes: retry then drop, placeholder, harness and overall timeouts, groups that lose members."""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("ray")

from gyre.real.component_config import ToolConfig  # noqa: E402
from gyre.real.task_api import ToolError  # noqa: E402
from gyre.real.verify import Verifier, outcome_counts  # noqa: E402
from gyre.trajectory import (  # noqa: E402
    AdvantageConfig, PackConfig, Score, TaskRecorder, build_packs, group_advantages,
)


def S(e, r, outcome="valid", truncated=False):
    return Score(execution=e, reward=r, truncated=truncated, outcome=outcome)


def test_advantages_over_the_members_left():
    """Failed and overall-timed-out executions leave (NaN); a placeholder 0 and a harness timeout stay members."""
    adv = group_advantages([S(0, 1.0), S(1, 5.0, "failed"), S(2, 0.0, "placeholder"), S(3, 0.5, truncated=True),
                            S(4, 9.0, "overall_timeout")])
    want = [1.0 - 0.5, math.nan, -0.5, 0.0, math.nan]
    assert np.allclose(adv, want, equal_nan=True), f"advantages {adv}"
    full = group_advantages([S(0, 1.0), S(1, 0.0)])
    assert full.tolist() == [0.5, -0.5], f"all valid: the plain rule {full}"


def test_a_group_left_with_too_few_members_leaves_training():
    """One member left of three (default min 2): every advantage NaN; min_members=1 keeps it (advantage 0)."""
    outs = [S(0, 1.0), S(1, 0.0, "failed"), S(2, 0.0, "overall_timeout")]
    assert np.isnan(group_advantages(outs)).all(), "one member: the group leaves"
    kept = group_advantages(outs, AdvantageConfig(min_members=1))
    assert kept[0] == 0.0 and np.isnan(kept[1:]).all(), f"min_members 1: {kept}"
    with pytest.raises(ValueError, match="Score.outcome of execution 0"):
        S(0, 0.0, "lost")


class Tools:
    """Runs every call at once on the driver (the tool service's contract: done(result or ToolError))."""

    def __init__(self) -> None:
        self.calls = 0

    def call(self, call, done) -> None:
        self.calls += 1
        try:
            done(call.run())
        except ValueError as exc:
            done(ToolError(f"ValueError: {exc}"))


class Task:
    """Fails execution 1 on its first `bad` evaluations (raises for the whole group when `whole`)."""

    def __init__(self, bad: int, whole: bool = False) -> None:
        self.bad, self.whole, self.seen = bad, whole, 0

    def score(self, group):
        self.seen += 1
        if self.seen <= self.bad and self.whole:
            raise ValueError("image pull failed")
        return [S(0, 1.0), S(1, 0.0, "failed") if self.seen <= self.bad else S(1, 0.0),
                S(2, 0.0, "placeholder"), S(3, 0.3, truncated=True)]


def run_verifier(task, retries):
    """Score one group of 4 through a Verifier; returns (scores, log)."""
    log, got = [], []
    ex = [SimpleNamespace(id=i, status="truncated" if i == 3 else "finished") for i in range(4)]
    grp = SimpleNamespace(id=7, task_id=70, env=SimpleNamespace(recorder=SimpleNamespace(executions=ex)))
    v = Verifier(task, Tools(), lambda kind, info: log.append(("note", 0.0, kind, info)), lambda: 0.0, retries)
    v.start(grp)
    v.when([grp], got.append)
    return got[0][0], log


def kinds(log, kind):
    return [r[3] for r in log if r[2] == kind]


def test_a_failure_retried_within_the_budget_is_scored():
    """Execution 1 fails once, budget 1: one score_retry, then every execution scored (attempts 2)."""
    task = Task(bad=1)
    scores, log = run_verifier(task, 1)
    assert [s.outcome for s in scores] == ["valid", "valid", "placeholder", "valid"], scores
    assert [r["failed"] for r in kinds(log, "score_retry")] == [[1]], kinds(log, "score_retry")
    assert kinds(log, "scored")[0]["attempts"] == 2 and not kinds(log, "score_error"), log
    assert task.seen == 2, f"{task.seen} evaluations"


def test_retry_then_drop_and_the_counts():
    """Execution 1 fails 3 times, budget 2: two retries, then it leaves training; the summary counts place each of
    the 4 executions in exactly one outcome."""
    scores, log = run_verifier(Task(bad=3), 2)
    assert [s.outcome for s in scores] == ["valid", "failed", "placeholder", "valid"], scores
    assert len(kinds(log, "score_retry")) == 2 and kinds(log, "score_error")[0]["failed"] == [1], log
    adv = group_advantages(scores)
    assert np.allclose(adv, [1.0 - 1.3 / 3, math.nan, -1.3 / 3, 0.3 - 1.3 / 3], equal_nan=True), adv
    log.append(("note", 0.0, "group_left", {"group": 7, "executions": [1], "whole": False}))
    c = outcome_counts(log)
    assert c == {"eval_valid": 2, "eval_placeholder": 1, "eval_failed": 1, "eval_overall_timeout": 0,
                 "eval_harness_timeouts": 1, "eval_retries": 2, "groups_left_training": 0,
                 "executions_left_training": 1}, c
    assert c["eval_valid"] + c["eval_placeholder"] + c["eval_failed"] + c["eval_overall_timeout"] == 4, "accounting"


def test_a_group_whose_scoring_keeps_raising_leaves_training():
    """The scoring raises on both attempts (budget 1): every execution failed, the group leaves (all NaN)."""
    scores, log = run_verifier(Task(bad=2, whole=True), 1)
    assert [s.outcome for s in scores] == ["failed"] * 4, scores
    err = kinds(log, "score_error")
    assert len(err) == 1 and "image pull failed" in err[0]["message"] and err[0]["failed"] == [0, 1, 2, 3], err
    assert np.isnan(group_advantages(scores)).all(), "the group leaves training"
    assert [s.truncated for s in scores] == [False, False, False, True], "truncation kept from the recorder"


def test_packs_skip_the_executions_that_left():
    """A NaN advantage: none of that execution's branches is trained or packed; the other's are unchanged."""
    rec = TaskRecorder("t", [1, 2])
    for toks in ([3, 4, 5], [6, 7]):
        ex = rec.start()
        ex.append_model(toks, [-0.5] * len(toks), 0)
        ex.finish(0.0)
    cfg = PackConfig(max_tokens=64, normalization="sequence")
    b = build_packs([rec.tree], [np.array([0.5, math.nan])], cfg)
    rows = b.packs[0].rows
    assert rows.execution.tolist() == [0, 0, 0] and rows.target.tolist() == [3, 4, 5], rows
    assert np.allclose(rows.weight, 1 / 3), f"execution 0 alone: weights {rows.weight}"
    assert b.stats.kept_tokens == 5 and b.stats.packed_tokens == 5, b.stats


def test_bad_retry_budget_names_the_field():
    """A retry budget < 0 is refused with the field's name."""
    with pytest.raises(ValueError, match="ToolConfig.eval_retries must be an integer >= 0, got -1"):
        ToolConfig(eval_retries=-1)


@pytest.mark.parametrize("toml, needle", [
    ("[cluster.tools]\neval_retries = -1\n", "cluster.tools: ToolConfig.eval_retries must be an integer >= 0"),
    ("[pool.trainer_config.sampling]\nmode = 'roles'\nj_max = 0\n", "SamplingConfig.j_max must be an integer >= 1"),
    ("[pool.trainer_config.sampling]\nrole_priority = ['main', 'judge', 'sub-agent', 'sub-agent-summary']\n",
     "unknown role 'judge'"),
])
def test_real_cli_refuses_bad_budgets_and_sampling(tmp_path, toml, needle):
    """gyre-real run with a bad retry budget, J_max or role: exit 2, one line naming the field, before Ray."""
    from typer.testing import CliRunner

    from gyre.real.cli import app

    p = tmp_path / "bad.toml"
    p.write_text(toml)
    res = CliRunner().invoke(app, ["run", "--policy", "colocate", "--config", str(p), "--out", str(tmp_path / "o")])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and needle in res.output and len(lines) == 1, f"exit {res.exit_code}: {res.output}"


def test_trainer_draws_the_same_paths_per_version_and_skips_a_step_with_nothing_to_train():
    """The trainer's role sampling is a function of (seed, version): two trainers of one seed train the same
    paths and end with the same weights; a batch whose every execution left training moves no weight (the
    version still advances)."""
    import torch

    from gyre.real.config import preset_tiny_test
    from gyre.real.trainer import Trainer
    from gyre.trajectory import SamplingConfig, group_advantages, score_group
    from test_trajectory_pack import random_group
    from gyre.real import task as T

    cfg = preset_tiny_test()
    tc = dataclasses.replace(cfg.pool.trainer_config, epochs=1, sampling=SamplingConfig(mode="roles", j_max=1))
    rng = np.random.default_rng(4)
    batch = []
    for _ in range(2):
        rec, _ = random_group(rng, 4, 10, vocab=T.VOCAB_SIZE)
        batch.append((rec.tree.preorder(), group_advantages(score_group(rec, lambda s: 0.1 * s.generated_tokens))))
    a, b = Trainer(cfg.pool.model, tc, seed=2), Trainer(cfg.pool.model, tc, seed=2)
    sa, sb = a.train(batch), b.train(batch)
    assert sa["paths"] == sb["paths"] == 8 and sa["rows"] == sb["rows"], (sa, sb)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), f"{n}: same seed and version, other weights"
    before = [p.detach().clone() for p in a.model.parameters()]
    gone = [(pre, np.full(adv.shape, math.nan)) for pre, adv in batch]
    s = a.train(gone)
    assert s["rows"] == 0 and s["epochs"] == 0 and s["version"] == 2, s
    assert all(torch.equal(x, p) for x, p in zip(before, a.model.parameters())), "an empty batch moved weights"
