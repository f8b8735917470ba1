"""The lower bound: no policy on this simulated cluster can finish the given groups sooner.

Every term is a minimum of something the simulator charges (its engine and gyre.hardware):

- rollout GPU-work: the engines' busy time x their GPUs. Each engine step costs at least
  max(weights / bandwidth + KV / KV bandwidth, FLOPs / peak) + all-reduce bytes + overhead
  (gyre.roofline: the linear and attention kernels each cost the max of their bytes and FLOPs terms,
  and a sum of maxima is at least the max of the sums), so the busy time of all steps is at least the
  same of the sums + overhead x steps (EngineRoofline.min_busy_time), where the
  tokens are the decoded ones plus the prefill each turn needs at least (the prompt, each tool output;
  never a preemption's or a migration's recomputation), each decode token reads and attends to at
  least its segment's starting context (and, on a hybrid model, reads and writes its sequence's
  linear-attention state and costs the linear layers' decode FLOPs; each prefill token their chunked
  FLOPs), each prefill token attends to at least its offset, and a step holds at most
  max(budget, KV capacity / (smallest context + a sequence's state)) tokens. Linear costs: a per step plus
  b, c and the per-token prefill price, at the same minima.
- training GPU-work: 6 x active params per trained token plus attention (Costs.train_time); under role-bounded
  sampling (`sampling`, with the run's `workload` and `seed`) the tokens of the paths the simulator draws for the
  group (gyre.train_work, the same draw as SimCluster.train's);
- solo latency of an execution: each token decoded at batch 1 at its segment's starting context,
  each prefill token at its cheapest (Costs.min_prefill_s_per_token), plus its tool time, capped by
  its deadline (a deadline only cuts at a turn boundary, after it has passed), plus
  Costs.request_s per turn (each turn's request waits that long before it reaches its engine). Executions with a
  finite deadline contribute only their prompt's prefill to the GPU-work (they may be cut at once).

bound = max(GPU-work / N, critical path, staleness chain), where
- critical path = max over groups of (solo latency of its longest execution + its own training on all
  N GPUs): a group is trained after its rollouts end;
- staleness chain (with eta): a group trained in step s first decoded at version >= s - 1 - eta, so
  after step s - eta - 1 ended: T(s) >= T(s - eta - 1) + D(s) + train(s), D(s) the longest solo
  latency in step s after its prompt's prefill. Summing along the eta + 1 chains of steps eta + 1
  apart, the makespan is at least (sum of D(s) + total training / N) / (eta + 1), and sum D(s) is
  smallest when the longest groups share steps.

The bound holds for the groups a policy must train: the first steps x groups_per_step it draws
(the simulator flags a run whose policy trained others). It assumes the policy respects its eta.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from gyre.hardware import Costs, group_train_attention_ctx
from gyre.train_work import SAMPLING_STREAM, selected_work
from gyre.trajectory.sample import SamplingConfig
from gyre.workload import GroupSpec, WorkloadConfig


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


@dataclass(frozen=True)
class _PerExec:
    """Per-execution sums over its turns (arrays over executions, in group order)."""

    gen: np.ndarray  # tokens decoded (0 if a deadline may cut it)
    kv_gen: np.ndarray  # sum of segment-start context x tokens decoded there
    pf: np.ndarray  # tokens prefilled at least
    pf_offset: np.ndarray  # sum of prefill tokens x their starting offset
    solo: np.ndarray  # solo latency, capped by the deadline
    to_decode_s: np.ndarray  # before the first decode: the first request's way to the engine, the prompt's prefill
    min_ctx: float  # the smallest context a decode token has


def per_exec(execs, costs: Costs) -> _PerExec:
    n = len(execs)
    gen, seg_of = _flat([e.gen for e in execs], n)
    kv, _ = _flat([e.kv for e in execs], n)
    tool_s, tool_of = _flat([e.tool_s for e in execs], n)
    tool_out, _ = _flat([e.tool_out for e in execs], n)
    # the prefill each turn needs (as the simulated engine does): the tool output appended after the turn,
    # or, when the next context is rebuilt smaller (compaction, retry), min(tool output, next context)
    lens = np.fromiter(map(len, (e.gen for e in execs)), np.int64, n)
    first = np.concatenate(([0], np.cumsum(lens)[:-1]))
    has_next = np.ones(len(gen), dtype=bool)
    has_next[np.cumsum(lens) - 1] = False
    after = kv[has_next] + gen[has_next]  # context after each turn that has a tool call
    nxt = kv[np.flatnonzero(has_next) + 1]
    grow = nxt >= after
    t_need = np.where(grow, nxt - after, np.minimum(tool_out, nxt))
    t_off = np.where(grow, after, nxt - t_need)
    prompt = kv[first]  # the engine prefills the first context (the prompt) from 0
    # per-token minima
    dec_s = np.asarray(costs.decode_s_per_token(kv))
    pf_tok_turn = np.asarray(costs.min_prefill_s_per_token(t_off))
    pf_tok_prompt = np.asarray(costs.min_prefill_s_per_token(np.zeros(n)))
    to_decode_s = costs.request_s + prompt * pf_tok_prompt  # at its cheapest
    alone = np.bincount(seg_of, gen * dec_s, minlength=n) + np.bincount(tool_of, tool_s + t_need * pf_tok_turn,
                                                                        minlength=n) + to_decode_s \
        + (lens - 1) * costs.request_s
    deadline = np.fromiter((e.deadline_s for e in execs), np.float64, n)
    sure = ~np.isfinite(deadline)  # only these are sure to run every turn
    G = np.where(sure, np.bincount(seg_of, gen, minlength=n), 0.0)
    KG = np.where(sure, np.bincount(seg_of, kv * gen, minlength=n), 0.0)
    PF = prompt + np.where(sure, np.bincount(tool_of, t_need, minlength=n), 0.0)
    PFO = np.where(sure, np.bincount(tool_of, t_need * t_off, minlength=n), 0.0)
    min_ctx = float(kv.min()) if len(kv) else 1.0
    return _PerExec(G, KG, PF, PFO, np.minimum(alone, deadline), to_decode_s, max(min_ctx, 1.0))


def _group_max(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    return np.maximum.reduceat(values, np.concatenate(([0], np.cumsum(sizes)[:-1])))


def group_solo_s(groups: list[GroupSpec], costs: Costs) -> np.ndarray:
    """Each group's solo duration (s): its longest execution alone at batch size 1, capped by its deadline."""
    if not groups:
        return np.zeros(0)
    sizes = np.fromiter((len(g.executions) for g in groups), np.int64, len(groups))
    return _group_max(per_exec([e for g in groups for e in g.executions], costs).solo, sizes)


def rollout_gpu_s_min(p: _PerExec, costs: Costs) -> float:
    """The least engine GPU-time that decodes and prefills the executions' tokens (module docstring)."""
    tokens = float(p.gen.sum() + p.pf.sum())
    if tokens <= 0:
        return 0.0
    n_max = max(costs.max_batched_tokens, costs.kv_capacity_tokens // (p.min_ctx + costs.state_tokens))
    r = costs.roofline
    if r is None:
        busy = costs.step_a * tokens / n_max + costs.step_b * float(p.gen.sum()) + costs.step_c * float(p.kv_gen.sum()) \
            + costs.prefill_s_per_token * float(p.pf.sum())
    else:
        flops = r.flops_per_token * tokens + r.attn_flops_per_ctx * float(p.kv_gen.sum() + p.pf_offset.sum())
        if r.hybrid:  # linear-attention layers: FLOPs per token, and each decode reads its sequence's state
            flops += r.lin_decode_flops * float(p.gen.sum()) + r.lin_prefill_flops * float(p.pf.sum())
        busy = r.min_busy_time(tokens=tokens, kv_read_tokens=float(p.kv_gen.sum()), flops=flops, max_step_tokens=n_max,
                               state_reads=float(p.gen.sum()))
    return busy * costs.engine_gpus


def lower_bound(groups: list[GroupSpec], costs: Costs, n_gpus: int, groups_per_step: int,
                eta: int | None = None, sampling: SamplingConfig | None = None, workload: WorkloadConfig | None = None,
                seed: int = 0) -> Bound:
    execs = [e for g in groups for e in g.executions]
    if not execs:
        return Bound(work_s=0.0, critical_path_s=0.0, rollout_gpu_s=0.0, train_gpu_s=0.0, eta=eta)
    p = per_exec(execs, costs)
    sizes = np.fromiter((len(g.executions) for g in groups), np.int64, len(groups))
    rollout = rollout_gpu_s_min(p, costs)
    if sampling is None or not sampling.sampled:  # training GPU-seconds per group: the shared prompt once, then every execution's tokens
        tokens = np.array([g.executions[0].prompt + sum(e.tokens - e.prompt for e in g.executions) for g in groups],
                          dtype=float)
        attn = np.array([group_train_attention_ctx(g.executions) for g in groups], dtype=float)
    else:
        works = [selected_work(g.executions, workload, sampling, np.random.default_rng([seed, SAMPLING_STREAM, g.group_id]))
                 for g in groups]
        tokens = np.array([w[0] for w in works], dtype=float)
        attn = np.array([w[1] for w in works], dtype=float)
    train_g = np.array([costs.train_time(t, 1, a) for t, a in zip(tokens, attn)])
    train = float(train_g.sum())
    solo = _group_max(p.solo, sizes)
    critical = float(np.max(solo + train_g / n_gpus))
    stale = 0.0
    if eta is not None:
        sure = np.fromiter((not np.isfinite(e.deadline_s) for e in execs), bool, len(execs))
        after_prompt = _group_max(np.where(sure, np.maximum(p.solo - p.to_decode_s, 0.0), 0.0), sizes)
        per_step = np.sort(after_prompt)[::-1][::groups_per_step]
        stale = (float(per_step.sum()) + train / n_gpus) / (eta + 1)
    return Bound(
        work_s=(rollout + train) / n_gpus,
        critical_path_s=critical,
        rollout_gpu_s=rollout,
        train_gpu_s=train,
        staleness_s=stale,
        eta=eta,
    )


def _flat(lists: list[list], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-execution lists into one float array, with the execution index of each item."""
    lens = np.fromiter(map(len, lists), np.int64, n)
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.float64, int(lens.sum()))
    return flat, np.repeat(np.arange(n), lens)
