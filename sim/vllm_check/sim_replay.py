"""Replay a vLLM run's arrivals through the simulator's own engine: the check that `gyre-sim run` is right.

vllm_scheduler models vLLM's scheduler step by step; this runs the same requests through
gyre.sim.cluster.engine.SimEngine, the fluid engine `gyre-sim run` uses (chunked prefill sharing the token
budget, hard KV limit with preemption by recompute, the roofline step time), on a SimCluster of the
run's data-parallel replicas of `tensor_parallel` GPUs each. Each request is a one-segment execution
(prompt = input tokens, one segment of output tokens) admitted at its arrival to the
replica vLLM's DP load balancer picks; engines start at time 0 at no cost. An expert-parallel run's
engines use the roofline with the group balanced (gyre.roofline: each replica's MoE layers see the
group's tokens as DP x its own), not the step loop's lockstep. KV capacity is the run's (its logged blocks).

The run's `max_num_seqs` caps each engine's running requests, as in the step loop. What the fluid
engine does not model, so its errors add to the step loop's: per-step granularity (rates are held
between events), and the first-token time (it records when a request starts and finishes, so only
end-to-end latency and makespan are compared).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from gyre.handles import all_of
from gyre.hardware import CostConfig, derive_costs, engine_roofline
from gyre.roofline import Coefficients
from gyre.sim.cluster.backend import SimCluster
from gyre.sim.vllm_check.vllm_scheduler import DPBalancer
from gyre.sim.vllm_check.serving_run import Run, setup
from gyre.workload import ExecutionSpec, GroupSpec, ReplaySource


class _Arrivals:
    """Start the replicas, then admit each request at its arrival to the replica vLLM's DP load balancer
    picks (vllm_scheduler.DPBalancer: least 4 x waiting + running, from counts refreshed every 100 ms)."""

    name = "arrivals"

    def __init__(self, arrival: np.ndarray, tp: int, dp: int) -> None:
        self.arrival, self.tp, self.dp = arrival, tp, dp

    def run(self, cluster, steps: int):
        engines = yield all_of([cluster.start_engine(list(range(i * self.tp, (i + 1) * self.tp)))
                                for i in range(self.dp)])
        grp = cluster.next_group()
        handles = []
        balancer = DPBalancer(len(engines))
        for ex, a in zip(grp.executions, self.arrival):
            if a > cluster.now:
                yield cluster.timeout(float(a) - cluster.now)
            live = [(e.n_queued, e.n_live - e.n_queued) for e in engines]
            handles.append(cluster.admit(ex, engines[balancer.route(cluster.now, live)]))
        yield all_of(handles)


def sim_engine_replay(run: Run, coef: Coefficients) -> tuple[np.ndarray, np.ndarray, list[tuple]]:
    """(start, finish) times per request, in arrival order, and the cluster's log, from SimEngine."""
    roof, args = setup(run, coef)
    e = run.engine
    tp = e.tensor_parallel
    model, gpu = run.model_cfg, run.gpu_cfg
    cost = CostConfig(engine=roof.coef, max_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs)
    costs = replace(derive_costs(model, gpu, cost), engine_gpus=tp,
                    roofline=engine_roofline(model, gpu, tp, roof.coef, e.max_num_batched_tokens,
                                             ep_gpus=roof.ep_gpus),
                    kv_capacity_tokens=args.kv_blocks * args.block_size, engine_wake_s=0.0, sync_s=0.0,
                    trainer_offload_s=0.0, trainer_onload_s=0.0)
    r = run.requests
    specs = [ExecutionSpec(exec_id=i, group_id=0, task_id=0, step=0, prompt=int(p), gen=[int(o)], tool_s=[],
                           tool_out=[], kv=[int(p)], branches=[], capped=False, deadline_s=float("inf"))
             for i, (p, o) in enumerate(zip(r.input_toks, r.output_toks))]
    source = ReplaySource([GroupSpec(group_id=0, task_id=0, step=0, executions=specs)],
                          SimpleNamespace(groups_per_step=1,
                                           max_context=int(max(r.input_toks + r.output_toks, default=1))))
    cluster = SimCluster(n_gpus=tp * e.data_parallel, costs=costs, source=source)
    cluster.run(_Arrivals(r.queued, tp, e.data_parallel), 1)
    exs = sorted(cluster.groups[0].executions, key=lambda x: x.id)
    start = np.array([x.started_at for x in exs], dtype=float)
    finish = np.array([x.finished_at for x in exs], dtype=float)
    return start, finish, cluster.log


def sim_errors(run: Run, finish: np.ndarray, idx: np.ndarray) -> dict[str, float]:
    """End-to-end (median, p90) and makespan errors of the simulator engine's `finish` times on requests `idx`."""
    r = run.requests
    rel = np.abs((finish[idx] - r.queued[idx]) / r.e2e[idx] - 1.0)
    return {"e2e_median_rel_err": float(np.median(rel)), "e2e_p90_rel_err": float(np.quantile(rel, 0.9)),
            "makespan_rel_err": abs(float(finish.max() - r.queued.min()) / r.makespan - 1.0)}
