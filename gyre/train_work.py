"""The simulator's training work when role-bounded path sampling chooses what trains (gyre.trajectory.sample).

What it models: a GRPO group's executions as trees of segments (gyre.workload.execution_tree); per execution
the sampler draws at most j_max root-to-leaf paths by role, weighting each leaf by the generated tokens of its
path's unmasked segments. What trains is the union of the drawn paths: the group's prompt once, then each kept
segment's generated and tool-output tokens, and attention context summed as gyre.hardware.train_attention_ctx
sums it (each kept segment's term at its KV footprint). Drawing every path (j_max uncapped) keeps every
segment, so the work equals exact training's.

Simplifications: a kept segment trains whole (its tokens are never partly masked: masking is per segment);
a compacted context's root (the summary) is context the exact model does not count either.
"""

from __future__ import annotations

import numpy as np

from gyre.trajectory.sample import SamplingConfig, draw_paths
from gyre.trajectory.tree import ROLES
from gyre.workload import ExecutionSpec, WorkloadConfig, execution_tree

SAMPLING_STREAM = 46_000_001  # seed-sequence key of the path draws (apart from the workload's streams)


def segment_attention(spec: ExecutionSpec) -> np.ndarray:
    """Each segment's term of train_attention_ctx (generated tokens after the turn's context, tool output after)."""
    g = np.asarray(spec.gen, float)
    k = np.asarray(spec.kv, float)
    o = np.zeros(len(g))
    o[: len(spec.tool_out)] = spec.tool_out
    return g * k + 0.5 * g * g + o * (k + g) + 0.5 * o * o


def selected_work(executions: list[ExecutionSpec], w: WorkloadConfig, sampling: SamplingConfig,
                  rng: np.random.Generator) -> tuple[int, float, int]:
    """(tokens, attention context sum, paths drawn) one group trains under `sampling`; executions in order."""
    each, drawn = selected_work_each(executions, w, sampling, rng)
    return sum(t for t, _ in each), sum(a for _, a in each), drawn


def selected_work_each(executions: list[ExecutionSpec], w: WorkloadConfig, sampling: SamplingConfig,
                       rng: np.random.Generator) -> tuple[list[tuple[int, float]], int]:
    """Per execution, in order, the (tokens, attention context sum) of its kept segments under `sampling`, the
    group's prompt (p tokens, p^2 / 2 context) on the first (a streaming step's micro-steps: they add up to
    `selected_work`'s, summed in this order); and the paths drawn. One draw per group, from `rng`."""
    parents, weights, leaf_seg, leaf_exec, leaf_role, sizes = [], [], [], [], [], []
    off = 0
    for e, spec in enumerate(executions):
        par, leaves = execution_tree(spec, w)
        parents.append([p + off if p >= 0 else -1 for p in par])
        weights.append(spec.gen)
        leaf_seg += [s + off for s, _ in leaves]
        leaf_exec += [e] * len(leaves)
        leaf_role += [ROLES.index(r) for _, r in leaves]
        sizes.append(len(par))
        off += len(par)
    seg_parent = np.asarray([p for ps in parents for p in ps], np.int64)
    drawn = draw_paths(seg_parent, np.asarray([x for ws in weights for x in ws], np.int64),
                       np.asarray(leaf_seg, np.int64), np.asarray(leaf_exec, np.int64),
                       np.asarray(leaf_role, np.int64), sampling, rng)
    keep = np.zeros(off, bool)
    par = seg_parent.tolist()
    for s in np.asarray(leaf_seg, np.int64)[drawn].tolist():
        while s >= 0 and not keep[s]:
            keep[s] = True
            s = par[s]
    p = executions[0].prompt
    each, start = [], 0
    for spec, n in zip(executions, sizes):
        kept = keep[start:start + n]
        out = np.zeros(n, np.int64)
        out[: len(spec.tool_out)] = spec.tool_out
        tokens = int((np.asarray(spec.gen, np.int64) + out)[kept].sum())
        attn = float(segment_attention(spec)[kept].sum())
        each.append((tokens + p, 0.5 * p * p + attn) if not each else (tokens, attn))
        start += n
    return each, int(drawn.shape[0])
