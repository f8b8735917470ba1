"""The cost estimate a policy may observe: the simulator's is what it charges; a calibration file is read
exactly, and a missing, negative or non-finite figure is one line naming it (exit 2 from gyre-real)."""

from __future__ import annotations

import json
import math

import pytest

from gyre.estimate import (FILE_FIELDS, CostEstimate, EstimateError, batch_counts, fit_prefill_s_per_token, fit_step,
                           fit_train_s_per_token_gpu, from_costs, from_file, write_file)
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
    ("prefill_s_per_token", -1e-6, "finite number >= 0"),
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


def test_real_example_estimate_reads():
    """The example calibration file shipped for [cluster] estimate = <file> is a valid estimate; the real presets
    profile at start-up instead."""
    from gyre.real.config import ESTIMATES
    from gyre.real.config import get_preset as real_preset

    assert real_preset("tiny-cpu").cluster.estimate == "profile", "the presets' default is a start-up profile"
    est = from_file(ESTIMATES / "tiny-cpu.json")
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


@pytest.mark.parametrize("decode,train,needle", [
    ([(1, 10, 0.01), (2, 20, float("nan")), (4, 40, 0.02)], [(100, 1.0)], "step_a must be a finite number"),
    ([(1, 10, 0.01), (2, 20, 0.015), (4, 40, 0.02)], [(100, float("inf"))], "train_s_per_token_gpu must be a finite"),
])
def test_non_finite_profile_figures_are_one_line(decode, train, needle):
    """A timing that makes a fitted figure non-finite (a NaN decode step, an endless training step) is refused
    by the estimate in one line naming the figure and the profile."""
    step = fit_step(decode)
    with pytest.raises(EstimateError, match=needle) as exc:
        CostEstimate(engine_gpus=1, kv_capacity=64, min_train_gpus=1, max_running=0,
                     train_s_per_token_gpu=fit_train_s_per_token_gpu(train, 1), train_s_per_attn_gpu=0.0,
                     step_a=step.a, step_b=step.b, step_c=step.c, engine_start_s=0.0, engine_stop_s=0.0,
                     trainer_start_s=0.0, source="start-up profile")
    assert "start-up profile" in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_fit_step_recovers_a_line_by_hand():
    """The engine step fit recovers an exact line a + b n + c ctx, a negative fixed part becomes the median step,
    and the training rate is seconds x GPUs over tokens (none trained: one line)."""
    rows = [(n, ctx, 0.002 + 0.0005 * n + 1e-6 * ctx) for n, ctx in ((1, 10), (4, 40), (16, 160), (4, 400), (16, 1600))]
    s = fit_step(rows)
    assert (s.a, s.b, s.c) == pytest.approx((0.002, 0.0005, 1e-6), rel=1e-6), s
    s0 = fit_step([(1, 0, 0.001), (2, 0, 0.003), (3, 0, 0.005)])  # a = -0.001: 0, then the median step
    assert s0.a == pytest.approx(0.003) and s0.b == pytest.approx(0.002), s0
    assert fit_train_s_per_token_gpu([(100, 1.0), (300, 2.0)], 2) == pytest.approx(3.0 / 400 * 2), "sum s x g / tokens"
    with pytest.raises(EstimateError, match="fewer than 3 decode steps"):
        fit_step([(1, 0, 0.001)])
    with pytest.raises(EstimateError, match="trained 0.0 tokens"):
        fit_train_s_per_token_gpu([(0, 1.0)], 1)


def _line(**kw) -> CostEstimate:
    base = dict(engine_gpus=1, kv_capacity=100_000, min_train_gpus=1, max_running=0, train_s_per_token_gpu=1e-3,
                train_s_per_attn_gpu=0.0, step_a=0.010, step_b=0.001, step_c=1e-7, engine_start_s=1.0,
                engine_stop_s=1.0, trainer_start_s=1.0)
    return CostEstimate(**{**base, **kw})


def test_loaded_step_by_hand():
    """A line's loaded step is its decode step plus n x (prefilled tokens per decoded token) x the prefill
    token's seconds: 4 sequences at 4,000 context tokens, 2.5 prefilled per decoded, 20 us each."""
    est = _line(prefill_s_per_token=20e-6)
    decode = 0.010 + 0.001 * 4 + 1e-7 * 4000  # 14.4 ms
    assert est.step_s(4, 4000) == pytest.approx(decode), "the decode step alone"
    assert est.loaded_step_s(4, 4000, 2.5) == pytest.approx(0.0144 + 4 * 2.5 * 20e-6), "14.6 ms with prefill"
    assert est.loaded_step_s(4, 4000, 0.0) == pytest.approx(decode), "nothing to prefill: the decode step"
    assert est.prefill_s(4, 4000, 1000) == 20e-6, "a line's prefill token costs the same at any offset"


def test_prefill_absent_is_stated(tmp_path):
    """A calibration without a prefill figure reads (older files stay valid), counts prefill free and says so."""
    data = from_costs(get_preset("short-math").costs()).as_dict()
    del data["prefill_s_per_token"]
    p = tmp_path / "est.json"
    p.write_text(json.dumps(data))
    est = from_file(p)
    assert est.prefill_s(8, 8000, 1000) is None, "no figure, no prefill cost"
    assert est.loaded_step_s(8, 8000, 3.0) == est.step_s(8, 8000), "the decode step alone"
    assert "prefill not measured" in est.describe(), est.describe()


def test_simulator_prefill_is_what_the_engine_charges():
    """The simulator's prefill token: a full chunk alone costs what the roofline's prefill of that chunk
    does, beside decodes it costs more than nothing and no more than alone (the step's weight read is
    shared), a deeper offset (more attention) costs more; the loaded step adds n x ratio x it."""
    costs = get_preset("xlong-swe-kv").costs()
    est = from_costs(costs)
    b = costs.max_batched_tokens
    assert est.prefill_s(0, 0, 0) * b == pytest.approx(costs.prefill_time(b), rel=1e-9), "a chunk alone"
    for off in (0, 100_000, 500_000):
        q = est.prefill_s(8, 8 * 500_000, off)
        assert 0 < q <= est.prefill_s(0, 0, off) * (1 + 1e-9), f"beside 8 decodes at offset {off}: {q}"
    assert est.prefill_s(8, 4e6, 500_000) > est.prefill_s(8, 4e6, 0), "deeper prefixes cost more attention"
    q = est.prefill_s(16, 16 * 500_000, 500_000)
    assert est.loaded_step_s(16, 16 * 500_000, 2.25) == pytest.approx(est.step_s(16, 16 * 500_000) + 16 * 2.25 * q)


def test_fit_prefill_by_hand():
    """A profile's prefill rate is its prefills' seconds over their tokens; none measured is None."""
    assert fit_prefill_s_per_token([(1000, 0.02), (3000, 0.04)]) == pytest.approx(0.06 / 4000), "15 us/token"
    assert fit_prefill_s_per_token([]) is None and fit_prefill_s_per_token(None) is None, "no prefill timed"
    with pytest.raises(EstimateError, match="s per token"):
        fit_prefill_s_per_token([(10, float("nan"))])
