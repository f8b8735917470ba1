"""Trajectory processor: record executions on exact token ids, build one prefix tree per task, score
truncated rollouts with partial credit, and pack trees into bounded training samples whose loss equals the
naive per-branch loss. Importing this package pulls in numpy only; the torch side lives in
`gyre.trajectory.torch_ops`.
"""

from gyre.trajectory.credit import AdvantageConfig, Score, group_advantages, score_group
from gyre.trajectory.loss_rows import LossRows, merge_by_sign
from gyre.trajectory.pack import Pack, PackConfig, PackedBatch, PackStats, build_packs
from gyre.trajectory.sample import SamplingConfig, restrict, sample_branches
from gyre.trajectory.record import Execution, Point, ReachedState, SubAgent, TaskRecorder
from gyre.trajectory.tree import ROLES, Preorder, TokenTree

__all__ = [
    "AdvantageConfig", "Execution", "LossRows", "Pack", "PackConfig", "PackStats", "PackedBatch", "Score",
    "Point", "Preorder", "ROLES", "ReachedState", "SamplingConfig", "SubAgent", "TaskRecorder", "TokenTree",
    "build_packs", "group_advantages", "merge_by_sign", "restrict", "sample_branches", "score_group",
]
