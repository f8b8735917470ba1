"""The serving-engine step cost a real vLLM run is replayed through: GPU and model specs, one step's time.

One engine step on a replica of `t` GPUs (tensor parallel) processes, for every scheduled sequence,
`m` new tokens starting at position `p` (a decode is m = 1 at p = its context; a prefill chunk is the
next m prompt tokens). With W the weight bytes read, KV bytes per token k, P the non-embedding active
parameters (lm_head apart), L layers, H query heads, d_h head dim, d model width, V vocabulary:

- bytes = W + k * sum(p + m)   (every weight once per step: dense; MoE: the shared part plus, per MoE
  layer, the expected distinct experts `E * (1 - (1 - k_top/E)^n)` the step's n tokens touch);
- FLOPs = 2 * P * sum(m) + 2 * d * V * s + 4 * L * H * d_h * sum(m * p + m^2 / 2), with s the sequences
  sampled this step (vLLM computes logits only where it samples);
- time = max(bytes / (t * BW * eff_bw), FLOPs / (t * peak * eff_flops)) + comm + overhead_s, where
  comm = 2 all-reduces per layer of sum(m) * d * 2 bytes over the GPU link, ring: 2 (t-1)/t of them
  per GPU (0 at t = 1).

The fitted coefficients (StepCoeffs) are the two efficiencies and the fixed per-step overhead; they do
not depend on the model, and the efficiencies are as hardware-independent as physics allows (a share
of each GPU's own peak). Not modelled: the embedding gather (a few rows, not the table), norms and
activations' memory traffic, kernel-launch detail, CPU/GPU overlap of async scheduling.

Sources are cited next to each preset number. GPU memory is in GB of 1e9 bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True, kw_only=True)
class ServingGpu:
    name: str
    memory_gb: float
    hbm_tb_s: float
    bf16_tflops: float  # dense (no sparsity), FP32 accumulate
    link_gb_s: float  # GPU-to-GPU bandwidth per direction for tensor-parallel all-reduce
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ServingModel:
    """A transformer's shape, read off its Hugging Face config.json."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (0 for an all-MoE model)
    vocab: int
    tied_embeddings: bool = False
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0
    moe_intermediate: int = 0
    bytes_per_param: float = 2.0  # bf16
    kv_bytes_per_elem: float = 2.0
    aliases: tuple[str, ...] = ()

    @property
    def attn_params(self) -> int:
        d, hd = self.hidden, self.head_dim
        return d * self.heads * hd * 2 + d * self.kv_heads * hd * 2  # q, o; k, v

    @property
    def expert_params(self) -> int:
        """One routed expert of one layer (gate, up, down)."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def layer_shared_params(self) -> int:
        """Per layer, what every token reads: attention, the dense MLP (or the router of an MoE layer)."""
        mlp = 3 * self.hidden * self.intermediate if not self.experts else self.hidden * self.experts
        return self.attn_params + mlp

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def total_params(self) -> int:
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (self.layer_shared_params + self.experts * self.expert_params) + emb

    @property
    def active_body_params(self) -> int:
        """Per token, without embedding and lm_head: the shared part plus top_k experts per layer."""
        return self.layers * (self.layer_shared_params + self.top_k * self.expert_params)

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem

    def weight_bytes_read(self, n_tokens: float) -> float:
        """Weights one step reads (no embedding table: a gather of a few rows)."""
        shared = self.layers * self.layer_shared_params + self.lm_head_params
        if not self.experts:
            return shared * self.bytes_per_param
        e = self.experts
        distinct = e * (1.0 - (1.0 - self.top_k / e) ** max(n_tokens, 1.0))
        return (shared + self.layers * distinct * self.expert_params) * self.bytes_per_param


@dataclass(frozen=True, kw_only=True)
class StepCoeffs:
    """The fitted part of the step cost; the defaults are first principles (specs only)."""

    eff_bw: float = 1.0  # share of the data-sheet memory bandwidth reached
    eff_flops: float = 1.0  # share of the data-sheet dense bf16 FLOP/s reached
    overhead_s: float = 0.0  # fixed per step: scheduling, sampling, launches

    def to_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


FITTED = tuple(f.name for f in fields(StepCoeffs))


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """A step-time function for one replica: model on `tp` GPUs of a kind, with coefficients."""

    model: ServingModel
    gpu: ServingGpu
    tp: int
    coeffs: StepCoeffs = StepCoeffs()

    def time(self, tokens: float, kv_tokens: float, attn: float, sampled: int) -> float:
        """Seconds for a step of `tokens` new tokens reading `kv_tokens` of KV, with attention term
        sum(m * p + m^2 / 2) = `attn`, sampling `sampled` sequences."""
        m, g, c, t = self.model, self.gpu, self.coeffs, self.tp
        byt = m.weight_bytes_read(tokens) + m.kv_bytes_per_token * kv_tokens
        fl = (2.0 * m.active_body_params * tokens + 2.0 * m.lm_head_params * sampled
              + 4.0 * m.layers * m.heads * m.head_dim * attn)
        mem = byt / (t * g.hbm_tb_s * 1e12 * c.eff_bw)
        comp = fl / (t * g.bf16_tflops * 1e12 * c.eff_flops)
        comm = 0.0
        if t > 1:
            comm = 2 * m.layers * 2.0 * (t - 1) / t * tokens * m.hidden * 2.0 / (g.link_gb_s * 1e9)
        return (mem if mem > comp else comp) + comm + c.overhead_s

    def kv_tokens_capacity(self, gpu_memory_utilization: float) -> int:
        """KV tokens one replica holds when the run did not log it: its share of HBM minus weights.
        An upper bound: vLLM also reserves the activation peak of its profiling run."""
        free = gpu_memory_utilization * self.tp * self.gpu.memory_gb * 1e9 - self.model.weight_bytes
        return max(0, int(free / self.model.kv_bytes_per_token))


GPUS: dict[str, ServingGpu] = {
    # NVIDIA Ada Lovelace GPU architecture whitepaper (v2.1), appendix A, GeForce RTX 4090: 24 GB GDDR6X,
    # 1008 GB/s, peak BF16 tensor 165.2 TFLOPS dense with FP32 accumulate; PCIe Gen4 x16 (32 GB/s per
    # direction), no NVLink.
    "rtx4090": ServingGpu(name="rtx4090", memory_gb=24 * 1.073741824, hbm_tb_s=1.008, bf16_tflops=165.2,
                          link_gb_s=32.0, aliases=("NVIDIA GeForce RTX 4090", "RTX4090")),
    # NVIDIA RTX PRO 6000 Blackwell data sheet / RTX Blackwell architecture whitepaper: 96 GB GDDR7, 1792 GB/s,
    # peak BF16 tensor 503.8 TFLOPS dense with FP32 accumulate; PCIe Gen5 x16 (64 GB/s per direction), no
    # NVLink.
    "rtxpro6000": ServingGpu(name="rtxpro6000", memory_gb=96 * 1.073741824, hbm_tb_s=1.792, bf16_tflops=503.8,
                             link_gb_s=64.0, aliases=("NVIDIA RTX PRO 6000 Blackwell Server Edition",
                                                      "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                                                      "RTX PRO 6000 Blackwell", "RTXPRO6000")),
}

MODELS: dict[str, ServingModel] = {
    # meta-llama/Llama-3.1-8B config.json: hidden_size 4096, intermediate_size 14336, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 8, head_dim 128, vocab_size 128256, tie_word_embeddings false
    # (8.03B parameters).
    "llama-3.1-8b": ServingModel(name="llama-3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                                 intermediate=14336, vocab=128256, aliases=("meta-llama/Llama-3.1-8B",
                                                                            "meta-llama/Llama-3.1-8B-Instruct")),
    # Qwen/Qwen3-32B config.json: hidden_size 5120, intermediate_size 25600, num_hidden_layers 64,
    # num_attention_heads 64, num_key_value_heads 8, head_dim 128, vocab_size 151936, tie_word_embeddings false
    # (32.8B parameters).
    "qwen3-32b": ServingModel(name="qwen3-32b", layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128,
                              intermediate=25600, vocab=151936, aliases=("Qwen/Qwen3-32B",)),
    # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
    # num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768,
    # every layer MoE (decoder_sparse_step 1, mlp_only_layers []), vocab_size 151936, tie_word_embeddings false
    # (30.5B total, 3.3B active parameters).
    "qwen3-30b-a3b": ServingModel(name="qwen3-30b-a3b", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                                  intermediate=0, vocab=151936, experts=128, top_k=8, moe_intermediate=768,
                                  aliases=("Qwen/Qwen3-30B-A3B",)),
}

ADD_PRESET = "add one to GPUS/MODELS in sim/engine_model.py, each number cited"


class UnknownPreset(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def _key(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def _lookup(table: dict, name: str, what: str):
    k = _key(name)
    for key, spec in table.items():
        if k == _key(key) or any(k == _key(a) for a in spec.aliases):
            return spec
    raise UnknownPreset(f"unknown {what} {name!r}; known: {', '.join(sorted(table))} ({ADD_PRESET})")


def gpu_preset(name: str) -> ServingGpu:
    return _lookup(GPUS, name, "GPU")


def model_preset(name: str) -> ServingModel:
    return _lookup(MODELS, name, "model")


def attn_term(m: np.ndarray, p: np.ndarray) -> float:
    """sum(m * p + m^2 / 2): the attention FLOPs' context factor of a step's chunks."""
    return float(np.sum(m * p + 0.5 * m * m))
