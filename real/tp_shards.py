"""Per-tensor-parallel-rank weight slices of a Hugging Face decoder, in vLLM's rank-local parameter layout.

What it models: what one tensor-parallel rank of a vLLM engine holds of a Llama / Qwen2 / Qwen3 state dict
(Hugging Face names), so a weight sync can give each rank only its slice. The split is the one vLLM's loaders
make (vllm/model_executor/layers/linear.py and vocab_parallel_embedding.py, vLLM 0.32):
- column parallel, fused (`QKVParallelLinear`, `MergedColumnParallelLinear`): q, k, v (weights and biases)
  cut on the output dim; rank r holds q heads [r H/tp, (r+1) H/tp) and kv heads of shard rank
  r // replicas, where replicas = tp / KV when tp >= KV (each rank then holds one kv head) else 1; stored
  fused as `qkv_proj` = [q_r; k_r; v_r]; gate and up cut into I/tp rows each, fused as
  `gate_up_proj` = [gate_r; up_r];
- row parallel (`RowParallelLinear`): o_proj and down_proj cut on the input dim (columns);
- vocab parallel (`VocabParallelEmbedding`, `ParallelLMHead`): the vocabulary padded to a multiple of 64
  (`pad_vocab_size`), P = padded / tp rows per rank; rank r holds rows [r P, min((r+1) P, V)), zero rows
  after them up to P; a tied head is not sent (vLLM ties it to the embedding);
- everything else (RMSNorm weights, Qwen3's per-head q_norm / k_norm) whole on every rank.

`rank_state(state, spec, rank)` gives rank `rank`'s tensors under vLLM's parameter names (each a view or a
new tensor of exactly the rank's shape); `TPSpec.of(config_json, tp)` reads the head counts from the
model's config.json. Assumes: no added vocabulary (org = full vocab), no bias on row-parallel layers (their
bias would be added once, on one rank; refused), heads divisible by tp.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)
_ATTN = re.compile(r"(.*\.self_attn\.)([qkv])_proj\.(weight|bias)")
_MLP = re.compile(r"(.*\.mlp\.)(gate|up)_proj\.weight")
_ROW = re.compile(r".*\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class TPSpec:
    tp: int
    heads: int  # attention heads (all ranks)
    kv_heads: int
    head_dim: int
    vocab: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.heads % self.tp:
            raise ValueError(f"tensor parallel size {self.tp}: the {self.heads} attention heads do not divide")
        if (self.tp % self.kv_heads if self.tp >= self.kv_heads else self.kv_heads % self.tp):
            raise ValueError(f"tensor parallel size {self.tp} and {self.kv_heads} kv heads: neither divides the other")

    @classmethod
    def of(cls, config_json: str | Path, tp: int) -> TPSpec:
        cfg = json.loads(Path(config_json).read_text())
        heads = int(cfg["num_attention_heads"])
        return cls(tp=tp, heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads), vocab=int(cfg["vocab_size"]))

    @property
    def kv_replicas(self) -> int:
        return self.tp // self.kv_heads if self.tp >= self.kv_heads else 1

    @property
    def kv_per_rank(self) -> int:
        return 1 if self.tp >= self.kv_heads else self.kv_heads // self.tp

    @property
    def vocab_per_rank(self) -> int:
        padded = -(-self.vocab // VOCAB_PAD) * VOCAB_PAD
        if padded % self.tp:  # vLLM's divide() asserts the same
            raise ValueError(f"the padded vocabulary ({padded}) does not split over {self.tp} ranks")
        return padded // self.tp

    def rows(self, part: str, rank: int) -> tuple[int, int]:
        """(first row, rows) of q, k or v's output dim that `rank` holds."""
        if part == "q":
            n = self.heads // self.tp * self.head_dim
            return rank * n, n
        n = self.kv_per_rank * self.head_dim
        return rank // self.kv_replicas * n, n


def _cut(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[dim] // tp
    if n * tp != t.shape[dim]:
        raise ValueError(f"a dim of {t.shape[dim]} does not split over {tp} ranks")
    return t.narrow(dim, rank * n, n)


def vocab_rows(t: torch.Tensor, spec: TPSpec, rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of a vocab-parallel weight, zero-padded to `spec.vocab_per_rank` rows."""
    if t.shape[0] != spec.vocab:
        raise ValueError(f"a vocab-parallel weight of {t.shape[0]} rows, the config's vocab is {spec.vocab}")
    p = spec.vocab_per_rank
    lo, hi = min(rank * p, spec.vocab), min((rank + 1) * p, spec.vocab)
    out = t.new_zeros((p, *t.shape[1:]))
    out[: hi - lo] = t[lo:hi]
    return out


def rank_state(state: Mapping[str, torch.Tensor], spec: TPSpec, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s parameters under vLLM's names (fused qkv_proj and gate_up_proj), from a Hugging Face state
    dict (a tied head's alias left out, as trainers publish it)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        if m := _ATTN.fullmatch(name):
            first, n = spec.rows(m.group(2), rank)
            fused.setdefault(f"{m.group(1)}qkv_proj.{m.group(3)}", {})[m.group(2)] = t.narrow(0, first, n)
        elif m := _MLP.fullmatch(name):
            fused.setdefault(f"{m.group(1)}gate_up_proj.weight", {})[m.group(2)] = _cut(t, 0, rank, spec.tp)
        elif m := _ROW.fullmatch(name):
            if m.group(2) == "bias":
                raise ValueError(f"{name}: a row-parallel bias is not supported")
            out[name] = _cut(t, 1, rank, spec.tp)
        elif name in _VOCAB:
            out[name] = vocab_rows(t, spec, rank)
        else:
            out[name] = t
    for name, parts in fused.items():
        keys = ("q", "k", "v") if ".qkv_proj." in name else ("gate", "up")
        if set(parts) != set(keys):
            raise ValueError(f"{name}: the state has {sorted(parts)} of {list(keys)}")
        out[name] = torch.cat([parts[k] for k in keys])
    return out
