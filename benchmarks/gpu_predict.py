"""The simulator's predictions for the shapes `bench_gpu.py` measures on a GPU, through the simulator's own code.

What it models: a measured model's shape as the simulator sees it, a `ModelConfig` counted from the model's
config.json fields by `gyre.sim.vllm_check.run_presets.model_from_hf_config` (the path `gyre-sim
calibrate-engine --model-config` takes), priced on a GPU preset (`gyre.presets.GPUS`, the H200 by default)
by `gyre.hardware.derive_costs`:
- a training step of one sequence of S tokens (a prompt of P, all later tokens trained): `Costs.train_time(S,
  1 GPU, attention context)` with the context sum from `gyre.hardware.train_attention_ctx`, one extra forward
  (`train_extra_forwards` = 1) when activation checkpointing is on; the memory the trainer must hold,
  `gyre.hardware.train_memory_bytes` (16 B a parameter plus the activations of S tokens under full
  checkpointing);
- an engine decode step: `Costs.step_time(batch, KV tokens)` (the engine roofline, default coefficients);
- host <-> device copies: bytes / `GpuConfig.host_gb_s`, and the engine-wake and trainer-onload figures
  `derive_costs` gives for the whole model.

`QWEN3` holds the public config.json fields of the models measured (Hugging Face Qwen/Qwen3-0.6B, -1.7B,
-4B and -30B-A3B); `fields(name, layers=)` cuts a model to its first layers (the MoE, to fit one GPU).
Imports gyre only (no torch): the CPU tests check these figures against derive_costs.
"""

from __future__ import annotations

from dataclasses import replace

from gyre.hardware import CostConfig, derive_costs, train_attention_ctx, train_memory_bytes
from gyre.presets import GPUS
from gyre.datasheets import GpuConfig, ModelConfig
from gyre.sim.vllm_check.run_presets import model_from_hf_config

_COMMON = dict(head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
               max_position_embeddings=40960, hidden_act="silu", attention_bias=False)
# config.json of Qwen/Qwen3-{0.6B,1.7B,4B} (dense, tied embeddings) and Qwen/Qwen3-30B-A3B (128 experts top-8,
# expert width 768, normalized top-k weights, every layer MoE, untied)
QWEN3: dict[str, dict] = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       tie_word_embeddings=True, **_COMMON),
    "qwen3-1.7b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       tie_word_embeddings=True, **_COMMON),
    "qwen3-4b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2560,
                     intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     tie_word_embeddings=True, **_COMMON),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          tie_word_embeddings=False, **_COMMON),
}
# a tiny stand-in of each family for the CPU check of the script (--smoke)
TINY: dict[str, dict] = {
    "tiny-dense": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                       tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=4096),
    "tiny-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
                     intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     vocab_size=512, tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=4096),
}


def fields(name: str, layers: int | None = None, max_positions: int | None = None) -> dict:
    """config.json fields of model `name` (QWEN3 or TINY), cut to its first `layers` layers if given; a longer
    `max_positions` where a measured sequence is longer than the checkpoint's (plain RoPE either way)."""
    base = QWEN3.get(name) or TINY.get(name)
    if base is None:
        raise ValueError(f"model {name!r}: expected one of {', '.join([*QWEN3, *TINY])}")
    out = dict(base)
    if layers is not None:
        out["num_hidden_layers"] = int(layers)
    if max_positions is not None:
        out["max_position_embeddings"] = max(int(out["max_position_embeddings"]), int(max_positions))
    return out


def sim_model(cfg: dict, name: str) -> ModelConfig:
    """The simulator's ModelConfig of config.json fields `cfg` (parameters counted as calibrate-engine counts)."""
    return model_from_hf_config(cfg, f"{name} config", name)


def train_prediction(model: ModelConfig, seq: int, prompt: int, checkpointing: bool,
                     gpu: GpuConfig | None = None, cost: CostConfig | None = None) -> dict:
    """The simulator's figures for one training step on one GPU of a sequence of `seq` tokens whose first `prompt`
    are the prompt: seconds, model FLOPs (6 N S + 12 L H d_h x context, no recompute), memory (state,
    activations) in bytes."""
    gpu = gpu or GPUS["h200"]
    cfg = replace(cost or CostConfig(), train_extra_forwards=1 if checkpointing else 0, train_seq_tokens=seq)
    costs = derive_costs(model, gpu, cfg)
    ctx = train_attention_ctx(prompt, [seq - prompt], [prompt], [])
    width = (model.q_heads or model.kv_heads) * model.head_dim
    state, act = train_memory_bytes(model, cfg)
    return {"pred_s": costs.train_time(seq, 1, ctx), "train_mfu": costs.train_mfu,
            "model_flops": 6.0 * model.active_params_b * 1e9 * seq + 12.0 * model.full_layers * width * ctx,
            "pred_state_bytes": state, "pred_act_bytes": act, "pred_mem_bytes": state + act,
            "min_train_gpus": costs.min_train_gpus, "peak_flops": gpu.bf16_tflops * 1e12}


def decode_prediction(model: ModelConfig, batch: int, kv_tokens: float, gpu: GpuConfig | None = None) -> dict:
    """The simulator's engine step (seconds) for `batch` decodes over `kv_tokens` of context, and its engine size."""
    costs = derive_costs(model, gpu or GPUS["h200"])
    return {"pred_s": costs.step_time(batch, kv_tokens), "engine_gpus": costs.engine_gpus}


def copy_prediction(model: ModelConfig, nbytes: float, gpu: GpuConfig | None = None) -> dict:
    """Seconds to move `nbytes` over the host link at `host_gb_s`, and the model's engine wake (transfer plus the
    fixed part) and trainer onload as derive_costs gives them."""
    gpu = gpu or GPUS["h200"]
    costs = derive_costs(model, gpu)
    return {"pred_s": nbytes / (gpu.host_gb_s * 1e9), "engine_wake_s": costs.engine_wake_s,
            "engine_wake_fixed_s": CostConfig().engine_wake_fixed_s, "trainer_onload_s": costs.trainer_onload_s,
            "host_gb_s": gpu.host_gb_s}
