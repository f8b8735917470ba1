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

from dataclasses import dataclass

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


def lower_bound(groups: list[GroupSpec], costs: Costs, n_gpus: int, groups_per_step: int,
                eta: int | None = None) -> Bound:
    gen_tokens = 0
    ctx_weighted = 0.0
    prefill_tokens = 0
    longest = 0.0
    group_solo = []
    for g in groups:
        group_longest = 0.0
        for e in g.executions:
            gen_tokens += sum(e.gen)
            ctx_weighted += sum(k * n for k, n in zip(e.kv, e.gen))
            prefill_tokens += e.prompt + sum(e.tool_out)
            alone = sum(costs.step_time(1, k) * n for k, n in zip(e.kv, e.gen))
            alone += sum(e.tool_s) + (e.prompt + sum(e.tool_out)) * costs.prefill_s_per_token
            group_longest = max(group_longest, min(alone, e.deadline_s))
        group_solo.append(group_longest)
        longest = max(longest, group_longest)
    mean_ctx = ctx_weighted / max(gen_tokens, 1)
    rollout = gen_tokens / costs.best_decode_tokens_per_gpu_s(mean_ctx) + prefill_tokens * costs.prefill_s_per_token * costs.engine_gpus
    trained = [g.executions[0].prompt + sum(e.tokens - e.prompt for e in g.executions) for g in groups]
    train = sum(trained) * costs.train_s_per_token_gpu
    last = sum(trained[-groups_per_step:]) * costs.train_s_per_token_gpu / n_gpus
    stale = 0.0
    if eta is not None:
        per_step = sorted(group_solo, reverse=True)[::groups_per_step]
        stale = (sum(per_step) + train / n_gpus) / (eta + 1)
    return Bound(
        work_s=(rollout + train) / n_gpus,
        critical_path_s=longest + last,
        rollout_gpu_s=rollout,
        train_gpu_s=train,
        staleness_s=stale,
        eta=eta,
    )
