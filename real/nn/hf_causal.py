"""A transformers causal LM behind the interface gyre's trainer and torch engine use (the one TinyLlama has).

What it models: `CausalLM(hf_model)` holds the transformers model's decoder (`model`) and head (`lm_head`)
as its own submodules, so its state dict has exactly the Hugging Face names a checkpoint, vLLM and the
trainer share. It offers
- `hidden_states(input_ids, position_ids, mask)` and `head_logits(h)`: the training path split so that the
  loss computes log-probs for the trained rows only, in chunks (gyre.trajectory.torch_ops); `mask` is a
  bool [B, T, T] tensor (True: may attend), passed to transformers as a 4D mask (SDPA honours it as is),
  or a FlexAttention BlockMask (with attn_implementation "flex_attention"); position ids are explicit
  (a packed tree's are depths);
- `forward(...)`: full logits (tests, references);
- `prefill` / `extend` / `decode_step` on a gyre.real.nn.kv_cache.KVCache: the torch engine's continuous batching.
  The cache's tensors become a transformers DynamicCache for one call and are read back after it, so
  right-padded slots stay invalid exactly as in TinyLlama.
- `serving_state()` / `load_serving_state(state)`: the parameters without the tied head's alias (one
  tensor per storage), what weight syncs carry.

Simplifications: plain full-attention decoders (every family whose layers take a 4D mask and a
DynamicCache: Llama, Qwen2, Qwen3, Mistral, ...); sliding-window and hybrid/recurrent layers are not
handled; the cache grows by concatenation, as TinyLlama's.
"""

from __future__ import annotations

import torch
from torch import nn

from gyre.real.nn.kv_cache import KVCache, extend_mask


class CausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.model = hf_model.model  # the decoder: embed_tokens, layers, norm (Hugging Face names)
        self.lm_head = hf_model.get_output_embeddings()
        self.config = hf_model.config
        self.tied = self.lm_head.weight is self.model.embed_tokens.weight
        self.dtype = self.model.embed_tokens.weight.dtype

    # ---- training path ----
    @staticmethod
    def _mask4d(mask, b: int, t: int, s: int):
        if mask is None:
            return torch.ones(t, s, dtype=torch.bool).tril(s - t)[None, None].expand(b, 1, t, s)
        if isinstance(mask, torch.Tensor):
            if mask.shape != (b, t, s):
                raise ValueError(f"attn_mask shape {tuple(mask.shape)} is not [B, T, S] = {(b, t, s)}")
            return mask[:, None]
        return mask  # a BlockMask

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """Final-norm hidden states [B, T, D]; attn_mask bool [B, T, T], a BlockMask, or None (causal)."""
        b, t = input_ids.shape
        mask = self._mask4d(attn_mask, b, t, t)
        if isinstance(mask, torch.Tensor):
            mask = mask.to(input_ids.device)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
        return out.last_hidden_state

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask=None) -> torch.Tensor:
        return self.head_logits(self.hidden_states(input_ids, position_ids, attn_mask))

    # ---- incremental path (the torch engine) ----
    def empty_cache(self, batch_size: int, device: torch.device | str = "cpu") -> KVCache:
        c = self.config
        heads = c.num_key_value_heads or c.num_attention_heads
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        shape = (batch_size, heads, 0, hd)
        n = c.num_hidden_layers
        return KVCache(keys=[torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(n)],
                       values=[torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(n)],
                       valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=device))

    @torch.no_grad()
    def extend(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Append right-padded tokens [B, T] to `cache` in place; logits [B, T, V] (as TinyLlama.extend)."""
        from transformers import DynamicCache

        b, t = input_ids.shape
        mask, new_valid = extend_mask(cache.valid, t, lengths)
        past = DynamicCache(ddp_cache_data=list(zip(cache.keys, cache.values))) if cache.num_slots else DynamicCache()
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask[:, None], cache=past,
                         use_cache=True)
        layers = past.layers  # updated in place
        cache.keys = [layer.keys for layer in layers]
        cache.values = [layer.values for layer in layers]
        cache.valid = torch.cat([cache.valid, new_valid], dim=1)
        return self.head_logits(out.last_hidden_state)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor, lengths: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, KVCache]:
        cache = self.empty_cache(input_ids.shape[0], input_ids.device)
        return self.extend(input_ids, position_ids, cache, lengths), cache

    @torch.no_grad()
    def decode_step(self, next_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                    active: torch.Tensor | None = None) -> torch.Tensor:
        lengths = None if active is None else active.to(torch.long)
        return self.extend(next_ids[:, None], position_ids[:, None], cache, lengths)[:, 0]

    # ---- weights ----
    def serving_state(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers by Hugging Face name, the tied head's alias left out."""
        state = self.state_dict()
        if self.tied:
            state.pop("lm_head.weight", None)
        return state

    def load_serving_state(self, state) -> None:
        """Load a `serving_state` (strict: every tensor but a tied head's alias must be there)."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (self.tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"load_serving_state: missing {missing[:3]}, unexpected {list(unexpected)[:3]}")


def build_model(model, *, seed: int = 0, dtype: str = "float32", device: str = "cpu", attn: str = "sdpa",
                grad_checkpointing: bool = False):
    """The network a trainer or torch engine runs: `model` is a model folder (str or Path: its weights, through
    transformers, as a CausalLM) or a gyre.real.nn.model.TinyLlamaConfig (random init from `seed`).
    `grad_checkpointing`: each decoder layer is recomputed in the backward (in training mode)."""
    import numpy as np

    from gyre.real.nn.hf_folder import check_dtype, load_model
    from gyre.real.nn.model import TinyLlama, TinyLlamaConfig

    if isinstance(model, TinyLlamaConfig):
        check_dtype(dtype, device)
        net = TinyLlama(model, np.random.default_rng(seed), getattr(torch, dtype)).to(device)
        net.checkpointing = grad_checkpointing
        return net
    _, hf = load_model(model, dtype=dtype, device=device, attn=attn)
    if grad_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return CausalLM(hf)


def model_identity(model) -> dict:
    """What a checkpoint records of its model: a TinyLlamaConfig's fields, or a model folder's ModelSpec identity."""
    from dataclasses import asdict

    from gyre.real.nn.hf_folder import check_model_folder
    from gyre.real.nn.model import TinyLlamaConfig

    return asdict(model) if isinstance(model, TinyLlamaConfig) else check_model_folder(model).identity()
