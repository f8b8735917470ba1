"""A tiny Llama-style decoder: the real stand-in model for tests, CPU benchmarks and the small engine.

What it models: a pre-norm decoder-only transformer as in Llama (RMSNorm, rotary position embeddings,
grouped-query attention, SwiGLU MLP, tied or untied output head), built from a kw_only dataclass config
with weights drawn from a passed `numpy.random.Generator` (same seed -> same weights, any dtype).

Two entry points share every weight and every kernel:

- `forward(input_ids, position_ids, attn_mask=None)`: the training path. Position ids are explicit (a packed
  trajectory tree uses position id = depth), and `attn_mask` is a bool [B, T, T] tensor where True means
  "query may attend key" (default: causal). A FlexAttention `BlockMask` is accepted in its place.
- `prefill` / `extend` / `decode_step` with a `KVCache` (gyre.real.nn.kv_cache): the incremental path for
  a batch of sequences of different lengths. New tokens are right-padded to a common width; padded slots are stored in the cache
  but marked invalid, so they are never attended. Since RoPE is driven by the explicit position ids, a
  cache slot index need not equal a position.

Simplifications: no dropout, no bias terms, RoPE without scaling, attention computed in the model dtype
(use float64 for exact comparisons), the cache grows by concatenation (fine for a tiny model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from gyre.real.nn.kv_cache import KVCache, extend_mask


@dataclass(kw_only=True, frozen=True)
class TinyLlamaConfig:
    """Shape of the tiny decoder; `n_heads` must be a multiple of `n_kv_heads` (GQA)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"TinyLlamaConfig.dim={self.dim} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"TinyLlamaConfig.n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"TinyLlamaConfig head_dim={self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """x / rms(x) * weight."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [B, 1, T, head_dim] for explicit integer positions (rotate-half convention)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device)
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    angles = position_ids.to(torch.float64)[..., None] * inv_freq  # [B, T, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


_FLEX_COMPILED = None


def _flex(q: torch.Tensor):
    """FlexAttention; compiled on CUDA (eager flex materializes scores and is ~10x slower there)."""
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if not q.is_cuda:
        return flex_attention
    if _FLEX_COMPILED is None:
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """q [B,H,T,D], k/v [B,H,S,D]; mask bool [B,T,S] (True = may attend) or a FlexAttention BlockMask."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    return _flex(q)(q, k, v, block_mask=mask)


class Attention(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False, dtype=dtype)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False, dtype=dtype)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False, dtype=dtype)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False, dtype=dtype)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        k = self.wk(x).view(b, t, self.cfg.n_kv_heads, hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.cfg.n_kv_heads, hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, mask, past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Returns (output, (k, v)) where k/v cover past + new slots, before head repetition."""
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = apply_rope(self.wq(x).view(b, t, self.cfg.n_heads, hd).transpose(1, 2), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        rep = self.cfg.n_heads // self.cfg.n_kv_heads
        out = _attend(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), mask)
        return self.wo(out.transpose(1, 2).reshape(b, t, self.cfg.n_heads * hd)), (k, v)


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: TinyLlamaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, dtype=dtype)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, dtype=dtype)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        self.attn = Attention(cfg, dtype)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(self, x, cos, sin, mask, past=None):
        h, kv = self.attn(self.attn_norm(x), cos, sin, mask, past)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), kv


class TinyLlama(nn.Module):
    """The decoder. Weights come from `rng` (normal(0, init_std), output projections scaled by depth)."""

    def __init__(self, config: TinyLlamaConfig, rng: np.random.Generator, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed = nn.Embedding(config.vocab_size, config.dim, dtype=dtype)
        self.layers = nn.ModuleList(Block(config, dtype) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, dtype)
        self.head = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False, dtype=dtype)
        self.checkpointing = False  # activation checkpointing of each block (gyre.real.nn.hf_causal.build_model)
        self._init_weights(rng)

    def _init_weights(self, rng: np.random.Generator) -> None:
        out_std = self.config.init_std / math.sqrt(2 * self.config.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    continue  # ones
                std = out_std if name.endswith(("wo.weight", "w2.weight")) else self.config.init_std
                p.copy_(torch.from_numpy(rng.normal(0.0, std, size=tuple(p.shape))).to(self.dtype))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head_logits(self.norm(h))

    def _cos_sin(self, position_ids: torch.Tensor):
        return rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, self.dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """Logits [B, T, V]. attn_mask: bool [B, T, T] (True = may attend), a BlockMask, or None (causal)."""
        if input_ids.shape != position_ids.shape or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} must both be [B, T]"
            )
        b, t = input_ids.shape
        if attn_mask is None:
            attn_mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril().expand(b, t, t)
        elif isinstance(attn_mask, torch.Tensor) and attn_mask.shape != (b, t, t):
            raise ValueError(f"attn_mask shape {tuple(attn_mask.shape)} is not [B, T, T] = {(b, t, t)}")
        return self.head_logits(self.hidden_states(input_ids, position_ids, attn_mask))

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """Final-norm hidden states [B, T, D] (forward without the head: the loss takes only trained rows)."""
        cos, sin = self._cos_sin(position_ids)
        x = self.embed(input_ids)
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:  # activation checkpointing: keep only each layer's input
                x, _ = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, attn_mask, use_reentrant=False)
            else:
                x, _ = layer(x, cos, sin, attn_mask)
        return self.norm(x)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of final-norm hidden states."""
        return h @ self.embed.weight.T if self.head is None else self.head(h)

    def serving_state(self) -> dict[str, torch.Tensor]:
        """The state dict weight syncs carry (TinyLlama has no aliased tensors)."""
        return self.state_dict()

    def load_serving_state(self, state) -> None:
        self.load_state_dict(state)

    # ---- incremental path -------------------------------------------------------------------------

    def empty_cache(self, batch_size: int, device: torch.device | str = "cpu") -> KVCache:
        """A cache with no slots for `batch_size` sequences."""
        shape = (batch_size, self.config.n_kv_heads, 0, self.config.head_dim)
        z = lambda: torch.zeros(shape, dtype=self.dtype, device=device)  # noqa: E731
        return KVCache(
            keys=[z() for _ in self.layers],
            values=[z() for _ in self.layers],
            valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=device),
        )

    @torch.no_grad()
    def extend(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append right-padded tokens [B, T] (row b has `lengths[b]` real ones) to `cache` in place.

        Returns logits [B, T, V]; rows past `lengths[b]` are garbage. New token t of row b attends the
        cache's valid slots and new tokens 0..t of its row.
        """
        b, t = input_ids.shape
        if position_ids.shape != (b, t):
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {(b, t)}")
        if cache.batch_size != b:
            raise ValueError(f"cache holds {cache.batch_size} sequences but input_ids has {b} rows")
        mask, new_valid = extend_mask(cache.valid, t, lengths)
        cos, sin = self._cos_sin(position_ids)
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x, (k, v) = layer(x, cos, sin, mask, (cache.keys[i], cache.values[i]))
            cache.keys[i], cache.values[i] = k, v
        cache.valid = torch.cat([cache.valid, new_valid], dim=1)
        return self._logits(x)

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, KVCache]:
        """Logits [B, T, V] for right-padded prompts and a fresh cache holding them."""
        cache = self.empty_cache(input_ids.shape[0], input_ids.device)
        return self.extend(input_ids, position_ids, cache, lengths), cache

    @torch.no_grad()
    def decode_step(
        self,
        next_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per sequence ([B] ids and positions); appends to `cache` in place; logits [B, V].

        Rows with `active[b] == False` are computed but their slot is stored as invalid (a paused sequence).
        """
        lengths = None if active is None else active.to(torch.long)
        return self.extend(next_ids[:, None], position_ids[:, None], cache, lengths)[:, 0]
