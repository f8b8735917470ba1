"""Which deadline cuts of a run the scheduler caused, counted from its log.

A comparison counts only at equal work (DESIGN.md, "Comparing policies fairly"). A deadline is part of
the workload, so an execution too long to finish within it even alone on an idle engine is cut by any
policy; one that would have finished alone but was cut anyway was cut by the scheduler (queued,
thrashed, starved of decode). Which is which comes from the lower bound's solo latency of each execution
(sim/cluster/bound.py: batch 1, cheapest prefill, its tool time, capped by the deadline): an execution is a
scheduler-induced cut when its finish record says it ended at its deadline and its solo latency is below
that deadline. The tokens it lost are those its spec would have decoded minus those its finish record
says it did. If an execution finished more than once (a fault re-ran it), its last finish record counts.

The counts cover the executions of the groups passed (every group the run drew), like the log-based
`completed` / `capped` / `deadline_hit` of gyre.metrics; policies.tuning ranks runs on `sched_cuts`.
"""

from __future__ import annotations

from collections.abc import Iterable

from gyre.hardware import Costs
from gyre.sim.cluster.bound import per_exec  # the bound's per-execution solo latency
from gyre.workload import GroupSpec

END_DEADLINE = 2  # the finish record's end field: 0 done, 1 capped, 2 deadline (gyre.metrics)


def scheduler_cuts(log: Iterable[tuple], groups: list[GroupSpec], costs: Costs) -> dict[str, int]:
    """{"sched_cuts": executions cut by their deadline that would have finished within it alone,
    "sched_cut_tokens_lost": the tokens they did not decode} over the executions of `groups`."""
    execs = [e for g in groups for e in g.executions]
    solo = per_exec(execs, costs).solo if execs else []
    spec = {e.exec_id: (e, float(s)) for e, s in zip(execs, solo)}
    last: dict[int, tuple] = {}
    for r in log:
        if r[0] == "finish" and r[2] in spec:
            last[r[2]] = r
    cuts = lost = 0
    for eid, (_, _, _, end, generated) in last.items():
        e, solo_s = spec[eid]
        if end == END_DEADLINE and solo_s < e.deadline_s:
            cuts += 1
            lost += max(0, sum(e.gen) - int(generated))
    return {"sched_cuts": cuts, "sched_cut_tokens_lost": lost}
