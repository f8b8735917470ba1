"""xlong-swe-kv carries the constants its docstring derives: the run's median rollout near 700K tokens,
lengths growing 3x, a KV-scarce engine, a trainer minimum that includes long-sequence activations,
and training that pays two extra forward passes."""

from __future__ import annotations

import numpy as np

from gyre.hardware import CostConfig, derive_costs
from gyre.presets import MODELS, GPUS, get_preset
from gyre.workload import sample_group


def test_median_rollout_is_about_700k_tokens_and_grows_3x():
    """Median rollout over the 48 steps within 15% of 700K; step 47's median ~3x step 0's."""
    cfg = get_preset("xlong-swe-kv")
    w = cfg.workload
    toks = [x.tokens for s in range(0, 48, 3) for g in range(32) for x in sample_group(w, s * 32 + g, s, 0).executions]
    assert 0.85 * 700e3 < np.median(toks) < 1.15 * 700e3, np.median(toks)
    assert abs((1 + w.drift_per_step) ** 47 - 3.0) < 1e-9


def test_engine_is_kv_scarce_and_trainer_minimum_includes_activations():
    """~8 full-window contexts fit a 32-GPU engine; the 1M-token activations lift the trainer 328 -> 360 GPUs."""
    cfg = get_preset("xlong-swe-kv")
    c = cfg.costs()
    assert c.engine_gpus == 32
    assert 7 <= c.kv_capacity_tokens / cfg.workload.context_window <= 9, c.kv_capacity_tokens
    plain = derive_costs(MODELS["moe-2.4t-a95b"], GPUS["h200"], CostConfig())
    assert (plain.min_train_gpus, c.min_train_gpus) == (328, 360)
    # state 2.4e12 x 16 B + activations 2^20 x 16,384 x (2 x 96 + 34) B, at 85% of 141 GB, whole nodes
    need = (2.4e12 * 16 + 2**20 * 16384 * 226) / (0.85 * 141e9)
    assert c.min_train_gpus == 8 * int(np.ceil(need / 8))


def test_training_pays_two_extra_forwards():
    """10 x active params FLOPs per token (not 6) and attention 20 L H d_h (not 12)."""
    c = get_preset("xlong-swe-kv").costs()
    plain = derive_costs(MODELS["moe-2.4t-a95b"], GPUS["h200"], CostConfig())
    assert np.isclose(c.train_s_per_token_gpu / plain.train_s_per_token_gpu, 10 / 6)
    assert np.isclose(c.train_attn_flops_per_ctx_token / plain.train_attn_flops_per_ctx_token, 20 / 12)
