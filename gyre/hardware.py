"""The cost model derived from a GPU's and a model's descriptions (gyre.datasheets: GpuConfig, ModelConfig).

Every simulator constant comes from here and is derived from a model's shape and a GPU's data sheet
(cited beside each preset in gyre.presets), never tuned by hand:

- Engine size: the fewest GPUs (power of two, up to whole nodes) whose memory holds the inference
  weights at <= `weight_fraction` of HBM.
- Engine step and KV capacity: gyre.roofline (bytes moved / bandwidth vs FLOPs / peak, plus a fixed
  overhead; the weights an MoE step reads follow the distinct experts its tokens touch; capacity =
  GPUs x HBM x gpu_memory_utilization - weights - an activation reserve per GPU).
- Hybrid linear attention (Qwen3-Next, Qwen3.5): `ModelConfig.layout` says which layers are full attention
  (GQA or MLA) and which Gated DeltaNet. KV per token counts the full layers only; each sequence holding KV
  also holds a fixed linear-attention state (recurrent H_v d_k d_v plus the conv inputs per linear layer,
  `state_bytes_per_seq`), which the engine charges against its KV memory (`Costs.state_tokens`) and each
  step reads and writes; the linear layers' FLOPs are linear in tokens (gyre.roofline.linear_attention_flops)
  and attention's grow with context on the full layers only, at inference and in training. Not modelled:
  vLLM's hybrid allocator sizing attention and state pages alike (its padding), and prefix-cached states
  kept at more than one point of a context.
- Training: 6 x active params FLOPs per token plus attention 12 L H d_h per token per context token,
  at `train_mfu`, plus 2 x active params and 4 L H d_h per context token for each extra forward pass
  (`train_extra_forwards`: recomputing activations under full checkpointing, recomputing the old
  policy's log-probs); the trainer needs enough GPUs to hold `train_bytes_per_param` per parameter
  (weights + grads + optimizer state, sharded) plus the activations of its longest sequence
  (`train_seq_tokens`, full activation checkpointing: each layer's bf16 input, 2 S d bytes per layer,
  plus one layer's working set in the backward pass, 34 S d bytes (Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", eq. 2 with flash attention, so no
  S^2 term), d = the model width, `ModelConfig.width`), plus, for a hybrid model, the chunk-boundary
  states of one linear layer's backward pass ((S / 64) x H_v d_k d_v), at 85% of HBM.
- Running sequences per engine: vLLM's `max_num_seqs`; unset, vLLM's own default for the GPU
  (`vllm_default_max_num_seqs`).
- Executions an engine is handed at once (`admission_limit`): floor(admission_fill x KV capacity / the
  workload's window), at least 1: the concurrency vLLM itself reports at start-up ("Maximum concurrency
  for N tokens per request"), the count whose contexts all fit however far each grows up to the window.
- Weight sync: per-GPU weight shard / inter-node bandwidth + latency.
- Role switch: engine wake = weight shard / host-to-device bandwidth + fixed (graph capture,
  allocator); trainer on/offload = trainer state shard / host-to-device bandwidth.
- Restart after a crash (injected faults, gyre.sim.cluster.faults): the node survives, so the weights come from its
  page cache over the host-to-device link. Engine: weight shard / host-to-device bandwidth + a process
  start-up of 64 s (imports and engine init 34 s, Dynamo 10 s, graph compilation 13 s, CUDA-graph capture
  7 s: vLLM serving Llama-3.1-8B on L40S with warm caches, tensorfuse.io, "Reducing GPU Cold Start Time
  when using vLLM", 2025); trainer worker: its state shard / host-to-device bandwidth + 34 s (the same
  source's imports and init, no compilation).

Network: 400 Gb/s InfiniBand per GPU (50 GB/s); PCIe Gen5 x16 (~55 GB/s practical host<->device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gyre.datasheets import GpuConfig, ModelConfig
from gyre.roofline import GDN_CHUNK, Coefficients, EngineRoofline

@dataclass(frozen=True, kw_only=True)
class CostConfig:
    """Efficiency factors and engine settings (the only constants not read off a data sheet)."""

    weight_fraction: float = 0.6  # an engine's weights may fill at most this share of its HBM
    engine: Coefficients = Coefficients()  # the engine step's fitted constants (gyre.roofline)
    max_batched_tokens: int = 8192  # vLLM max_num_batched_tokens (its default with chunked prefill)
    max_num_seqs: int | None = None  # vLLM max_num_seqs: running sequences per engine (None: vLLM's default)
    kv_reserve: bool = False  # admit only if the execution's largest context fits (no preemption)
    train_mfu: float = 0.35
    train_extra_forwards: int = 0  # forward passes per step beyond the one backward needs (recompute)
    train_seq_tokens: int = 0  # the longest trained sequence, whose activations the trainer must hold
    sync_latency_s: float = 0.5
    engine_wake_fixed_s: float = 5.0
    engine_sleep_s: float = 2.0
    migration: str = "reprefill"  # or "kv_transfer"
    # when a migration of a decoding execution happens: "tool" at its next tool-call boundary; "request" at once,
    # its in-flight model request cancelled at the source and retried at the destination (gyre.sim.cluster.backend)
    move_at: str = "tool"
    engine_restart_fixed_s: float = 64.0  # a crashed engine's process start-up, weights aside (module docstring)
    trainer_restart_fixed_s: float = 34.0  # a crashed trainer worker's process start-up, state aside
    request_s: float = 0.0  # latency outside the engine per turn (driver RPC, event loop); 0: none modelled
    ep_engines: int = 1  # an MoE served expert parallel: its experts spread over this many engines' GPUs
    ep_backend: str = "allgather_reducescatter"  # or "all_to_all" (DeepEP / pplx): gyre.roofline_comm.ep_comm_bytes
    admission_fill: float = 1.0  # share of KV capacity the admission limit may commit (`admission_limit`)

    def __post_init__(self) -> None:
        check_fill(self.admission_fill)
        check_move_at(self.move_at)
        if isinstance(self.ep_engines, bool) or not isinstance(self.ep_engines, int) or self.ep_engines < 1:
            raise ValueError(f"ep_engines must be an integer >= 1, got {self.ep_engines!r}")
        if self.ep_backend not in ("allgather_reducescatter", "all_to_all"):
            raise ValueError(f"ep_backend must be 'allgather_reducescatter' or 'all_to_all', got {self.ep_backend!r}")
        r = self.request_s
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < math.inf:
            raise ValueError(f"request_s must be a finite number of seconds >= 0, got {r!r}")
        if self.max_num_seqs is not None and (isinstance(self.max_num_seqs, bool) or self.max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")


MOVE_AT = ("tool", "request")  # when a decoding execution's migration happens (CostConfig.move_at)


def check_move_at(move_at: object, name: str = "move_at") -> None:
    """A migration mode must be one of MOVE_AT (a ValueError naming `name` otherwise)."""
    if move_at not in MOVE_AT:
        raise ValueError(f"{name} must be 'tool' or 'request', got {move_at!r}")


def check_fill(fill: object, name: str = "admission_fill") -> None:
    """An admission fill must be a number in (0, 1] (a ValueError naming `name` otherwise)."""
    if isinstance(fill, bool) or not isinstance(fill, (int, float)) or not 0 < fill <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {fill!r}")


def admission_limit(kv_capacity_tokens: float, window: int, fill: float = 1.0, state_tokens: float = 0.0) -> int:
    """Executions an engine may be handed at once: floor(fill x KV capacity / (window + a hybrid model's
    per-sequence state, `Costs.state_tokens`)), at least 1.

    `window` is the largest context a workload lets an execution reach before it compacts (vLLM's
    max_model_len; the simulator's `context_window`, the real task's `context_limit`). So many contexts fit
    the engine's KV together however far each grows, so growth alone never makes the admitted set outgrow
    it (only a turn that passes the window, or a sub-agent beside its parent, can; preemption covers them).
    It is known before any execution runs, without foresight of lengths."""
    return max(1, int(fill * kv_capacity_tokens // (max(window, 1) + state_tokens)))


def vllm_default_max_num_seqs(gpu: GpuConfig, max_batched_tokens: int) -> int:
    """vLLM's default `max_num_seqs` when the user sets none (V1 engine, OpenAI server and LLM class alike):
    1024 on a GPU with at least 70 GiB of memory that is not an A100, 256 otherwise, and never more than
    the step's token budget (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults and its caller:
    vllm-project/vllm PRs #16158, #17073, #17885; the RTX 4090 run in shared/data/vllm_timings logs
    256, as this gives)."""
    big = gpu.memory_gb * 1e9 >= 70 * 2**30 and "a100" not in gpu.name.lower()
    return min(1024 if big else 256, max_batched_tokens)


@dataclass(frozen=True)
class Costs:
    """All derived per-engine and per-run cost constants (seconds, tokens, bytes).

    The engine step is the roofline `roofline` when set; without one (hand-built or calibrated costs)
    it is linear: a + b * decodes + c * decode context + prefill_s_per_token * prefill tokens, and a
    zero prefill_s_per_token makes prefill free. `request_s` is latency outside the engine (the driver's
    RPC and event loop, calibrated from a real run): each turn's request waits that long before it
    reaches its engine, delaying that execution alone; derived costs have none."""

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
    roofline: EngineRoofline | None = None
    max_batched_tokens: int = 8192
    max_num_seqs: int = 0  # running (prefilling or decoding) sequences an engine holds at most; 0: no limit
    kv_reserve: bool = False
    train_attn_flops_per_ctx_token: float = 0.0  # 12 L H d_h: training attention FLOPs per token per context token
    train_flops_per_s_gpu: float = 0.0  # GPU peak x train MFU (0: training time is linear in tokens)
    train_mfu: float = 0.0  # the share of peak training runs at (0: unknown; utilization leaves training out)
    engine_restart_s: float = 0.0  # a crashed engine back up (start-up + weight load; injected faults)
    trainer_restart_s: float = 0.0  # a crashed trainer worker back up with its state (injected faults)
    request_s: float = 0.0  # per-turn latency outside the engine, charged to the execution alone
    state_tokens: float = 0.0  # linear-attention state of one sequence holding KV, in KV tokens (0: none)
    admission_fill: float = 1.0  # share of KV capacity the admission limit commits (admission_limit)
    # streaming steps on cells (gyre.cluster.StepView): what a satellite pulls (the core's bf16 weights) and what
    # every cell's gradients weigh (bf16, the same size), over each GPU's own inter-node link; 0: free
    train_weight_bytes: float = 0.0
    link_bytes_s: float = 0.0
    link_latency_s: float = 0.0
    move_at: str = "tool"  # CostConfig.move_at: a decoding execution migrates at its tool-call boundary, or at once

    def _over_link(self, nbytes: float) -> float:
        return nbytes / self.link_bytes_s + self.link_latency_s if self.link_bytes_s else 0.0

    def snapshot_pull_s(self, cell_gpus: int) -> float:
        """A joining satellite pulls the core's weight snapshot: each of its GPUs its shard, from its
        counterpart in the core, over its own link (all shards in parallel)."""
        return self._over_link(self.train_weight_bytes / cell_gpus)

    def grad_send_s(self, cell_gpus: int) -> float:
        """A satellite leaving a step sends the gradients it accumulated to the core (one shard per GPU)."""
        return self._over_link(self.train_weight_bytes / cell_gpus)

    def grad_reduce_s(self, cells: int, cell_gpus: int) -> float:
        """The cells' gradients summed into the core at a step's end: a ring reduction over `cells` cells, each
        GPU shard with its counterparts, moves 2 (k - 1) / k of a shard per link (Patarasuk & Yuan 2009, "Bandwidth
        optimal all-reduce algorithms"; the core then holds the sum). One cell: nothing to reduce."""
        if cells <= 1:
            return 0.0
        return self._over_link(2.0 * (cells - 1) / cells * self.train_weight_bytes / cell_gpus)

    def step_time(self, batch: int, kv_tokens: float, chunk: float = 0.0, offset: float = 0.0) -> float:
        """One engine step: `batch` decodes at total context `kv_tokens`, plus `chunk` prefill tokens at `offset`."""
        if self.roofline is not None:
            return self.roofline.step_time(batch, kv_tokens, chunk, offset)
        return self.step_a + self.step_b * batch + self.step_c * kv_tokens + self.prefill_s_per_token * chunk

    def prefill_time(self, tokens: float, offset: float = 0.0) -> float:
        """Seconds to prefill `tokens` after `offset` alone on an engine."""
        if self.roofline is not None:
            return self.roofline.prefill_time(tokens, offset)
        if tokens <= 0 or self.prefill_s_per_token == 0:
            return 0.0
        return math.ceil(tokens / self.max_batched_tokens) * self.step_a + tokens * self.prefill_s_per_token

    def decode_s_per_token(self, ctx):
        """Seconds per token of one sequence decoding alone at context ctx (an array): the least any decode pays."""
        if self.roofline is not None:
            return self.roofline.decode_time(ctx)
        return self.step_a + self.step_b + self.step_c * np.asarray(ctx, dtype=float)

    def min_prefill_s_per_token(self, offset):
        """The least engine time a prefill token at `offset` (an array) costs in any step."""
        if self.roofline is not None:
            return self.roofline.min_prefill_time_per_token(offset)
        if self.prefill_s_per_token == 0:  # free prefill
            return np.zeros(np.shape(offset))
        return np.full(np.shape(offset), self.step_a / self.max_batched_tokens + self.prefill_s_per_token)

    def train_time(self, tokens: float, gpus: int, attn_ctx_tokens: float = 0.0) -> float:
        """Training time of `tokens` tokens on `gpus` GPUs; `attn_ctx_tokens` = sum over tokens of their context."""
        return (tokens * self.train_s_per_token_gpu
                + (attn_ctx_tokens * self.train_attn_flops_per_ctx_token / self.train_flops_per_s_gpu
                   if self.train_flops_per_s_gpu else 0.0)) / gpus

    def switch_in_s(self, to: str, resident: str | None) -> float:
        """Seconds one GPU takes to serve as `to` ("engine" or "trainer") while its memory holds `resident`: an
        engine wakes and loads the latest weights (offloading a resident trainer first); a trainer onloads its
        state unless it is resident already."""
        if to == "engine":
            return self.engine_wake_s + self.sync_s + (self.trainer_offload_s if resident == "trainer" else 0.0)
        return 0.0 if resident == "trainer" else self.trainer_onload_s

    def best_decode_tokens_per_gpu_s(self, mean_context: float) -> float:
        """Peak decode throughput per GPU: an engine full of sequences of `mean_context` tokens."""
        n = max(1, int(self.kv_capacity_tokens // (max(mean_context, 1.0) + self.state_tokens)))
        n = min(n, self.max_batched_tokens)
        return n / self.step_time(n, n * mean_context) / self.engine_gpus


def train_attention_ctx(prompt: int, gen, kv, tool_out) -> float:
    """Sum over an execution's trained tokens of the context each attends to (its position in the
    sequence): the prompt (p^2 / 2), then each turn's generated tokens after the turn's context and the
    tool output after those. Training attention FLOPs = 12 L H d_h x this sum.

    The per-turn terms are summed as numpy sums so few of them, in order: executions of up to 7 turns
    (a request trace's million single-turn ones among them) take that plain-Python path, longer ones
    numpy's pairwise sum; both give numpy's bits."""
    n = len(gen)
    if n == 1:  # a request: one generated segment, no tool output
        g = float(gen[0])
        k = float(kv[0])
        o = float(tool_out[0]) if tool_out else 0.0
        return float(0.5 * prompt * prompt + (g * k + 0.5 * g * g + o * (k + g) + 0.5 * o * o))
    if n <= 7:
        no = len(tool_out)
        total = 0.0
        for i in range(n):
            g = float(gen[i])
            k = float(kv[i])
            o = float(tool_out[i]) if i < no else 0.0
            total += g * k + 0.5 * g * g + o * (k + g) + 0.5 * o * o
        return float(0.5 * prompt * prompt + total)
    g = np.asarray(gen, dtype=float)
    k = np.asarray(kv, dtype=float)
    o = np.zeros(len(g))
    o[: len(tool_out)] = tool_out
    return float(0.5 * prompt * prompt + np.sum(g * k + 0.5 * g * g + o * (k + g) + 0.5 * o * o))


def group_train_attention_ctx(executions) -> float:
    """A GRPO group's training attention context sum: the shared prompt once, every execution's own tokens."""
    p = executions[0].prompt
    return 0.5 * p * p + sum(train_attention_ctx(e.prompt, e.gen, e.kv, e.tool_out) - 0.5 * e.prompt * e.prompt
                             for e in executions)


def _pow2_at_least(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def engine_roofline(model: ModelConfig, gpu: GpuConfig, gpus: int, coef: Coefficients | None = None,
                    max_batched_tokens: int = 8192, ep_gpus: int = 0,
                    ep_backend: str = "allgather_reducescatter") -> EngineRoofline:
    """The step-time and memory model of an engine of `gpus` GPUs serving `model`; `ep_gpus` > gpus: its
    routed experts spread over that many GPUs (expert parallel across data-parallel replicas)."""
    fp8 = model.infer_bytes_per_param <= 1
    embed = 0.0 if model.tied_embeddings else model.head_params  # an untied input table: gathered, not read
    lin_dec, lin_pf = model.linear_flops_per_token
    return EngineRoofline(
        gpus=gpus, gpus_per_node=gpu.gpus_per_node, hbm_bytes=gpu.memory_gb * 1e9, bw_bytes_s=gpu.hbm_tb_s * 1e12,
        flops=(gpu.fp8_tflops if fp8 else gpu.bf16_tflops_gemm or gpu.bf16_tflops) * 1e12, layers=model.layers,
        q_heads=model.q_heads or model.kv_heads, head_dim=model.head_dim, kv_bytes_per_token=model.kv_bytes_per_token,
        weight_bytes=model.infer_weight_bytes, routed_bytes=model.routed_params_b * 1e9 * model.infer_bytes_per_param,
        experts=model.experts, top_k=model.top_k, active_params=model.active_params_b * 1e9,
        embed_bytes=embed * model.infer_bytes_per_param, embed_params=embed, head_params=model.head_params,
        hidden=model.width, link_bytes_s=gpu.link_gb_s * 1e9, internode_bytes_s=gpu.internode_gb_s * 1e9,
        max_batched_tokens=max_batched_tokens, coef=coef or Coefficients(), ep_gpus=ep_gpus, ep_backend=ep_backend,
        routed_active_params=model.routed_params_b * 1e9 * model.top_k / model.experts if model.experts else 0.0,
        attn_layers=model.full_layers, state_bytes=model.state_bytes_per_seq, lin_decode_flops=lin_dec,
        lin_prefill_flops=lin_pf,
    )


def derive_costs(model: ModelConfig, gpu: GpuConfig, cost: CostConfig | None = None) -> Costs:
    cost = cost or CostConfig()
    hbm = gpu.memory_gb * 1e9
    engine_gpus = _pow2_at_least(model.infer_weight_bytes / (cost.weight_fraction * hbm))
    if engine_gpus > gpu.gpus_per_node:  # multi-node engines come in whole nodes
        engine_gpus = gpu.gpus_per_node * math.ceil(engine_gpus / gpu.gpus_per_node)
    roof = engine_roofline(model, gpu, engine_gpus, cost.engine, cost.max_batched_tokens,
                           ep_gpus=engine_gpus * cost.ep_engines, ep_backend=cost.ep_backend)
    # the linear form's coefficients (a + b n + c K: the roofline's terms summed instead of maxed)
    step_b = roof.flops_per_token / roof._pk
    step_a = roof.step_time(1, 0.0) - step_b
    step_c = roof.kv_bytes_per_token / roof._bk
    prefill = roof.prefill_time(cost.max_batched_tokens) / cost.max_batched_tokens
    active = model.active_params_b * 1e9
    train_flops = gpu.bf16_tflops * 1e12 * cost.train_mfu
    # linear-attention layers: forward + backward 3x their forward FLOPs, plus each extra forward
    lin_fwd = model.linear_flops_per_token[1]
    train_per_token_gpu = ((6 + 2 * cost.train_extra_forwards) * active
                           + (3 + cost.train_extra_forwards) * lin_fwd) / train_flops
    width = (model.q_heads or model.kv_heads) * model.head_dim
    state_bytes, activations = train_memory_bytes(model, cost)
    train_bytes = state_bytes + activations
    min_train = _pow2_at_least(train_bytes / (0.85 * hbm))  # within a node: a power of two
    if min_train > gpu.gpus_per_node:  # across nodes: whole nodes
        min_train = gpu.gpus_per_node * math.ceil(train_bytes / (0.85 * hbm) / gpu.gpus_per_node)
    shard = model.infer_weight_bytes / engine_gpus
    train_shard = state_bytes / max(min_train, 1)  # what on/offload moves (activations are rebuilt)
    return Costs(
        engine_gpus=engine_gpus,
        kv_capacity_tokens=roof.kv_capacity_tokens,
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
        roofline=roof,
        max_batched_tokens=cost.max_batched_tokens,
        max_num_seqs=(cost.max_num_seqs if cost.max_num_seqs is not None
                      else vllm_default_max_num_seqs(gpu, cost.max_batched_tokens)),
        kv_reserve=cost.kv_reserve,
        train_attn_flops_per_ctx_token=(12.0 + 4.0 * cost.train_extra_forwards) * model.full_layers * width,
        train_flops_per_s_gpu=train_flops,
        train_mfu=cost.train_mfu,
        engine_restart_s=shard / (gpu.host_gb_s * 1e9) + cost.engine_restart_fixed_s,
        trainer_restart_s=train_shard / (gpu.host_gb_s * 1e9) + cost.trainer_restart_fixed_s,
        request_s=cost.request_s,
        state_tokens=model.state_bytes_per_seq / model.kv_bytes_per_token,
        admission_fill=cost.admission_fill,
        train_weight_bytes=2.0 * model.total_params_b * 1e9,  # bf16 weights (and bf16 gradients: the same bytes)
        link_bytes_s=gpu.internode_gb_s * 1e9,
        link_latency_s=cost.sync_latency_s,
        move_at=cost.move_at,
    )


def train_memory_bytes(model: ModelConfig, cost: CostConfig) -> tuple[float, float]:
    """(training state, activations) in bytes that a trainer must hold, summed over its GPUs: `train_bytes_per_param`
    per parameter, and the activations of its longest sequence (`train_seq_tokens`) under full activation
    checkpointing (2 S d bytes per layer plus one layer's backward working set of 34 S d, plus a hybrid model's
    chunk states; see the module docstring). derive_costs sizes the trainer's minimum from their sum."""
    activations = cost.train_seq_tokens * model.width * (2 * model.layers + 34) \
        + _chunk_states(model, cost.train_seq_tokens)
    return model.total_params_b * 1e9 * model.train_bytes_per_param, activations


def _chunk_states(model: ModelConfig, seq_tokens: int) -> float:
    """Bytes the backward pass of one linear-attention layer needs beyond a full layer's working set: the
    state at every chunk boundary, (S / C) x H_v d_k d_v (the chunked kernel keeps them for the backward
    pass; under full checkpointing one layer's at a time)."""
    if not model.linear_layers or not seq_tokens:
        return 0.0
    chunks = math.ceil(seq_tokens / GDN_CHUNK)
    return float(chunks * model.linear_value_heads * model.linear_key_head_dim * model.linear_value_head_dim
                 * model.state_bytes_per_elem)
