"""The roofline of one inference-engine step: how long a step takes and how much KV an engine holds.

An engine is `gpus` GPUs serving one model with tensor parallelism. One step processes `n` decoding
sequences (one token each, contexts summing to `ctx`) and, within the step's token budget
(`max_num_batched_tokens`), a prefill chunk of `m` tokens whose sequence already holds `p` tokens:

    bytes = dense weights + routed weights x (1 - (1 - k/E)^(n + m))      (distinct experts read)
            + KV bytes per token x (ctx + p)                              (KV read by attention)
    FLOPs = 2 x active params x (n + m) + 4 x L x H x d_h x (ctx + m p + m^2 / 2)
    time  = max(bytes / (gpus x BW x eff_bw), FLOPs / (gpus x peak x eff_flops))
            + step_overhead_s + (gpus > 1) x 2 x L x all-reduce latency

Assumptions a reviewer should know: expert routing is uniform (the expected distinct experts of n
tokens routed top-k over E are E (1 - (1 - k/E)^n), k at n = 1, E as n grows); tensor parallelism
divides bytes and FLOPs evenly over the GPUs and adds two all-reduces per layer whose bandwidth term
is ignored (at decode a layer's activations are a few KB to MB per step, microseconds on NVLink), and
an engine spanning nodes pays the inter-node latency per all-reduce instead; KV writes (m tokens) are
ignored beside the reads. The step-time formula is the one PHYSICS.md states; the coefficients
(efficiencies, fixed overheads, activation reserve) are the only fitted numbers, in `Coefficients`.

KV capacity = gpus x HBM x gpu_memory_utilization - weights - gpus x activation reserve.
Bytes per KV token = 2 L H_kv d_h b_kv (K and V), or L (kv_lora_rank + rope_dim) b_kv for MLA.

This module is pure (no simulator imports): `gyre.hardware` builds an `EngineRoofline` from model and
GPU presets, the simulator asks it for step times, and the engine calibrator fits `Coefficients`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Coefficients:
    """The fittable constants of the engine step; every other number comes from a spec sheet or config file.

    Defaults and their sources:
    - eff_bw 0.8: memory-bound decode kernels reach 70-90% of data-sheet HBM bandwidth (NVIDIA's
      nvbandwidth / STREAM-style copies on H100 reach ~90%; GEMV-bound decode in vLLM and TensorRT-LLM
      is reported at 70-85%).
    - eff_flops 0.6: large bf16 GEMMs and FlashAttention-2/3 reach 60-75% of dense peak on H100.
    - step_overhead_s 0.004: vLLM's per-step scheduling, sampling and launch time with CUDA graphs
      (a few ms per step in vLLM V1 profiles).
    - allreduce_s 10 us, allreduce_internode_s 30 us: latency of one small NCCL all-reduce inside an
      NVLink node, and across nodes over InfiniBand (nccl-tests small-message latencies).
    - gpu_memory_utilization 0.9: vLLM's default share of HBM it allows itself.
    - reserve_gb_per_gpu 2.0: activations, CUDA graphs and non-torch memory that vLLM's profiling run
      sets aside. Measured 1.24 GB in shared/data/vllm_timings/RTX4090_Llama-3.1-8B (0.9 x 25.25 GB
      HBM - 16.06 GB weights - 41,408 KV tokens x 128 KiB), at a 2,048-token budget and a
      4,096-wide model; rounded up for 8,192-token budgets and wider models.
    """

    eff_bw: float = 0.8
    eff_flops: float = 0.6
    step_overhead_s: float = 0.004
    allreduce_s: float = 10e-6
    allreduce_internode_s: float = 30e-6
    gpu_memory_utilization: float = 0.9
    reserve_gb_per_gpu: float = 2.0


def kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, bytes_per_elem: float,
                       kv_lora_rank: int = 0, rope_dim: int = 0) -> float:
    """KV-cache bytes one token occupies: 2 L H_kv d_h b (K and V), or L (lora rank + rope dim) b for MLA."""
    if kv_lora_rank:
        return layers * (kv_lora_rank + rope_dim) * bytes_per_elem
    return 2 * layers * kv_heads * head_dim * bytes_per_elem


def distinct_experts(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts per MoE layer that `tokens` tokens routed top-k over `experts` touch
    (uniform routing): E (1 - (1 - k/E)^n)."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


@dataclass(frozen=True, kw_only=True)
class EngineRoofline:
    """One engine's step-time and memory model. Sizes in bytes, rates per GPU in bytes/s and FLOP/s."""

    gpus: int
    gpus_per_node: int
    hbm_bytes: float  # per GPU
    bw_bytes_s: float  # HBM bandwidth per GPU
    flops: float  # dense peak per GPU at the serving precision
    layers: int
    q_heads: int
    head_dim: int
    kv_bytes_per_token: float
    weight_bytes: float  # all weights at the serving precision
    routed_bytes: float = 0.0  # the routed experts' share of weight_bytes (0 for a dense model)
    experts: int = 0
    top_k: int = 0
    active_params: float  # parameters one token passes through
    max_batched_tokens: int = 8192  # vLLM's max_num_batched_tokens: decode + prefill tokens per step
    coef: Coefficients = Coefficients()

    def __post_init__(self) -> None:
        # per-step constants, so step_time is a handful of float operations
        c = self.coef
        object.__setattr__(self, "_bw", self.gpus * self.bw_bytes_s * c.eff_bw)
        object.__setattr__(self, "_pk", self.gpus * self.flops * c.eff_flops)
        ar = 0.0
        if self.gpus > 1:
            ar = 2 * self.layers * (c.allreduce_internode_s if self.gpus > self.gpus_per_node else c.allreduce_s)
        object.__setattr__(self, "_fixed", c.step_overhead_s + ar)
        object.__setattr__(self, "_attn", 4.0 * self.layers * self.q_heads * self.head_dim)
        object.__setattr__(self, "_dense", self.weight_bytes - self.routed_bytes)
        object.__setattr__(self, "_miss", 1.0 - self.top_k / self.experts if self.experts else 0.0)
        object.__setattr__(self, "_2p", 2.0 * self.active_params)
        object.__setattr__(self, "_eb", c.eff_bw)
        object.__setattr__(self, "_ef", c.eff_flops)

    # --- memory ---
    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens the engine holds: gpus x HBM x utilization - weights - gpus x activation reserve."""
        c = self.coef
        free = self.gpus * (self.hbm_bytes * c.gpu_memory_utilization - c.reserve_gb_per_gpu * 1e9) \
            - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    # --- one step ---
    def weight_bytes_read(self, tokens: float) -> float:
        """Weight bytes one step reads for `tokens` tokens: the dense part, plus the distinct experts touched."""
        if tokens <= 0:
            return 0.0
        if not self.routed_bytes:
            return self.weight_bytes
        return self._dense + self.routed_bytes * (1.0 - self._miss ** tokens)

    def step_bytes_flops(self, n: int, ctx: float, m: float = 0.0, p: float = 0.0) -> tuple[float, float]:
        """(bytes moved, FLOPs) of a step with n decodes at total context ctx and a chunk of m tokens at offset p."""
        tokens = n + m
        kv = ctx + (p if m > 0 else 0.0)
        by = self.weight_bytes_read(tokens) + self.kv_bytes_per_token * kv
        fl = 2.0 * self.active_params * tokens + self._attn * (ctx + m * p + 0.5 * m * m)
        return by, fl

    def step_time(self, n: int, ctx: float, m: float = 0.0, p: float = 0.0) -> float:
        """Seconds of one step: n decodes at total context ctx, plus a prefill chunk of m tokens at offset p."""
        return self.step_and_ideal(n, ctx, m, p)[0]

    def step_and_ideal(self, n: int, ctx: float, m: float = 0.0, p: float = 0.0) -> tuple[float, float]:
        """(step_time, the part of it the hardware peak needs: max(bytes / BW, FLOPs / peak) at 100%
        efficiency, without overheads)."""
        return self.stepper()(n, ctx, m, p)

    def stepper(self):
        """step_and_ideal as a plain function of (n, ctx, m=0, p=0) with this engine's constants bound in:
        the simulator calls it once per event. Built once per roofline and kept out of pickles."""
        f = self.__dict__.get("_stepper")
        if f is None:
            f = _make_stepper(self)
            object.__setattr__(self, "_stepper", f)
        return f

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_stepper", None)  # a closure: rebuilt on first use
        return state

    def ideal_share(self, n: int, ctx: float, m: float = 0.0, p: float = 0.0) -> float:
        """The share of a step's time the hardware peak needs: max(bytes / BW, FLOPs / peak) at 100%
        efficiency, without overheads, over step_time (the step's roofline utilization)."""
        if n + m <= 0:
            return 0.0
        by, fl = self.step_bytes_flops(n, ctx, m, p)
        c = self.coef
        return max(by / self._bw * c.eff_bw, fl / self._pk * c.eff_flops) / self.step_time(n, ctx, m, p)

    def prefill_time(self, tokens: float, offset: float = 0.0) -> float:
        """Seconds to prefill `tokens` after `offset` alone on the engine, in chunks of the full budget."""
        t, done, b = 0.0, 0.0, float(self.max_batched_tokens)
        while done < tokens:
            m = min(b, tokens - done)
            t += self.step_time(0, 0.0, m, offset + done)
            done += m
        return t

    def decode_time(self, ctx):
        """Seconds per token of one sequence decoding alone at context ctx (batch 1); ctx may be an array."""
        import numpy as np

        by = self.weight_bytes_read(1) + self.kv_bytes_per_token * np.asarray(ctx, dtype=float)
        fl = 2.0 * self.active_params + self._attn * np.asarray(ctx, dtype=float)
        return np.maximum(by / self._bw, fl / self._pk) + self._fixed

    # --- minima, for a lower bound on what the engine charges ---
    def min_prefill_time_per_token(self, offset):
        """No prefill token starting at `offset` (array) takes less engine time than this, in any step:
        a step's chunk is at most the budget, reads at least its weights and costs 2 P + 4 L H d_h p FLOPs
        per token (a chunk's own m^2 / 2 and the prefix read only add)."""
        import numpy as np

        b = float(self.max_batched_tokens)
        p = np.asarray(offset, dtype=float)
        by = self.weight_bytes_read(b) / b
        fl = 2.0 * self.active_params + self._attn * p
        return np.maximum(by / self._bw, fl / self._pk) + self._fixed / b

    def min_busy_time(self, *, tokens: float, kv_read_tokens: float, flops: float, max_step_tokens: float) -> float:
        """A lower bound on the engine time that processes `tokens` tokens (decoded or prefilled) reading at
        least `kv_read_tokens` KV tokens and computing at least `flops` FLOPs, at most `max_step_tokens`
        per step: sum of per-step maxima >= max of the sums; the weights a step of N tokens reads per token,
        W(N) / N, only falls as N grows (W is concave through 0), and there are >= tokens / N_max steps."""
        if tokens <= 0:
            return 0.0
        by = tokens * self.weight_bytes_read(max_step_tokens) / max_step_tokens + self.kv_bytes_per_token * kv_read_tokens
        return max(by / self._bw, flops / self._pk) + self._fixed * tokens / max_step_tokens

    @property
    def flops_per_token(self) -> float:
        """2 x active parameters: the FLOPs of one token outside attention."""
        return 2.0 * self.active_params

    @property
    def attn_flops_per_ctx(self) -> float:
        """4 L H d_h: attention FLOPs of one token per token of context."""
        return self._attn


def _make_stepper(r: EngineRoofline):
    """The one step formula (see the module docstring), closed over r's per-step constants."""
    dense, routed, miss, weights = r._dense, r.routed_bytes, r._miss, r.weight_bytes
    kvb, bw, pk, two_p, attn, fixed, eb, ef = (r.kv_bytes_per_token, r._bw, r._pk, r._2p, r._attn, r._fixed,
                                              r._eb, r._ef)

    def step_and_ideal(n: int, ctx: float, m: float = 0.0, p: float = 0.0) -> tuple[float, float]:
        tokens = n + m
        if tokens <= 0:
            return 0.0, 0.0
        w = dense + routed * (1.0 - miss ** tokens) if routed else weights
        if m > 0:
            tb = (w + kvb * (ctx + p)) / bw
            tf = (two_p * tokens + attn * (ctx + m * p + 0.5 * m * m)) / pk
        else:
            tb = (w + kvb * ctx) / bw
            tf = (two_p * tokens + attn * ctx) / pk
        ib, if_ = tb * eb, tf * ef
        return (tb if tb > tf else tf) + fixed, (ib if ib > if_ else if_)

    return step_and_ideal
