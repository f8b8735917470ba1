"""xlong-swe-kv carries the constants its docstring derives: the run's median rollout near 700K tokens,
lengths growing 3x, the hybrid model's engine capacity (KV and state), a trainer minimum that includes
long-sequence activations, and training that pays two extra forward passes."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.hardware import CostConfig, admission_limit, derive_costs
from gyre.presets import MODELS, GPUS, get_preset
from gyre.workload import sample_group


def test_median_rollout_is_about_700k_tokens_and_grows_3x():
    """Median rollout over the 48 steps within 15% of 700K; step 47's median ~3x step 0's."""
    cfg = get_preset("xlong-swe-kv")
    w = cfg.workload
    toks = [x.tokens for s in range(0, 48, 3) for g in range(32) for x in sample_group(w, s * 32 + g, s, 0).executions]
    assert 0.85 * 700e3 < np.median(toks) < 1.15 * 700e3, np.median(toks)
    assert abs((1 + w.drift_per_step) ** 47 - 3.0) < 1e-9


def test_engine_holds_95_typical_rollouts_and_trainer_minimum_includes_activations():
    """The hybrid stand-in on 32 H200s: 67.8M KV tokens and a 12,720-token state per sequence, so 95 typical
    700K rollouts fit (63 at a full window); the 1M-token activations lift the trainer 328 -> 344 GPUs."""
    cfg = get_preset("xlong-swe-kv")
    c = cfg.costs()
    assert cfg.cluster.model.name == "moe-2.4t-a95b" and c.engine_gpus == 32
    # 32 x (0.9 x 141 GB - 2 GB) - 2.4 TB, at 2 x 23 x 2 x 256 x 1 B per token
    assert c.kv_capacity_tokens == int((32 * (0.9 * 141e9 - 2e9) - 2.4e12) // 23_552)
    state = 69 * (128 * 128 * 128 + 3 * (2 * 32 * 128 + 128 * 128)) * 2
    assert c.state_tokens == pytest.approx(state / 23_552, rel=1e-12)
    assert int(c.kv_capacity_tokens // (700e3 + c.state_tokens)) == 95
    assert int(c.kv_capacity_tokens // (cfg.workload.context_window + c.state_tokens)) == 63
    # so an engine is handed 63 executions at once: full windows and their states fit together
    assert admission_limit(c.kv_capacity_tokens, cfg.workload.max_context, 1.0, c.state_tokens) == 63
    plain = derive_costs(MODELS["moe-2.4t-a95b"], GPUS["h200"], CostConfig())
    assert (plain.min_train_gpus, c.min_train_gpus) == (328, 344)
    # state 2.4e12 x 16 B + activations 2^20 x 8,192 x (2 x 92 + 34) B + 2^14 chunk states of 128^3 x 2 B,
    # at 85% of 141 GB, whole nodes
    need = (2.4e12 * 16 + 2**20 * 8192 * 218 + 2**14 * 128**3 * 2) / (0.85 * 141e9)
    assert c.min_train_gpus == 8 * int(np.ceil(need / 8))


def test_gqa_presets_keep_the_gqa_stand_in():
    """xlong-swe and xlong-swe-epochs run the full-GQA stand-in: 8.1M KV tokens per engine, no state."""
    for name in ("xlong-swe", "xlong-swe-epochs"):
        c = get_preset(name).costs()
        assert get_preset(name).cluster.model.name == "moe-2.4t-a95b-gqa", name
        assert (c.kv_capacity_tokens, c.state_tokens) == (int((32 * (0.9 * 141e9 - 2e9) - 2.4e12) // 196_608), 0.0)


def test_training_pays_two_extra_forwards():
    """10 x active params FLOPs per token (not 6) plus 5 (not 3) x the linear layers' forward FLOPs, and
    attention 20 L_full H d_h (not 12)."""
    c = get_preset("xlong-swe-kv").costs()
    plain = derive_costs(MODELS["moe-2.4t-a95b"], GPUS["h200"], CostConfig())
    # one linear layer's chunked forward per token: 128 value heads x (6 x 128^2 + 64 x (6 + 4) x 128) plus the
    # conv, 2 x 4 x (2 x 32 x 128 + 128 x 128); 69 of them
    lin = 69 * (128 * (6 * 128**2 + 64 * 10 * 128) + 2 * 4 * (2 * 32 * 128 + 128 * 128))
    assert np.isclose(c.train_s_per_token_gpu / plain.train_s_per_token_gpu,
                      (10 * 95e9 + 5 * lin) / (6 * 95e9 + 3 * lin))
    assert np.isclose(c.train_attn_flops_per_ctx_token / plain.train_attn_flops_per_ctx_token, 20 / 12)
