"""Hand-checkable simulator scenarios: round-number costs and explicit execution specs."""

from __future__ import annotations

from dataclasses import replace

from gyre.config import ClusterConfig, RunConfig
from gyre.hardware import Costs
from gyre.presets import GPUS, MODELS, xlong_swe
from gyre.sim.cluster.backend import SimCluster
from gyre.workload import ExecutionSpec, GroupSpec, LogNormal, ReplaySource, WorkloadConfig

# decode at exactly 100 tokens/s per sequence whatever the batch; free prefill
ROUND_COSTS = Costs(
    engine_gpus=1, kv_capacity_tokens=10**9, step_a=0.01, step_b=0.0, step_c=0.0, prefill_s_per_token=0.0,
    train_s_per_token_gpu=0.01, min_train_gpus=1, sync_s=1.0, engine_wake_s=2.0, engine_sleep_s=1.0,
    trainer_onload_s=0.5, trainer_offload_s=0.5, kv_transfer_s_per_token=0.0, migration="reprefill",
)


def spec(exec_id: int, group: int, gen: list[int], tool_s: list[float] | None = None, prompt: int = 100,
         tool_out: list[int] | None = None, deadline_s: float = float("inf")) -> ExecutionSpec:
    n = len(gen)
    tool_s = tool_s or [0.0] * (n - 1)
    tool_out = tool_out or [0] * (n - 1)
    kv, ctx = [], prompt
    for i in range(n):
        kv.append(ctx)
        ctx += gen[i] + (tool_out[i] if i < n - 1 else 0)
    return ExecutionSpec(exec_id=exec_id, group_id=group, task_id=group, step=0, prompt=prompt, gen=gen,
                         tool_s=tool_s, tool_out=tool_out, kv=kv, branches=[], capped=False, deadline_s=deadline_s)


def workload(groups_per_step: int, group_size: int, window: int = 131072) -> WorkloadConfig:
    """A hand-built scenario's workload: only its batch shape and its window (the admission limit's) matter."""
    one = LogNormal(median=1, p99_ratio=1)
    return WorkloadConfig(name="hand", groups_per_step=groups_per_step, group_size=group_size, prompt_tokens=one,
                          turns=one, max_turns=10**6, gen_tokens=one, tool_out_tokens=one, tool_s=one,
                          context_window=window, summary_tokens=min(4096, window - 1))


def cluster(groups: list[GroupSpec], n_gpus: int, groups_per_step: int, costs: Costs = ROUND_COSTS,
            window: int = 131072) -> SimCluster:
    """A checked SimCluster replaying `groups`; an engine admits floor(KV capacity / window) at once."""
    src = ReplaySource(groups, workload(groups_per_step, len(groups[0].executions), window))
    return SimCluster(n_gpus=n_gpus, costs=costs, source=src, check=True)


def tiny_config(*, gpus: int = 8, groups_per_step: int = 3, group_size: int = 3, steps: int = 3, seed: int = 0,
                workload_name: str = "xlong") -> RunConfig:
    """A real preset's shape (dense 7B on H200) shrunk to a few executions of a few turns."""
    w = replace(xlong_swe(), groups_per_step=groups_per_step, group_size=group_size,
                turns=LogNormal(median=6, p99_ratio=10.0), max_turns=40, context_window=4000, summary_tokens=500,
                prompt_tokens=LogNormal(median=300, p99_ratio=2.0), subagent_p=0.05, retry_p=0.05,
                deadline_s=600.0)
    if workload_name == "math":
        w = replace(w, turns=LogNormal(median=1, p99_ratio=1.0), max_turns=1,
                    gen_tokens=LogNormal(median=2000, p99_ratio=3.0))
    return RunConfig(name="tiny", cluster=ClusterConfig(gpus=gpus, gpu=GPUS["h200"], model=MODELS["dense-7b"]),
                     workload=w, steps=steps, seed=seed)


class ParkingAsync:
    """async (eta, all GPUs but the trainer's generate) with a second process that, every `period` seconds,
    resumes every parked execution on a random ready engine and parks one random live execution (each at
    most once) at its next tool-call boundary: partial rollouts exercised at random moments (seeded)."""

    name = "parking-async"

    def __init__(self, eta: int, seed: int, period: float) -> None:
        self.eta, self.seed, self.period = eta, seed, period

    def run(self, cluster, steps):
        import numpy as np

        from gyre.policies.async_split import AsyncSplit

        stop = [False]
        cluster.spawn(self._parker(cluster, np.random.default_rng(self.seed), stop), "parker")
        yield from AsyncSplit(eta=self.eta).run(cluster, steps)
        stop[0] = True

    def _parker(self, cluster, rng, stop):
        once: set[int] = set()
        while not stop[0]:
            yield cluster.timeout(self.period)
            ready = [e for e in cluster.engines() if e.ready]
            for x in sorted(cluster.parked(), key=lambda x: x.id):
                cluster.resume(x, ready[int(rng.integers(len(ready)))])
            live = sorted((x for x in cluster.live() if x.id not in once), key=lambda x: x.id)
            if live:
                x = live[int(rng.integers(len(live)))]
                once.add(x.id)
                cluster.park(x)
