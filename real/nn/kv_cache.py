"""The incremental path's KV cache: per-layer keys and values of a batch of sequences of different lengths.

What it models: a batch's cache as right-padded tensors with a `valid` mask (a padded slot is stored but never
attended), and the attention mask that appends new right-padded tokens to it (`extend_mask`). Both the tiny
model (gyre.real.nn.model) and a Hugging Face causal LM (gyre.real.nn.hf_causal) decode on it, and the torch
engine (gyre.real.engine_torch) batches sequences by selecting and concatenating caches.

Simplifications: the cache grows by concatenation (no paging, no preallocation); fine for the small models
it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class KVCache:
    """Per-layer keys/values [B, n_kv_heads, S, head_dim] and `valid` [B, S]: which slots may be attended."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.valid.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.valid.shape[1])

    def lengths(self) -> torch.Tensor:
        """Number of valid (attendable) slots per sequence."""
        return self.valid.sum(dim=1)

    def select(self, rows: torch.Tensor | list[int]) -> KVCache:
        """A cache holding only the given sequences (batch rows), in that order."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        return KVCache(
            keys=[k[idx] for k in self.keys], values=[v[idx] for v in self.values], valid=self.valid[idx]
        )

    @staticmethod
    def concat(caches: list[KVCache]) -> KVCache:
        """Stack several caches along the batch, right-padding slots (as invalid) to the longest."""
        if not caches:
            raise ValueError("KVCache.concat needs at least one cache")
        width = max(c.num_slots for c in caches)

        def pad(t: torch.Tensor, dim: int, value: float | bool) -> torch.Tensor:
            extra = width - t.shape[dim]
            if extra == 0:
                return t
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=dim)

        n_layers = len(caches[0].keys)
        return KVCache(
            keys=[torch.cat([pad(c.keys[i], 2, 0.0) for c in caches]) for i in range(n_layers)],
            values=[torch.cat([pad(c.values[i], 2, 0.0) for c in caches]) for i in range(n_layers)],
            valid=torch.cat([pad(c.valid, 1, False) for c in caches]),
        )


def extend_mask(valid: torch.Tensor, t: int, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [B, T, S + T], new_valid [B, T]) for appending T right-padded tokens to a cache whose slots are
    `valid` [B, S]: token t of row b attends the valid slots and its row's real tokens 0..t (row b has
    `lengths[b]` real ones; default all). A padded query attends itself so that no row is fully masked."""
    b, dev = valid.shape[0], valid.device
    if lengths is None:
        lengths = torch.full((b,), t, dtype=torch.long, device=dev)
    cols = torch.arange(t, device=dev)
    new_valid = cols[None, :] < lengths[:, None]
    causal = cols[None, :, None] >= cols[None, None, :]
    diag = torch.eye(t, dtype=torch.bool, device=dev)[None]
    new_mask = causal & (new_valid[:, None, :] | diag)
    return torch.cat([valid[:, None, :].expand(b, t, valid.shape[1]), new_mask], dim=2), new_valid
