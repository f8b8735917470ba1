"""Torch side of the trajectory processor: attention masks for packs, micro-batches and the clipped policy loss.

What it models: a `Pack` (numpy) becomes model inputs: a boolean ancestor-or-self mask
(mask[q, k] = k <= q < leave[k]) that SDPA takes as is, or, where `torch.nn.attention.flex_attention`
exists, a FlexAttention `BlockMask` of the same predicate built from the tree's `leave` ranges block by
block (`tree_blocks`: each block pair empty, full or partial from per-block min/max of `leave`; memory
O(T + (T / block)^2); the predicate itself runs only inside partial blocks, in the attention kernel).
Several packs run as one forward (`concat_packs`: their trees side by side, position ids restart, no pair
across packs allowed), grouped up to a token budget by `micro_batches`. `packed_loss` runs one
micro-batch: the model's final hidden states, then log-probs of the trained rows only, `logprob_chunk` rows
at a time, each chunk's full-vocabulary logits recomputed in the backward rather than kept
(`row_logprobs`), and sums the clipped PPO/GRPO terms times the rows' weights. `naive_loss` is the
reference: every branch as its own causal sequence, full logits, the same clipped terms, denominators
counted independently from the branches.

Per row, with r = exp(logp_new - logp_old) and c = weight * advantage:
  term = -c * min(r, clip(r, 1-eps_low, 1+eps_high))   if c > 0
  term = -c * max(r, clip(r, 1-eps_low, 1+eps_high))   if c < 0
which is -weight * min(r*A, clip(r)*A) and stays exact for rows merged by advantage sign.

Simplifications: no KL or entropy terms; batch 1 per forward (packs of a micro-batch are concatenated);
the boolean mask (the SDPA path) costs T^2 bytes (4096 tokens: 16 MiB; 64K: 4 GiB), the block mask does
not; on CPU, torch's FlexAttention runs forward only (no backward), so `use_flex` is for GPUs or inference.
Log-softmax runs in at least fp32 whatever the model's compute dtype. This is the only module of
gyre.trajectory that imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gyre.trajectory.loss_rows import LossRows
from gyre.trajectory.pack import NORMALIZATIONS, Pack


@dataclass(kw_only=True, frozen=True)
class LossConfig:
    """Clip range of the policy ratio."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    # trained rows per log-softmax chunk: full-vocabulary logits exist for at most this many rows at a time
    logprob_chunk: int = 1024


@dataclass(kw_only=True, frozen=True)
class Branch:
    """One naive sample: a root-to-leaf token path, which positions are trained, and its execution."""

    tokens: np.ndarray  # int64 [L]
    trained: np.ndarray  # bool [L]: token i is a loss target (predicted from position i - 1)
    old_logprob: np.ndarray  # float64 [L]
    execution: int
    advantage: float


def dense_mask(pack: Pack, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [T, T], True where query q may attend key k (k is an ancestor-or-self of q)."""
    leave = torch.as_tensor(pack.leave, device=device)
    idx = torch.arange(pack.size, device=device)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] < leave[None, :])


def tree_blocks(leave: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full): bool [nb, nb], nb = ceil(S / block_size), for the ancestor-or-self predicate
    k <= q < leave[k] of a pack in DFS preorder, each (q-block, k-block) pair classed from per-block extremes of
    `leave` alone (memory O(S + nb^2), never [S, S]).

    A pair is non-empty iff kb <= qb and max(leave over the k-block) > the q-block's first index (some k of the
    block is <= every q of a later or the same block, and its subtree reaches into the q-block). It is full iff
    every key precedes every query (the k-block ends at or before the q-block starts) and min(leave over the
    k-block) > the q-block's last index. A block cut by S is never full, as create_block_mask counts it
    (leave <= S, and keys past S get leave 0). Partial = non-empty and not full. Exact: the same classes as
    reducing the dense [S, S] mask block by block."""
    s = int(leave.shape[0])
    nb = max(1, -(-s // block_size))
    lv = torch.zeros(nb * block_size, dtype=leave.dtype, device=leave.device)
    lv[:s] = leave  # keys past S: leave 0, never attended
    lv = lv.view(nb, block_size)
    first = torch.arange(nb, device=leave.device) * block_size  # first index of each block
    last = first + (block_size - 1)  # its last index (>= S for a block cut by S)
    qb, kb = first[:, None], first[None, :]
    nonempty = (kb <= qb) & (lv.amax(1)[None, :] > qb)
    full = (kb + (block_size - 1) <= qb) & (lv.amin(1)[None, :] > last[:, None])
    return nonempty & ~full, full


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [nb, nb] bool block grid as BlockMask's (num_blocks [1, 1, nb], indices [1, 1, nb, nb]): each row's
    set columns first, in increasing order, then the rest."""
    b = blocks.to(torch.int32)
    idx = torch.argsort(b, dim=-1, descending=True, stable=True).to(torch.int32)
    return b.sum(-1, dtype=torch.int32)[None, None], idx[None, None]


def block_mask(pack: Pack, device: torch.device | str = "cpu", block_size: int = 128):
    """FlexAttention BlockMask of the ancestor-or-self predicate, or None where flex attention is unavailable.

    Built from the tree (`tree_blocks`), not from the predicate over all pairs: full blocks skip the mask_mod,
    which runs only in partial ones; memory O(S + (S / block_size)^2)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return None
    s = pack.size
    leave = torch.as_tensor(pack.leave, dtype=torch.int64, device=device)
    partial, full = tree_blocks(leave, block_size)
    # padded to whole blocks (leave 0: never attended), so the mask_mod may be asked about any index of a block
    lv = torch.zeros(partial.shape[0] * block_size, dtype=torch.int64, device=device)
    lv[:s] = leave

    def ancestor_or_self(b, h, q, k):
        return (k <= q) & (q < lv[k])

    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=ancestor_or_self, seq_lengths=(s, s))


def micro_batches(packs: list[Pack], max_tokens: int) -> list[list[Pack]]:
    """Packs with loss rows, in order, grouped greedily into runs of at most `max_tokens` tokens each (a pack
    larger than the budget is a run of its own; 0: one pack per run)."""
    out: list[list[Pack]] = []
    size = 0
    for p in packs:
        if len(p.rows) == 0:
            continue  # context-only pack: contributes nothing
        if not out or max_tokens <= 0 or size + p.size > max_tokens:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.size
    return out


def concat_packs(packs: list[Pack]) -> Pack:
    """One pack holding `packs` side by side: indices shifted, position ids kept, no attention across packs."""
    if len(packs) == 1:
        return packs[0]
    offs = np.cumsum([0] + [p.size for p in packs[:-1]])
    rows = [p.rows for p in packs]
    cat = lambda f: np.concatenate([getattr(r, f) for r in rows])  # noqa: E731
    return Pack(
        input_ids=np.concatenate([p.input_ids for p in packs]),
        position_ids=np.concatenate([p.position_ids for p in packs]),
        leave=np.concatenate([p.leave + o for p, o in zip(packs, offs)]),
        rows=LossRows(pred=np.concatenate([r.pred + o for r, o in zip(rows, offs)]), target=cat("target"),
                      old_logprob=cat("old_logprob"), advantage=cat("advantage"), execution=cat("execution"),
                      branch=cat("branch"), weight=cat("weight")),
    )


def _chunk_logprob(head, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = head(h)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]


def row_logprobs(head, h: torch.Tensor, target: torch.Tensor, chunk: int) -> torch.Tensor:
    """log p(target[i] | h[i]) for rows h [R, D], `chunk` rows at a time; with autograd on, each chunk is
    checkpointed, so its [chunk, V] logits are freed after the forward and recomputed in the backward."""
    from torch.utils.checkpoint import checkpoint

    out = []
    for i in range(0, int(target.shape[0]), max(1, chunk)):
        hc, tc = h[i:i + chunk], target[i:i + chunk]
        if torch.is_grad_enabled() and hc.requires_grad:
            out.append(checkpoint(_chunk_logprob, head, hc, tc, use_reentrant=False))
        else:
            out.append(_chunk_logprob(head, hc, tc))
    return torch.cat(out) if out else h.new_zeros(0)


def clipped_terms(new_logprob: torch.Tensor, old_logprob: torch.Tensor, coef: torch.Tensor,
                  config: LossConfig) -> torch.Tensor:
    """Per-row clipped policy terms for coef = weight * advantage (see the module docstring)."""
    ratio = torch.exp(new_logprob - old_logprob)
    clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    pick = torch.where(coef > 0, torch.minimum(ratio, clipped), torch.maximum(ratio, clipped))
    return -coef * pick


def _zero(model: torch.nn.Module) -> torch.Tensor:
    """A zero loss that still has a graph (so backward on an empty micro-batch is a no-op, not an error)."""
    return sum(p.sum() for p in model.parameters()) * 0.0


def rows_loss(logp: torch.Tensor, rows: LossRows, config: LossConfig, mismatch: torch.Tensor | None = None,
              logps: list | None = None) -> torch.Tensor:
    """Sum over rows of weight * clipped term, from the rows' log-probs under the weights being trained.

    `mismatch` ([2], optional): (sum over rows of |log p - old log p|, rows) is added to it, detached: how
    far the weights being trained are from those that sampled the rows (about 0 for on-policy rows).
    `logps` (optional list): the rows' log p (detached) is appended to it."""
    dev = logp.device
    old = torch.as_tensor(rows.old_logprob, dtype=logp.dtype, device=dev)
    if logps is not None:
        logps.append(logp.detach())
    if mismatch is not None:
        mismatch += torch.stack([(logp.detach() - old).abs().sum().to(mismatch.dtype),
                                 torch.tensor(float(len(old)), dtype=mismatch.dtype, device=mismatch.device)])
    coef = torch.as_tensor(rows.weight * rows.advantage, dtype=logp.dtype, device=dev)
    return clipped_terms(logp, old, coef, config).sum()


def pack_rows_loss(logits: torch.Tensor, rows: LossRows, config: LossConfig,
                   mismatch: torch.Tensor | None = None, logps: list | None = None) -> torch.Tensor:
    """rows_loss from one sequence's full logits [T, V] (the reference path)."""
    dev = logits.device
    pred = torch.as_tensor(rows.pred, device=dev)
    target = torch.as_tensor(rows.target, device=dev)
    logp = torch.log_softmax(logits[pred], dim=-1).gather(1, target[:, None])[:, 0]
    return rows_loss(logp, rows, config, mismatch, logps)


def packed_loss(model: torch.nn.Module, packs: list[Pack], config: LossConfig | None = None,
                *, use_flex: bool = False, device: torch.device | str = "cpu",
                mismatch: torch.Tensor | None = None, logps: list | None = None,
                micro_tokens: int = 0) -> torch.Tensor:
    """Loss of `packs` (weights are batch-global, so losses of disjoint sets of packs add up): one forward per
    micro-batch of up to `micro_tokens` tokens (0: per pack). `mismatch`, `logps`: see rows_loss (packs
    without rows add nothing to either; `logps` gets one tensor per micro-batch)."""
    cfg = config or LossConfig()
    total = _zero(model)
    for mb in micro_batches(packs, micro_tokens):
        total = total + micro_batch_loss(model, concat_packs(mb), cfg, use_flex=use_flex, device=device,
                                         mismatch=mismatch, logps=logps)
    return total


def micro_batch_loss(model: torch.nn.Module, pack: Pack, config: LossConfig, *, use_flex: bool = False,
                     device: torch.device | str = "cpu", mismatch: torch.Tensor | None = None,
                     logps: list | None = None) -> torch.Tensor:
    """One forward over `pack` (concat_packs of a micro-batch): hidden states, then chunked row log-probs."""
    ids = torch.as_tensor(pack.input_ids, device=device)[None]
    pos = torch.as_tensor(pack.position_ids, device=device)[None]
    if use_flex:
        mask = block_mask(pack, device)
        if mask is None:  # no silent fall back to the [T, T] mask: at 64K tokens it is 4 GiB per layer call
            raise RuntimeError("use_flex: torch.nn.attention.flex_attention is not available in this torch")
    else:
        mask = dense_mask(pack, device)[None]
    h = model.hidden_states(ids, pos, mask)[0]
    pred = torch.as_tensor(pack.rows.pred, device=device)
    target = torch.as_tensor(pack.rows.target, device=device)
    logp = row_logprobs(model.head_logits, h[pred], target, config.logprob_chunk)
    return rows_loss(logp, pack.rows, config, mismatch, logps)


def naive_weights(branches: list[Branch], normalization: str) -> list[float]:
    """Per-branch weight of each trained token under the naive normalization."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    counts = [int(b.trained[1:].sum()) for b in branches]
    if normalization == "token":
        total = sum(counts)
        return [1.0 / total if total else 0.0 for _ in branches]
    per_exec: dict[int, int] = {}
    for b, c in zip(branches, counts):
        per_exec[b.execution] = per_exec.get(b.execution, 0) + c
    active = sum(1 for c in per_exec.values() if c > 0)
    return [1.0 / (active * per_exec[b.execution]) if per_exec[b.execution] else 0.0 for b in branches]


def naive_loss(model: torch.nn.Module, branches: list[Branch], normalization: str,
               config: LossConfig | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Reference loss: each branch as its own causal sequence with positions 0..L-1."""
    cfg = config or LossConfig()
    weights = naive_weights(branches, normalization)
    total = _zero(model)
    for b, w in zip(branches, weights):
        tgt_pos = np.flatnonzero(b.trained[1:]) + 1
        if tgt_pos.size == 0:
            continue
        ids = torch.as_tensor(b.tokens, device=device)[None]
        pos = torch.arange(b.tokens.shape[0], device=device)[None]
        logits = model(ids, pos)[0]
        rows = LossRows(
            pred=tgt_pos - 1, target=b.tokens[tgt_pos], old_logprob=b.old_logprob[tgt_pos],
            advantage=np.full(tgt_pos.size, b.advantage), execution=np.full(tgt_pos.size, b.execution),
            branch=np.zeros(tgt_pos.size, np.int64), weight=np.full(tgt_pos.size, w),
        )
        total = total + pack_rows_loss(logits, rows, cfg)
    return total


def branches_of(tree, advantages, execution_offset: int = 0) -> list[Branch]:
    """Naive branches of one TokenTree by walking parent pointers (independent of the packer)."""
    out = []
    adv = np.asarray(advantages, np.float64)
    for leaf, e in zip(tree.branch_leaf, tree.branch_execution):
        idx = []
        q = leaf
        while q >= 0:
            idx.append(q)
            q = int(tree.parent[q])
        idx = np.asarray(idx[::-1], np.int64)
        out.append(Branch(tokens=tree.tokens[idx], trained=tree.trained[idx], old_logprob=tree.logprob[idx],
                          execution=int(e) + execution_offset, advantage=float(adv[e])))
    return out
