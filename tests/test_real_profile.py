"""The real backend's start-up profile: a cost estimate measured on the run's own engine and trainer, stated
in the run's output and log, read by elastic unchanged; a profile, file or switch that gives none a policy
can use is one line, exit 2."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from gyre.bridge.cli import app  # noqa: E402
from gyre.estimate import FILE_FIELDS  # noqa: E402
from gyre.real import profile as P  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.runner import run_real  # noqa: E402
from gyre.real.task_api import load_task  # noqa: E402

CFG = preset_tiny_test()
pytestmark = pytest.mark.xdist_group("ray")


def _max_context() -> int:
    return load_task(CFG.cluster.task_class, CFG.cluster.task, 0).max_context


def test_profile_figures_are_positive_and_finite(pool, monkeypatch):
    """The profile's figures are finite and positive where a cost must be (its prompts' prefill timed), batching
    raises decode throughput, its source says "start-up profile", and the trainer is left at a fresh version 0."""
    monkeypatch.setattr(pool, "startup_profile", None)  # measured here, not taken from an earlier test's run
    est, seconds = P.cluster_estimate(pool, CFG.cluster, _max_context())
    for f in FILE_FIELDS:
        v = getattr(est, f)
        assert math.isfinite(v) and v >= 0, f"{f} = {v!r}"
    assert est.train_s_per_token_gpu > 0 and est.step_a > 0 and est.engine_start_s > 0, est
    assert est.prefill_s_per_token > 0 and est.prefill_s(4, 80, 20) == est.prefill_s_per_token, "prefill timed"
    assert est.decode_tokens_per_s(16, 16 * 20) > est.decode_tokens_per_s(1, 20), "16 sequences decode no faster"
    assert 0 < seconds < 60 and est.source == f"start-up profile, {seconds:.1f} s", (est.source, seconds)
    assert (est.engine_gpus, est.kv_capacity, est.min_train_gpus) == (
        CFG.pool.gpus_per_engine, CFG.cluster.kv_capacity, CFG.cluster.min_train_gpus), "the cluster's sizes"
    assert ray.get(pool.trainers[0].ping.remote()) == 0, "the profile's training steps left the trainer stepped"
    again, s2 = P.cluster_estimate(pool, CFG.cluster, _max_context())
    assert again == est and s2 == seconds, "one profile per pool serves every run on it"


def test_elastic_reads_the_profiled_estimate_and_the_log_states_it(pool):
    """elastic runs unchanged on the profiled estimate: the one it reads is the one the log's cost_estimate
    note records, with its source and the profile's seconds."""
    from gyre.policies import make_policy

    pol = make_policy("elastic")
    r = run_real(dataclasses.replace(CFG, steps=1), pol, pool=pool)
    notes = [x[3] for x in r.log if x[0] == "note" and x[2] == "cost_estimate"]
    assert len(notes) == 1, f"{len(notes)} cost_estimate notes"
    note = notes[0]
    assert pol.est is r.cluster.estimate, "elastic did not read the cluster's estimate"
    assert note["source"].startswith("start-up profile") and note["profile_s"] > 0, note
    assert {k: note[k] for k in FILE_FIELDS} == pol.est.as_dict(), "the log records what the policy read"
    assert len(r.metrics.steps) == 1, "elastic did not finish its step"


def test_gyre_real_states_the_profile_in_its_output(tmp_path):
    """`gyre-real run` (default: a start-up profile) prints the estimate's figures and source before the run."""
    res = CliRunner().invoke(app, ["run", "--policy", "colocate", "--preset", "tiny-test", "--steps", "1",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "cost estimate (start-up profile, " in out and "ms/token x GPU" in out and "tokens/s" in out, out
    log = [json.loads(line) for line in (tmp_path / "log_colocate.jsonl").read_text().splitlines()]
    assert any(x[0] == "note" and x[2] == "cost_estimate" and x[3]["source"].startswith("start-up profile")
               for x in log), "the written log lacks the cost_estimate note"


def test_a_profile_without_decode_steps_exits_2(tmp_path, monkeypatch):
    """An engine that times no decode step gives no estimate: one line naming the start-up profile, exit 2."""
    from gyre.real.pool import ActorPool

    monkeypatch.setattr(P, "_decode", lambda engine, max_context: {"decode": [], "prefill": []})
    monkeypatch.setattr(ActorPool.shared(CFG.pool), "startup_profile", None)
    res = CliRunner().invoke(app, ["run", "--policy", "elastic", "--preset", "tiny-test", "--out", str(tmp_path)])
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())
    assert "cluster.estimate: start-up profile: profile has fewer than 3 decode steps" in line, line
    assert "Traceback" not in res.output, res.output


def test_estimate_none_stops_a_policy_that_reads_one(tmp_path):
    """[cluster] estimate = "none": elastic, which reads the estimate, stops with one line naming the switch."""
    cfg = tmp_path / "none.toml"
    cfg.write_text('preset = "tiny-test"\n[cluster]\nestimate = "none"\n')
    res = CliRunner().invoke(app, ["run", "--policy", "elastic", "--config", str(cfg), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())
    assert "cost estimate: none" in line and "no cost estimate (cluster.estimate = 'none'" in line, line


def test_empty_estimate_switch_is_one_line(tmp_path):
    """An empty [cluster] estimate is neither switch nor file: one line naming the field, before any actor."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text('preset = "tiny-test"\n[cluster]\nestimate = ""\n')
    res = CliRunner().invoke(app, ["run", "--policy", "elastic", "--config", str(cfg), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())
    assert f"{cfg}: cluster: RealClusterConfig.estimate must be 'profile', 'none'" in line, line
