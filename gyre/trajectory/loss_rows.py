"""The loss gather list of a pack: one row per (trained token, branch through it), and its merge by sign.

What it models: the explicit rows a packed loss gathers (gyre.trajectory.pack builds them, the torch side,
gyre.trajectory.torch_ops, evaluates them): where the logits that predict each target sit in the pack, the
target, its old log-prob, advantage, execution, branch and normalization weight. `merge_by_sign` folds rows
that share a prediction, target, old log-prob and advantage sign into one: the clipped PPO terms stay apart
by sign, so the merged loss and its gradient equal the unmerged ones. Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(kw_only=True, frozen=True)
class LossRows:
    """Loss gather list of one pack: one entry per (trained token, branch through it) or merged group."""

    pred: np.ndarray  # int64 pack index whose logits predict the target
    target: np.ndarray  # int64 target token id
    old_logprob: np.ndarray  # float64
    advantage: np.ndarray  # float64
    execution: np.ndarray  # int64 batch-global execution index (-1 after merging)
    branch: np.ndarray  # int64 batch-global branch index (-1 after merging)
    weight: np.ndarray  # float64 normalization weight

    def __len__(self) -> int:
        return int(self.pred.shape[0])


def merge_by_sign(rows: LossRows) -> LossRows:
    """Merge rows with the same (pred, target, old log-prob, advantage sign) into one with weight 1.

    The clipped PPO term of a row is -w*A*min(r, clip(r)) if A > 0 and -w*A*max(r, clip(r)) if A < 0, so
    rows sharing a ratio and a sign add up exactly to one row with advantage sum(w*A).
    """
    coef = rows.weight * rows.advantage
    sign = np.sign(coef)
    keep = sign != 0
    pred, tgt, olp, coef, sign = rows.pred[keep], rows.target[keep], rows.old_logprob[keep], coef[keep], sign[keep]
    order = np.lexsort((sign, olp, tgt, pred))
    pred, tgt, olp, coef, sign = pred[order], tgt[order], olp[order], coef[order], sign[order]
    if pred.shape[0] == 0:
        z = np.zeros(0, np.int64)
        return LossRows(pred=z, target=z, old_logprob=np.zeros(0), advantage=np.zeros(0), execution=z,
                        branch=z, weight=np.zeros(0))
    new = np.ones(pred.shape[0], bool)
    new[1:] = (pred[1:] != pred[:-1]) | (tgt[1:] != tgt[:-1]) | (olp[1:] != olp[:-1]) | (sign[1:] != sign[:-1])
    heads = np.flatnonzero(new)
    m = heads.shape[0]
    return LossRows(
        pred=pred[heads], target=tgt[heads], old_logprob=olp[heads], advantage=np.add.reduceat(coef, heads),
        execution=np.full(m, -1, np.int64), branch=np.full(m, -1, np.int64), weight=np.ones(m),
    )
