"""The sim-to-real calibration recovers the cost model that made a profile: decode step coefficients,
prefill seconds per token, and the per-request latency outside the engine kept apart from both."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.bridge.cost_fit import CostFitError, costs_from_profile


def _profile(rng, *, a: float, b: float, c: float, prefill: float, request: float) -> dict:
    """A profile as real/flow.py and the engine actors write it, made from known costs (no noise)."""
    dec = [(n, kv, a + b * n + c * kv) for n, kv in zip(rng.integers(1, 9, 200), rng.integers(0, 5000, 200))]
    new = rng.integers(1, 400, 300)
    gen = rng.integers(1, 50, 300)
    batch = rng.integers(1, 9, 300)
    requests = [(int(p), int(g), int(n), (a + b * n) * g + prefill * p + request) for p, g, n in zip(new, gen, batch)]
    return {"engine_decode": [list(map(float, d)) for d in dec],
            "engine_prefill": [(int(p), prefill * p) for p in new],
            "requests": requests, "train": [(1000, 2.0, 1.9), (500, 1.0, 0.9)],
            "wake": [0.05, 0.07], "sleep": [0.01], "sync": []}


@pytest.mark.parametrize("latency", [0.0, 0.035])
def test_calibration_recovers_the_costs_that_made_the_profile(latency):
    rng = np.random.default_rng(7)
    prof = _profile(rng, a=0.002, b=0.0006, c=1e-7, prefill=0.0009, request=latency)
    costs = costs_from_profile(prof, engine_gpus=1, kv_capacity=10_000, train_gpus=2, min_train_gpus=1)
    assert costs.step_a == pytest.approx(0.002, rel=1e-9) and costs.step_b == pytest.approx(0.0006, rel=1e-9)
    assert costs.step_c == pytest.approx(1e-7, rel=1e-6)
    assert costs.prefill_s_per_token == pytest.approx(0.0009, rel=1e-12)  # the engine's time, no request latency
    assert costs.request_s == pytest.approx(latency, abs=1e-12)
    assert costs.train_s_per_token_gpu == pytest.approx(3.0 / 1500 * 2)
    assert costs.engine_wake_s == pytest.approx(0.06)


def test_a_profile_without_decode_steps_is_refused():
    with pytest.raises(CostFitError, match="fewer than 3 decode steps"):
        costs_from_profile({"engine_decode": [[1, 0, 0.01]]}, engine_gpus=1, kv_capacity=1, train_gpus=1,
                           min_train_gpus=1)


@pytest.mark.parametrize("value", [-0.01, "fast", float("nan"), float("inf"), True])
def test_a_bad_request_latency_is_a_config_error_naming_the_field(value):
    from gyre.config import ConfigError, override
    from tests.simkit import tiny_config

    with pytest.raises(ConfigError, match="cluster.cost: request_s must be a finite number of seconds >= 0"):
        override(tiny_config(), **{"cluster.cost.request_s": value})
