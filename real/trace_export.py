"""A real run as a rollout trace (gyre.traces.schema): its measured rollout shapes, for replay and calibration.

Each execution that ran becomes an ExecutionSpec of its measured segments (tokens generated and KV per turn,
tool latencies and tool-output tokens, branches), with its outcome (version, deadline hit, reward, start and
end). The trace header's workload describes the built-in agent task's shape (gyre.real.task.TaskConfig);
replay reads the records, never the header's distributions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyre.real import task as T
from gyre.real.backend import RealCluster

if TYPE_CHECKING:
    from gyre.real.config import RealRunConfig


def trace_groups(cluster: RealCluster):
    """The run's groups as gyre.workload GroupSpecs (measured shapes) plus per-execution outcomes."""
    from gyre.traces.schema import Outcome
    from gyre.workload import ExecutionSpec, GroupSpec

    groups, outcomes = [], {}
    for g in cluster.groups.values():
        specs = []
        for x in g.executions:
            if not x.segs or any(s["gen"] < 1 for s in x.segs):
                continue  # never ran (an unfinished run)
            n = len(x.segs)
            gen = [s["gen"] for s in x.segs]
            kv = [s["kv"] for s in x.segs]
            specs.append(ExecutionSpec(
                exec_id=x.id, group_id=g.id, task_id=g.task_id, step=g.id // cluster.cfg.groups_per_step,
                prompt=g.prompt_tokens, gen=gen, kv=kv,
                tool_s=[float(s.get("tool_s", 0.0)) for s in x.segs[:-1]],
                tool_out=[max(0, kv[i + 1] - kv[i] - gen[i]) for i in range(n - 1)],
                branches=[(i, k) for i, k in x.branch_marks if i < n], capped=x.end == 1,
                deadline_s=getattr(cluster.cfg.task, "deadline_s", float("inf")),
            ))
            outcomes[x.id] = Outcome(version=x.first_version, deadline_hit=bool(x.truncated), reward=x.reward,
                                     start_s=x.started_at, end_s=x.finished_at)
        if specs:
            groups.append(GroupSpec(group_id=g.id, task_id=g.task_id, step=g.id // cluster.cfg.groups_per_step,
                                    executions=specs))
    return groups, outcomes


def trace_workload(cfg: RealRunConfig):
    """A WorkloadConfig describing the built-in task (the trace header; replay reads the records)."""
    from gyre.workload import LogNormal, WorkloadConfig

    t = cfg.cluster.task
    if not isinstance(t, T.TaskConfig):  # another task: the toy's shape with its batch, for the header only
        t = T.TaskConfig()
    return WorkloadConfig(
        name="real-agent-task", groups_per_step=cfg.cluster.groups_per_step, group_size=cfg.cluster.group_size,
        prompt_tokens=LogNormal(median=3, p99_ratio=1.0), turns=LogNormal(median=3, p99_ratio=2.0),
        max_turns=t.max_turns, gen_tokens=LogNormal(median=t.max_new_tokens, p99_ratio=1.0),
        tool_out_tokens=LogNormal(median=3, p99_ratio=1.0), tool_s=LogNormal(median=t.fast_tool_s, p99_ratio=3.2),
        slow_tool_p=t.slow_tool_p, slow_tool_s=LogNormal(median=sum(t.slow_tool_s) / 2, p99_ratio=1.5),
        context_window=t.context_limit, summary_tokens=6, deadline_s=t.deadline_s,
    )
