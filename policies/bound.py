"""The work-conserving lower bound: no policy on this cluster can finish sooner.

bound = max(total GPU-work / N, critical path), where
- rollout work of an execution = its generated tokens at the engine's peak per-GPU decode throughput
  (an engine full of sequences of the workload's mean context) plus its prefill at peak, in GPU-s;
- training work = trained tokens at train MFU, in GPU-s (switch, sync and tool time cost no GPU-work
  here: a perfect policy hides them);
- critical path = the longest single execution run alone at batch size 1 (decode + prefill + tool
  latency), plus the last step's training on every GPU.

With a staleness bound eta (0 for on-policy colocate) there is a third, usually the largest, term.
A group trained in step s was admitted at version >= s - eta, so after step s - eta - 1 ended:
T(s) >= T(s - eta - 1) + D(s) + train(s), where D(s) is the longest solo execution in step s's batch.
Summing along the eta + 1 chains of steps eta + 1 apart, the makespan is at least the average chain:
(sum over steps of D(s) + total training time on all GPUs) / (eta + 1), and sum D(s) is smallest when
the longest groups share steps: sum over k of the (k * groups_per_step)-th longest group duration.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from gyre.hardware import Costs
from gyre.workload import GroupSpec


@dataclass(frozen=True, kw_only=True)
class Bound:
    work_s: float
    critical_path_s: float
    rollout_gpu_s: float
    train_gpu_s: float
    staleness_s: float = 0.0  # the staleness-chain term (0 when no eta is given)
    eta: int | None = None

    @property
    def makespan_s(self) -> float:
        return max(self.work_s, self.critical_path_s, self.staleness_s)


def _solo(groups: list[GroupSpec], costs: Costs):
    """Per-execution sums (generated tokens G, context x tokens KG, tool-output tokens TO, prompt, prefill), the
    first execution index of each group, and each group's solo duration: its longest execution run alone at
    batch size 1 (decode + prefill + tool latency, capped by its deadline)."""
    execs = [e for g in groups for e in g.executions]
    # per-execution sums over segments, vectorized (a 1M-execution trace is one pass over its lists)
    n = len(execs)
    gen, seg_of = _flat([e.gen for e in execs], n)
    kv, _ = _flat([e.kv for e in execs], n)
    tool_s, tool_of = _flat([e.tool_s for e in execs], n)
    tool_out, _ = _flat([e.tool_out for e in execs], n)
    G = np.bincount(seg_of, gen, minlength=n)  # generated tokens
    KG = np.bincount(seg_of, kv * gen, minlength=n)  # sum of context x tokens decoded at it
    TS = np.bincount(tool_of, tool_s, minlength=n)
    TO = np.bincount(tool_of, tool_out, minlength=n)
    prompt = np.fromiter((e.prompt for e in execs), np.float64, n)
    deadline = np.fromiter((e.deadline_s for e in execs), np.float64, n)
    prefill = prompt + TO
    # alone at batch size 1: step_time(1, k) = a + b + c*k per token decoded at context k
    alone = (costs.step_a + costs.step_b) * G + costs.step_c * KG + TS + prefill * costs.prefill_s_per_token
    solo = np.minimum(alone, deadline)
    sizes = np.fromiter((len(g.executions) for g in groups), np.int64, len(groups))
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    group_solo = np.maximum.reduceat(solo, first)
    return G, KG, TO, prompt, prefill, first, group_solo


def group_solo_s(groups: list[GroupSpec], costs: Costs) -> np.ndarray:
    """Each group's solo duration (s): the time its longest execution takes alone at batch size 1."""
    if not groups:
        return np.zeros(0)
    return _solo(groups, costs)[-1]


def lower_bound(groups: list[GroupSpec], costs: Costs, n_gpus: int, groups_per_step: int,
                eta: int | None = None) -> Bound:
    execs = [e for g in groups for e in g.executions]
    if not execs:
        return Bound(work_s=0.0, critical_path_s=0.0, rollout_gpu_s=0.0, train_gpu_s=0.0, eta=eta)
    G, KG, TO, prompt, prefill, first, group_solo = _solo(groups, costs)
    gen_tokens = G.sum()
    mean_ctx = KG.sum() / max(gen_tokens, 1.0)
    rollout = gen_tokens / costs.best_decode_tokens_per_gpu_s(mean_ctx) \
        + prefill.sum() * costs.prefill_s_per_token * costs.engine_gpus
    # trained tokens per group: the shared prompt once, then every execution's own tokens
    trained = prompt[first] + np.add.reduceat(G + TO, first)
    train = float(trained.sum()) * costs.train_s_per_token_gpu
    last = float(trained[-groups_per_step:].sum()) * costs.train_s_per_token_gpu / n_gpus
    stale = 0.0
    if eta is not None:
        per_step = np.sort(group_solo)[::-1][::groups_per_step]
        stale = (float(per_step.sum()) + train / n_gpus) / (eta + 1)
    return Bound(
        work_s=float(rollout + train) / n_gpus,
        critical_path_s=float(group_solo.max()) + last,
        rollout_gpu_s=float(rollout),
        train_gpu_s=train,
        staleness_s=stale,
        eta=eta,
    )


def _flat(lists: list[list], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-execution lists into one float array, with the execution index of each item."""
    lens = np.fromiter(map(len, lists), np.int64, n)
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.float64, int(lens.sum()))
    return flat, np.repeat(np.arange(n), lens)
