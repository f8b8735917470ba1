"""A GPU and a model as their data sheets and config.json describe them: GpuConfig, ModelConfig.

The fields are what a data sheet or a Hugging Face config.json states (cited beside each preset in
gyre.presets); the properties derive from them only what the shape alone fixes: which layers are full
attention and which Gated DeltaNet (config.json's `layer_types`, or Qwen3-Next's every-k-th-layer rule),
KV bytes per token (full layers only), the linear-attention state a sequence holds, the linear layers'
FLOPs per token, routed parameters, weight bytes and width. What those cost on an engine is gyre.hardware's.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.roofline import GDN_CHUNK, kv_bytes_per_token, linear_attention_flops

FULL, LINEAR = "full_attention", "linear_attention"
LAYER_TYPES = (FULL, LINEAR)


def _by_interval(layers: int, k: int) -> tuple[str, ...]:
    """Qwen3-Next's rule (transformers Qwen3NextConfig): layer i is full attention when (i + 1) % k == 0."""
    return tuple(FULL if (i + 1) % k == 0 else LINEAR for i in range(layers))


@dataclass(frozen=True, kw_only=True)
class GpuConfig:
    name: str
    memory_gb: float
    hbm_tb_s: float
    bf16_tflops: float
    fp8_tflops: float
    gpus_per_node: int = 8
    link_gb_s: float = 0.0  # GPU-to-GPU per direction in a node (NVLink or PCIe); 0: tensor parallel moves no bytes
    internode_gb_s: float = 50.0  # per GPU, 400 Gb/s InfiniBand
    host_gb_s: float = 55.0  # PCIe Gen5 x16, practical
    # the dense BF16 rate a large GEMM (8192^3, cuBLAS via torch.matmul, FP32 accumulate) reaches, from a cited
    # public measurement; 0: none cited, the data sheet's. The engine roofline's compute peak when set.
    bf16_tflops_gemm: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    total_params_b: float
    active_params_b: float
    layers: int
    kv_heads: int
    head_dim: int
    q_heads: int = 0  # attention (query) heads; 0: as many as KV heads
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0  # routed experts per token
    kv_lora_rank: int = 0  # MLA: latent KV width (0: plain K/V heads)
    rope_dim: int = 0  # MLA: decoupled rotary key width
    hidden: int = 0  # model width (hidden_size); 0: query heads x head dim
    vocab: int = 0  # vocabulary (embedding rows); 0: embedding and LM head not told apart from the rest
    tied_embeddings: bool = False  # the LM head reuses the input embedding table
    infer_bytes_per_param: float = 2.0  # bf16; 1.0 for fp8 serving
    kv_bytes_per_elem: float = 2.0
    train_bytes_per_param: float = 16.0  # bf16 weights+grads, fp32 master + Adam moments
    # hybrid linear attention (config.json names): which layers are full attention, the rest Gated DeltaNet
    layer_types: tuple[str, ...] = ()  # "full_attention" / "linear_attention" per layer; (): by the interval
    full_attention_interval: int | None = None  # every k-th layer full attention (layer i: (i + 1) % k == 0); None: all
    linear_key_heads: int = 0  # linear_num_key_heads
    linear_value_heads: int = 0  # linear_num_value_heads: one d_k x d_v recurrent state per value head
    linear_key_head_dim: int = 0  # linear_key_head_dim
    linear_value_head_dim: int = 0  # linear_value_head_dim
    linear_conv_kernel: int = 0  # linear_conv_kernel_dim: the short convolution keeps kernel - 1 inputs
    # recurrent and conv state: the model's dtype (bf16) whatever the KV dtype (vLLM's mamba_cache_dtype and
    # mamba_ssm_cache_dtype default "auto", the model dtype, apart from kv_cache_dtype: MambaStateDtypeCalculator)
    state_bytes_per_elem: float = 2.0

    def __post_init__(self) -> None:
        k = self.full_attention_interval
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"full_attention_interval must be an integer >= 1, got {k!r}")
        types = self.layer_types
        if types:
            if len(types) != self.layers:
                raise ValueError(f"layer_types lists {len(types)} layers, but layers is {self.layers}")
            bad = next((i for i, x in enumerate(types) if x not in LAYER_TYPES), None)
            if bad is not None:
                raise ValueError(f"layer_types[{bad}] is {types[bad]!r}; known: {', '.join(LAYER_TYPES)}")
            if k is not None and types != _by_interval(self.layers, k):
                raise ValueError(f"layer_types disagrees with full_attention_interval={k}")
        if self.linear_layers:
            for f in ("linear_key_heads", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                      "linear_conv_kernel"):
                v = getattr(self, f)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{f} must be an integer >= 1 when layers are linear_attention, got {v!r}")

    @property
    def layout(self) -> tuple[str, ...]:
        """Each layer's kind: config.json's layer_types, or every layer full attention."""
        if self.layer_types:
            return self.layer_types
        if self.full_attention_interval is not None:
            return _by_interval(self.layers, self.full_attention_interval)
        return (FULL,) * self.layers

    @property
    def full_layers(self) -> int:
        """Full-attention layers: the only ones with a KV cache and attention FLOPs that grow with context."""
        return self.layout.count(FULL)

    @property
    def linear_layers(self) -> int:
        return self.layers - self.full_layers

    @property
    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(layers=self.full_layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                  bytes_per_elem=self.kv_bytes_per_elem, kv_lora_rank=self.kv_lora_rank,
                                  rope_dim=self.rope_dim)

    @property
    def state_bytes_per_seq(self) -> float:
        """Linear-attention state one sequence holds, whatever its context: per linear layer H_v d_k d_v
        recurrent elements plus (kernel - 1) x (2 H_k d_k + H_v d_v) conv inputs (q, k and v are convolved)."""
        if not self.linear_layers:
            return 0.0
        conv = (self.linear_conv_kernel - 1) * (2 * self.linear_key_heads * self.linear_key_head_dim
                                                + self.linear_value_heads * self.linear_value_head_dim)
        rec = self.linear_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return float(self.linear_layers * (rec + conv) * self.state_bytes_per_elem)

    @property
    def linear_flops_per_token(self) -> tuple[float, float]:
        """(decode, prefill/forward) FLOPs per token of the linear layers beyond their projections (which
        2 x active params counts): gyre.roofline.linear_attention_flops over the linear layers."""
        if not self.linear_layers:
            return 0.0, 0.0
        kw = dict(value_heads=self.linear_value_heads, key_dim=self.linear_key_head_dim,
                  value_dim=self.linear_value_head_dim, conv_channels=2 * self.linear_key_heads
                  * self.linear_key_head_dim + self.linear_value_heads * self.linear_value_head_dim,
                  conv_kernel=self.linear_conv_kernel)
        return (self.linear_layers * linear_attention_flops(chunk=1, **kw),
                self.linear_layers * linear_attention_flops(chunk=GDN_CHUNK, **kw))

    @property
    def routed_params_b(self) -> float:
        """Parameters in routed experts, from the total and active counts: active = total - R (1 - k/E)."""
        if not self.experts:
            return 0.0
        return (self.total_params_b - self.active_params_b) / (1.0 - self.top_k / self.experts)

    @property
    def infer_weight_bytes(self) -> float:
        return self.total_params_b * 1e9 * self.infer_bytes_per_param

    @property
    def width(self) -> int:
        return self.hidden or (self.q_heads or self.kv_heads) * self.head_dim

    @property
    def head_params(self) -> float:
        """Parameters of the LM head (vocab x width)."""
        return float(self.vocab * self.width)
