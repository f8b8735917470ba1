"""Hardware and model descriptions, and the cost model derived from them.

Every simulator constant comes from here and is derived from a model's shape and a GPU's data sheet,
never tuned by hand:

- KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element.
- Engine size: the fewest GPUs (power of two, up to whole nodes) whose memory holds the inference
  weights at <= `weight_fraction` of HBM; what remains (x `kv_utilization`) is KV cache.
- Decode step time of an engine (memory-bound, fluid): t = a + b * batch + c * kv_tokens, with
  a = weight bytes read per step / (engine HBM bandwidth) + fixed launch overhead,
  b = 2 * active params FLOPs per sequence / (engine FLOP/s * decode MFU),
  c = KV bytes per token / engine HBM bandwidth.
- Prefill is compute-bound: 2 * active params FLOPs per token at `prefill_mfu`.
- Training: 6 * active params FLOPs per token at `train_mfu`; the trainer needs enough GPUs to hold
  `train_bytes_per_param` per parameter (weights + grads + optimizer state, sharded) at 85% of HBM.
- Weight sync: per-GPU weight shard / inter-node bandwidth + latency.
- Role switch: engine wake = weight shard / host-to-device bandwidth + fixed (graph capture,
  allocator); trainer on/offload = trainer state shard / host-to-device bandwidth.

Sources: NVIDIA H100 SXM and H200 SXM data sheets (HBM 3.35 / 4.8 TB/s, 80 / 141 GB, 989 TFLOP/s
dense BF16, 1979 TFLOP/s dense FP8, NVLink 900 GB/s), 400 Gb/s InfiniBand per GPU (50 GB/s),
PCIe Gen5 x16 (~55 GB/s practical host<->device). Model shapes from the Qwen2.5-7B and
Qwen3-30B-A3B config files; the very large MoE is a stand-in with the published 2.4T total /
95B active parameter counts and a GQA shape of the same family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GpuConfig:
    name: str
    memory_gb: float
    hbm_tb_s: float
    bf16_tflops: float
    fp8_tflops: float
    gpus_per_node: int = 8
    internode_gb_s: float = 50.0  # per GPU, 400 Gb/s InfiniBand
    host_gb_s: float = 55.0  # PCIe Gen5 x16, practical


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    total_params_b: float
    active_params_b: float
    layers: int
    kv_heads: int
    head_dim: int
    infer_bytes_per_param: float = 2.0  # bf16; 1.0 for fp8 serving
    kv_bytes_per_elem: float = 2.0
    train_bytes_per_param: float = 16.0  # bf16 weights+grads, fp32 master + Adam moments

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def infer_weight_bytes(self) -> float:
        return self.total_params_b * 1e9 * self.infer_bytes_per_param


@dataclass(frozen=True, kw_only=True)
class CostConfig:
    """Efficiency factors (the only constants not read off a data sheet; values from public MFU reports)."""

    weight_fraction: float = 0.6  # an engine's weights may fill at most this share of its HBM
    kv_utilization: float = 0.9  # share of the remaining HBM given to KV cache (vLLM default 0.9)
    decode_mfu: float = 0.5
    prefill_mfu: float = 0.5
    train_mfu: float = 0.35
    step_overhead_s: float = 0.004  # per decode step: launch + scheduling
    sync_latency_s: float = 0.5
    engine_wake_fixed_s: float = 5.0
    engine_sleep_s: float = 2.0
    migration: str = "reprefill"  # or "kv_transfer"


@dataclass(frozen=True)
class Costs:
    """All derived per-engine and per-run cost constants (seconds, tokens, bytes)."""

    engine_gpus: int
    kv_capacity_tokens: int
    step_a: float
    step_b: float
    step_c: float
    prefill_s_per_token: float
    train_s_per_token_gpu: float  # seconds per token on one GPU (divide by GPU count)
    min_train_gpus: int
    sync_s: float
    engine_wake_s: float
    engine_sleep_s: float
    trainer_onload_s: float
    trainer_offload_s: float
    kv_transfer_s_per_token: float
    migration: str

    def step_time(self, batch: int, kv_tokens: float) -> float:
        return self.step_a + self.step_b * batch + self.step_c * kv_tokens

    def train_time(self, tokens: float, gpus: int) -> float:
        return tokens * self.train_s_per_token_gpu / gpus

    def migration_time(self, context_tokens: float) -> float:
        if self.migration == "kv_transfer":
            return context_tokens * self.kv_transfer_s_per_token
        return context_tokens * self.prefill_s_per_token

    def best_decode_tokens_per_gpu_s(self, mean_context: float) -> float:
        """Peak decode throughput per GPU: an engine full of sequences of `mean_context` tokens."""
        n = max(1, int(self.kv_capacity_tokens // max(mean_context, 1.0)))
        return n / self.step_time(n, n * mean_context) / self.engine_gpus


def _pow2_at_least(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def derive_costs(model: ModelConfig, gpu: GpuConfig, cost: CostConfig | None = None) -> Costs:
    cost = cost or CostConfig()
    hbm = gpu.memory_gb * 1e9
    engine_gpus = _pow2_at_least(model.infer_weight_bytes / (cost.weight_fraction * hbm))
    if engine_gpus > gpu.gpus_per_node:  # multi-node engines come in whole nodes
        engine_gpus = gpu.gpus_per_node * math.ceil(engine_gpus / gpu.gpus_per_node)
    free = engine_gpus * hbm - model.infer_weight_bytes
    kv_capacity = int(free * cost.kv_utilization / model.kv_bytes_per_token)
    bw = engine_gpus * gpu.hbm_tb_s * 1e12
    peak = engine_gpus * (gpu.fp8_tflops if model.infer_bytes_per_param <= 1 else gpu.bf16_tflops) * 1e12
    active = model.active_params_b * 1e9
    step_a = model.infer_weight_bytes / bw + cost.step_overhead_s
    step_b = 2 * active / (peak * cost.decode_mfu)
    step_c = model.kv_bytes_per_token / bw
    prefill = 2 * active / (peak * cost.prefill_mfu)
    train_per_token_gpu = 6 * active / (gpu.bf16_tflops * 1e12 * cost.train_mfu)
    train_bytes = model.total_params_b * 1e9 * model.train_bytes_per_param
    min_train = _pow2_at_least(train_bytes / (0.85 * hbm))  # within a node: a power of two
    if min_train > gpu.gpus_per_node:  # across nodes: whole nodes
        min_train = gpu.gpus_per_node * math.ceil(train_bytes / (0.85 * hbm) / gpu.gpus_per_node)
    shard = model.infer_weight_bytes / engine_gpus
    train_shard = train_bytes / max(min_train, 1)
    return Costs(
        engine_gpus=engine_gpus,
        kv_capacity_tokens=kv_capacity,
        step_a=step_a,
        step_b=step_b,
        step_c=step_c,
        prefill_s_per_token=prefill,
        train_s_per_token_gpu=train_per_token_gpu,
        min_train_gpus=min_train,
        sync_s=shard / (gpu.internode_gb_s * 1e9) + cost.sync_latency_s,
        engine_wake_s=shard / (gpu.host_gb_s * 1e9) + cost.engine_wake_fixed_s,
        engine_sleep_s=cost.engine_sleep_s,
        trainer_onload_s=train_shard / (gpu.host_gb_s * 1e9),
        trainer_offload_s=train_shard / (gpu.host_gb_s * 1e9),
        kv_transfer_s_per_token=model.kv_bytes_per_token / (gpu.internode_gb_s * 1e9),
        migration=cost.migration,
    )
