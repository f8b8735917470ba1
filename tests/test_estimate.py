"""The cost estimate a policy may observe: the simulator's is what it charges; a calibration file is read
exactly, and a missing, negative or non-finite figure is one line naming it (exit 2 from gyre-real)."""

from __future__ import annotations

import json
import math

import pytest

from gyre.estimate import FILE_FIELDS, CostEstimate, EstimateError, batch_counts, from_costs, from_file, write_file
from gyre.hardware import group_train_attention_ctx
from gyre.presets import get_preset
from gyre.sim.cluster.backend import SimCluster
from gyre.workload import WorkloadSource


def test_simulator_estimate_is_what_it_charges():
    """Cluster.estimate on the simulator: a training step's seconds are those the simulator charges for the
    same counts, decode throughput is sequences over the engine step, and sizes are the cluster's."""
    cfg = get_preset("xlong-swe-kv")
    costs = cfg.costs()
    sim = SimCluster(n_gpus=cfg.cluster.gpus, costs=costs, source=WorkloadSource(cfg.workload, 0))
    est = sim.estimate
    g = WorkloadSource(cfg.workload, 0).next_group()
    tokens = g.executions[0].prompt + sum(e.tokens - e.prompt for e in g.executions)
    attn = group_train_attention_ctx(g.executions)
    for gpus in (384, 992):
        assert est.train_s(tokens, attn, gpus) == pytest.approx(costs.train_time(tokens, gpus, attn), rel=1e-12)
    assert est.decode_tokens_per_s(8, 8 * 500_000) == pytest.approx(8 / costs.step_time(8, 8 * 500_000))
    assert (est.kv_capacity, est.engine_gpus, est.min_train_gpus) == (
        costs.kv_capacity_tokens, sim.gpus_per_engine, sim.min_train_gpus), "sizes are the cluster's"
    assert est.train_s(tokens, attn, 992) < est.train_s(tokens, attn, 384), "more GPUs train faster"
    assert est.decode_tokens_per_s(0, 0) == 0.0, "no sequence, no throughput"


def test_batch_counts_by_hand():
    """Trained tokens are trajectory tokens; attention is L x min(L, largest context) / 2 per sequence."""

    class X:
        def __init__(self, n):
            self.trajectory_tokens = n

    assert batch_counts([X(10), X(4)]) == (14.0, 0.5 * 100 + 0.5 * 16), "no compaction seen"
    assert batch_counts([X(10)], max_context=6) == (10.0, 0.5 * 10 * 6), "compacted at 6"


def test_file_round_trip(tmp_path):
    """A calibration file holds exactly the fields the estimate reads, and reads back to the same figures."""
    est = from_costs(get_preset("short-math").costs())
    p = tmp_path / "est.json"
    write_file(est, p)
    assert set(json.loads(p.read_text())) == set(FILE_FIELDS), "the file form is every field"
    back = from_file(p)
    assert back.train_s(1e6, 1e9, 8) == pytest.approx(est.train_s(1e6, 1e9, 8)), "training read back"
    assert back.step_s(4, 4000) == pytest.approx(est.step_a + est.step_b * 4 + est.step_c * 4000), "the line"
    assert str(p) in back.describe(), "the run's output names where the figures come from"


@pytest.mark.parametrize("field,value,why", [
    ("train_s_per_token_gpu", -1.0, "finite number >= 0"), ("step_c", float("nan"), "finite number >= 0"),
    ("engine_start_s", float("inf"), "finite number >= 0"), ("train_s_per_token_gpu", 0.0, "must be > 0"),
    ("kv_capacity", 0, "must be >= 1"), ("step_a", "fast", "finite number >= 0"),
])
def test_bad_estimate_is_one_line(tmp_path, field, value, why):
    """A negative, non-finite, zero or non-number figure: one EstimateError line naming the file and field."""
    data = from_costs(get_preset("short-math").costs()).as_dict()
    data[field] = value
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data).replace("NaN", "NaN").replace("Infinity", "Infinity"))
    with pytest.raises(EstimateError, match=field) as exc:
        from_file(p)
    assert why in str(exc.value) and str(p) in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_missing_field_and_file(tmp_path):
    """A missing field, an unknown field and a missing file each name themselves in one line."""
    data = from_costs(get_preset("short-math").costs()).as_dict()
    del data["step_b"]
    p = tmp_path / "est.json"
    p.write_text(json.dumps(data))
    with pytest.raises(EstimateError, match="step_b is missing"):
        from_file(p)
    p.write_text(json.dumps({**data, "step_b": 0.0, "speed": 1}))
    with pytest.raises(EstimateError, match="unknown cost estimate field 'speed'"):
        from_file(p)
    with pytest.raises(EstimateError, match="nope.json"):
        from_file(tmp_path / "nope.json")
    assert math.isfinite(CostEstimate(**{**data, "step_b": 0.0}).step_s(1, 0)), "a valid one builds"


def test_real_preset_estimate_reads():
    """The tiny-cpu preset's calibration file is a valid estimate (what `gyre-real run` states)."""
    from gyre.real.config import get_preset as real_preset

    cfg = real_preset("tiny-cpu")
    est = from_file(cfg.cluster.estimate)
    assert est.train_s_per_token_gpu > 0 and est.decode_tokens_per_s(1, 0) > 0, est.describe()


def test_gyre_real_bad_estimate_exits_2(tmp_path):
    """gyre-real run with a bad [cluster] estimate file: exit 2, one line naming the file and field, before any
    actor starts."""
    pytest.importorskip("ray")
    from typer.testing import CliRunner

    from gyre.bridge.cli import app

    bad = tmp_path / "est.json"
    data = from_costs(get_preset("short-math").costs()).as_dict()
    bad.write_text(json.dumps({**data, "train_s_per_token_gpu": -2.0}))
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[cluster]\nestimate = "{bad}"\n')
    r = CliRunner().invoke(app, ["run", "--policy", "elastic", "--config", str(cfg), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    line = " ".join(r.output.split())
    assert "cluster.estimate" in line and "train_s_per_token_gpu" in line and str(bad.name) in line, r.output
