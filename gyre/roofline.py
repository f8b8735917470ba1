"""The roofline of one inference-engine step: how long a step takes and how much KV an engine holds.

An engine is `gpus` GPUs serving one model with tensor parallelism. One step processes `n` decoding
sequences (one token each, contexts summing to `ctx`) and, within the step's token budget
(`max_num_batched_tokens`), a prefill chunk of `m` tokens whose sequence already holds `p` tokens.
The step runs two kinds of kernels one after the other, each bound by memory or by compute:

    linear    = max(weights read / (BW x eff_bw), linear FLOPs / (peak x eff_flops))
      weights read = dense weights + routed weights x (1 - (1 - k/E)^(n + m)) - input embedding table
      linear FLOPs = 2 x (active params - embedding - LM head) x (n + m) + 2 x LM head x sampled
    attention = max(KV bytes per token x (ctx + p) / (BW x eff_kv) + 2 x state bytes x seqs / (BW x eff_bw),
                    (4 L_full H d_h (ctx + m p + m^2 / 2) + F_dec n + F_pf m) / (peak x eff_flops))
    time      = linear + attention + tensor-parallel all-reduces + step_overhead_s
    all-reduces (gpus > 1) = 2 L x (latency + 2 (g - 1) / g x (n + m) x hidden x 2 B / (link x eff_link))
      link = the GPU-to-GPU link inside a node; across nodes a multi-rail ring's bus bandwidth (`ring_bytes_s`)

with BW and peak the GPUs' summed data-sheet bandwidth and FLOP/s, and `sampled` = n + (1 if m > 0):
the sequences that produce a token this step, which are also `seqs`, the sequences whose linear-attention
state the step reads and writes. A hybrid model (Qwen3-Next, Qwen3.5) has full attention on L_full of its
layers and Gated DeltaNet on the rest: those keep a fixed state per sequence instead of a KV cache, and
cost F_dec FLOPs per decoded token (recurrent form) and F_pf per prefilled one (chunked form,
`linear_attention_flops`); a model without them has L_full = L and zero state and F terms.
(vLLM computes logits only where it samples; the input
embedding is a gather of n + m rows, not a read of the table; a tied table is read by the LM head).

Assumptions a reviewer should know: expert routing is uniform (the expected distinct experts of n
tokens routed top-k over E are E (1 - (1 - k/E)^n), k at n = 1, E as n grows); tensor parallelism
divides bytes and FLOPs evenly over the GPUs and adds two ring all-reduces of the step's activations
per layer (Megatron-style: after attention and after the MLP), over the GPU-to-GPU link inside a node;
an engine spanning nodes runs them as NCCL does on multi-rail nodes (one NIC per GPU, as DGX H100/H200
nodes have): one ring per rail, each carrying 1/(GPUs per node) of the data and crossing each node
boundary on its own NIC (`ring_bytes_s`); KV writes (m tokens) are ignored beside the reads;
the two kernel classes and the all-reduces do not overlap. The step-time formula is PHYSICS.md's, with attention's KV read as its
own kernel (paged attention reads KV at a lower share of the bandwidth than GEMMs read weights) and the
all-reduces' bandwidth added; the coefficients (efficiencies, fixed overheads, activation reserve) are
the only fitted numbers, in `Coefficients`.

KV capacity = gpus x HBM x gpu_memory_utilization - weights - gpus x activation reserve.
Bytes per KV token = 2 L_full H_kv d_h b_kv (K and V), or L_full (kv_lora_rank + rope_dim) b_kv for MLA.
A hybrid model's per-sequence state takes from the same memory: the simulated engine charges it for each
sequence holding KV (gyre.hardware `Costs.state_tokens`, the state in KV-token units).

Expert parallel (vLLM's enable_expert_parallel, `ep_gpus` > gpus: the data-parallel replicas' GPUs
together): a replica holds the dense part and gpus / ep_gpus of the routed experts; its MoE layers read
the experts they hold that the whole group's N tokens touch and compute their share of those tokens,
and each MoE layer adds two collectives (dispatch and combine). The simulator's engine takes the group as
balanced (N = ep_gpus / gpus x its own tokens). What the collectives cost on the links (the all-reduce
ring's bus bandwidth, expert parallel's exchanges, the replicas' lockstep step) is gyre.roofline_comm's.

This module is pure (no simulator imports): `gyre.hardware` builds an `EngineRoofline` from model and
GPU presets, the simulator asks it for step times, and the engine calibrator fits `Coefficients`.
The formula this docstring states is EngineRoofline's; gyre.roofline_step computes the same one with the
per-step constants bound (the simulator's per-event call); the communication terms are gyre.roofline_comm's.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.roofline_comm import ep_costs, ring_bytes_s
from gyre.roofline_step import StepCost


@dataclass(frozen=True, kw_only=True)
class Coefficients:
    """The fittable constants of the engine step; every other number comes from a spec sheet or config file.

    Defaults and their sources:
    - eff_bw 0.8: memory-bound decode kernels reach 70-90% of data-sheet HBM bandwidth (NVIDIA's
      nvbandwidth / STREAM-style copies on H100 reach ~90%; GEMV-bound decode in vLLM and TensorRT-LLM
      is reported at 70-85%).
    - eff_kv 0.65: paged attention reads KV slower than a GEMM reads weights: vLLM's PagedAttention
      kernel takes 20-26% longer than FasterTransformer's contiguous-KV kernel on the same reads (Kwon
      et al., SOSP 2023, section 7.1), so 0.8 / 1.23.
    - eff_flops 0.6: large bf16 GEMMs and FlashAttention-2/3 reach 60-75% of dense peak on H100.
    - step_overhead_s 0.004: vLLM's per-step scheduling, sampling and launch time with CUDA graphs
      (a few ms per step in vLLM V1 profiles).
    - allreduce_s 10 us, allreduce_internode_s 30 us: latency of one small NCCL all-reduce inside an
      NVLink node, and across nodes over InfiniBand (nccl-tests small-message latencies).
    - eff_link 0.8: ring all-reduce bus bandwidth over the link's data-sheet rate (nccl-tests
      all_reduce_perf: 24.7 GB/s bus bandwidth on PCIe Gen4 x16 RTX 4090s, 31.5 GB/s per direction,
      tinygrad/open-gpu-kernel-modules#17; ~80% is also typical of NVLink H100 nodes).
    - gpu_memory_utilization 0.9: vLLM's default share of HBM it allows itself.
    - reserve_gb_per_gpu 2.0: activations, CUDA graphs and non-torch memory that vLLM's profiling run
      sets aside. Measured 1.24 GB in shared/data/vllm_timings/RTX4090_Llama-3.1-8B (0.9 x 25.25 GB
      HBM - 16.06 GB weights - 41,408 KV tokens x 128 KiB), at a 2,048-token budget and a
      4,096-wide model; rounded up for 8,192-token budgets and wider models.
    """

    eff_bw: float = 0.8
    eff_kv: float = 0.65
    eff_flops: float = 0.6
    step_overhead_s: float = 0.004
    allreduce_s: float = 10e-6
    allreduce_internode_s: float = 30e-6
    eff_link: float = 0.8
    gpu_memory_utilization: float = 0.9
    reserve_gb_per_gpu: float = 2.0


def kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, bytes_per_elem: float,
                       kv_lora_rank: int = 0, rope_dim: int = 0) -> float:
    """KV-cache bytes one token occupies: 2 L H_kv d_h b (K and V), or L (lora rank + rope dim) b for MLA."""
    if kv_lora_rank:
        return layers * (kv_lora_rank + rope_dim) * bytes_per_elem
    return 2 * layers * kv_heads * head_dim * bytes_per_elem


GDN_CHUNK = 64  # tokens per chunk of the chunked gated delta rule (flash-linear-attention's kernels, which vLLM runs)


def linear_attention_flops(*, value_heads: int, key_dim: int, value_dim: int, chunk: int, conv_channels: int,
                           conv_kernel: int) -> float:
    """FLOPs per token of one Gated DeltaNet layer beyond its projections, in the chunked form of Yang,
    Kautz & Hatamizadeh (arXiv 2412.06464, sec. 3.3: per chunk of C tokens and value head, the UT/WY
    transform W = T beta K, U = T beta V with T from K K^T, then U - W S^T, the output Q S^T + (Q K^T)(U - W S^T)
    and the state update K^T (U - W S^T)): six C x d_k x d_v products and the C x C ones, 2 C^2 (3 d_k + 2 d_v),
    so per token H_v (6 d_k d_v + C (6 d_k + 4 d_v)); the triangular solve for T (C^3 / 3, under 5% at
    C = 64) and the gates are left out. C = 1 is the recurrent form a decode step runs (its six d_k x d_v
    products: read-out, error, update). Plus the depthwise causal conv: 2 x kernel per channel."""
    return value_heads * (6.0 * key_dim * value_dim + chunk * (6.0 * key_dim + 4.0 * value_dim)) \
        + 2.0 * conv_kernel * conv_channels


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
    embed_bytes: float = 0.0  # an untied input embedding table: gathered by row, never read whole
    embed_params: float = 0.0  # parameters of the input embedding table (no FLOPs)
    head_params: float = 0.0  # parameters of the LM head (FLOPs only for tokens that sample)
    hidden: int = 0  # model width d: an all-reduce carries tokens x d activations
    link_bytes_s: float = 0.0  # GPU-to-GPU bandwidth per direction inside a node (NVLink, or PCIe)
    internode_bytes_s: float = 0.0  # per GPU across nodes
    max_batched_tokens: int = 8192  # vLLM's max_num_batched_tokens: decode + prefill tokens per step
    coef: Coefficients = Coefficients()
    attn_layers: int | None = None  # full-attention layers (attention FLOPs grow with context); None: all
    state_bytes: float = 0.0  # linear-attention state per sequence: read and written by each step it is in
    lin_decode_flops: float = 0.0  # linear-attention FLOPs per decoded token (recurrent form)
    lin_prefill_flops: float = 0.0  # linear-attention FLOPs per prefilled token (chunked form)
    # expert parallel (vLLM's enable_expert_parallel): the routed experts spread over `ep_gpus` GPUs (the DP
    # replicas' GPUs together; <= gpus: none) and each MoE layer moves tokens by `ep_backend` (ep_comm_bytes)
    ep_gpus: int = 0
    ep_backend: str = "allgather_reducescatter"
    routed_active_params: float = 0.0  # routed-expert parameters one token passes through (k of E experts)

    def __post_init__(self) -> None:
        # per-step constants, so step_and_ideal is a handful of float operations
        c = self.coef
        bw, pk = self.gpus * self.bw_bytes_s, self.gpus * self.flops
        object.__setattr__(self, "_bw", bw * c.eff_bw)
        object.__setattr__(self, "_bk", bw * c.eff_kv)
        object.__setattr__(self, "_pk", pk * c.eff_flops)
        object.__setattr__(self, "_bw1", bw)
        object.__setattr__(self, "_pk1", pk)
        ar = comm = 0.0
        g = self.gpus
        if g > 1:
            across = g > self.gpus_per_node
            link = ring_bytes_s(self.link_bytes_s, self.internode_bytes_s, self.gpus_per_node, across)
            ar = 2 * self.layers * (c.allreduce_internode_s if across else c.allreduce_s)
            if link > 0:  # seconds per token: 2 L ring all-reduces of d bf16 activations
                comm = 2 * self.layers * 2.0 * (g - 1) / g * self.hidden * 2.0 / (link * c.eff_link)
        ep_token = 0.0
        if self.expert_parallel:
            ep_fixed, ep_token = ep_costs(self)
            ar += ep_fixed
        object.__setattr__(self, "_fixed", c.step_overhead_s + ar)
        object.__setattr__(self, "_tp_comm", comm)
        object.__setattr__(self, "_ep_comm", ep_token)  # seconds per token of the EP group's step
        object.__setattr__(self, "_comm", comm + ep_token * (self.ep_gpus / g if self.expert_parallel else 0.0))
        object.__setattr__(self, "_attn", 4.0 * (self.layers if self.attn_layers is None
                                                     else self.attn_layers) * self.q_heads * self.head_dim)
        object.__setattr__(self, "_dense", self.weight_bytes - self.routed_bytes - self.embed_bytes)
        # expert parallel: this replica holds gpus / ep_gpus of the experts, and in a balanced group its
        # MoE layers see ep_gpus / gpus times its own tokens (every replica's, routed to its experts)
        ep_share = self.gpus / self.ep_gpus if self.expert_parallel else 1.0
        object.__setattr__(self, "_routed", self.routed_bytes * ep_share)
        object.__setattr__(self, "_ep_fan", 1.0 / ep_share)
        object.__setattr__(self, "_miss", 1.0 - self.top_k / self.experts if self.experts else 0.0)
        object.__setattr__(self, "_2p", 2.0 * (self.active_params - self.embed_params - self.head_params))
        object.__setattr__(self, "_2h", 2.0 * self.head_params)

    @property
    def expert_parallel(self) -> bool:
        """Whether the routed experts are spread beyond this replica's GPUs (expert parallel over DP replicas)."""
        return self.ep_gpus > self.gpus and self.experts > 0

    # --- memory ---
    @property
    def held_weight_bytes(self) -> float:
        """Weights this replica's GPUs hold: all of them, or under expert parallel the dense part and its
        gpus / ep_gpus share of the routed experts."""
        if not self.expert_parallel:
            return self.weight_bytes
        return self.weight_bytes - self.routed_bytes + self.routed_bytes * self.gpus / self.ep_gpus

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens the engine holds: gpus x HBM x utilization - weights held - gpus x activation reserve."""
        c = self.coef
        free = self.gpus * (self.hbm_bytes * c.gpu_memory_utilization - c.reserve_gb_per_gpu * 1e9) \
            - self.held_weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    # --- one step ---
    def weight_bytes_read(self, tokens: float) -> float:
        """Weight bytes one step reads for `tokens` tokens: the dense part (not the input embedding table),
        plus the distinct experts touched."""
        if tokens <= 0:
            return 0.0
        if not self.routed_bytes:
            return self._dense
        if self.expert_parallel:
            return self._dense + self._routed * (1.0 - self._miss ** (tokens * self._ep_fan))
        return self._dense + self.routed_bytes * (1.0 - self._miss ** tokens)

    def step_time(self, n: int, ctx: float, m: float = 0.0, p: float = 0.0) -> float:
        """Seconds of one step: n decodes at total context ctx, plus a prefill chunk of m tokens at offset p."""
        return self.step_and_ideal(n, ctx, m, p)[0]

    def step_and_ideal(self, n: int, ctx: float, m: float = 0.0, p: float = 0.0) -> tuple[float, float]:
        """(step_time, the part of it the hardware peak needs: both kernel classes' max(bytes / BW,
        FLOPs / peak) at 100% efficiency, without overheads or all-reduces)."""
        return self.stepper().both(n, ctx, m, p)

    def stepper(self) -> StepCost:
        """step_and_ideal with this engine's constants bound in (gyre.roofline_step): the simulator calls it
        once per event. Built once per roofline and kept out of pickles."""
        f = self.__dict__.get("_stepper")
        if f is None:
            f = StepCost(self)
            object.__setattr__(self, "_stepper", f)
        return f

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_stepper", None)  # rebuilt on first use
        return state

    def ideal_share(self, n: int, ctx: float, m: float = 0.0, p: float = 0.0) -> float:
        """The share of a step's time the hardware peak needs (see step_and_ideal): its roofline utilization."""
        t, ideal = self.step_and_ideal(n, ctx, m, p)
        return ideal / t if t > 0 else 0.0

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

        c = np.asarray(ctx, dtype=float)
        lin = max(self.weight_bytes_read(1) / self._bw, (self._2p + self._2h) / self._pk)
        att = np.maximum(self.kv_bytes_per_token * c / self._bk + 2.0 * self.state_bytes / self._bw,
                         (self._attn * c + self.lin_decode_flops) / self._pk)
        return lin + att + self._fixed + self._comm

    # --- minima, for a lower bound on what the engine charges ---
    def min_prefill_time_per_token(self, offset):
        """No prefill token starting at `offset` (array) takes less engine time than this, in any step:
        a step's chunk is at most the budget, reads at least its weights and costs at least
        2 (P - embedding - head) FLOPs per token, plus attention's 4 L H d_h p and the linear layers' chunked
        FLOPs (a chunk's own m^2 / 2, the prefix read and the state read only add), and the token's share
        of the all-reduces and fixed overhead."""
        import numpy as np

        b = float(self.max_batched_tokens)
        p = np.asarray(offset, dtype=float)
        lin = max(self.weight_bytes_read(b) / b / self._bw, self._2p / self._pk)
        return lin + (self._attn * p + self.lin_prefill_flops) / self._pk + self._comm + self._fixed / b

    def min_busy_time(self, *, tokens: float, kv_read_tokens: float, flops: float, max_step_tokens: float,
                      state_reads: float = 0.0) -> float:
        """A lower bound on the engine time that processes `tokens` tokens (decoded or prefilled) reading at
        least `kv_read_tokens` KV tokens and `state_reads` sequences' linear-attention states (each read and
        written) and computing at least `flops` FLOPs, at most `max_step_tokens`
        per step: each step costs at least max(weights / BW + KV / BW_kv, FLOPs / peak) (a sum of two
        maxima is at least the max of the sums), and summed over steps that is at least the same of the
        totals; the weights a step of N tokens reads per token, W(N) / N, only falls as N grows (W is
        concave through 0), and there are >= tokens / N_max steps."""
        if tokens <= 0:
            return 0.0
        mem = tokens * self.weight_bytes_read(max_step_tokens) / max_step_tokens / self._bw \
            + self.kv_bytes_per_token * kv_read_tokens / self._bk
        if state_reads:
            mem += 2.0 * self.state_bytes * state_reads / self._bw
        return max(mem, flops / self._pk) + self._comm * tokens + self._fixed * tokens / max_step_tokens

    @property
    def flops_per_token(self) -> float:
        """The least FLOPs of one token outside attention: 2 x (active parameters - embedding - LM head)."""
        return self._2p

    @property
    def attn_flops_per_ctx(self) -> float:
        """4 L H d_h: attention FLOPs of one token per token of context (full-attention layers only)."""
        return self._attn

    @property
    def hybrid(self) -> bool:
        """Some layers are linear attention (a per-sequence state, FLOPs linear in tokens)."""
        return bool(self.state_bytes or self.lin_decode_flops or self.lin_prefill_flops)
