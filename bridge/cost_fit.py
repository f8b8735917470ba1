"""Sim-to-real (`gyre-real calibrate`): the simulator's cost model fitted to a real run's profile, then other
policies predicted.

What it models: gyre.hardware.Costs is the simulator's whole cost model. From one real run's profile:
- decode step time a + b*batch + c*KV tokens: least squares over every engine decode step;
- prefill seconds per token: the engine's measured prefill time over the tokens it prefilled;
- request latency outside the engine (`Costs.request_s`: RPC and event-loop time the driver sees and
  the engine does not): the mean over requests of the driver-measured wall time less the fitted decode
  time of its tokens (at the batch it joined, no context term) and its prefill at the per-token rate.
  The simulator delays each turn of the execution alone by it; inside an engine step it would slow
  every sequence sharing the step;
- training seconds per token x GPU: measured step wall time x the run's training GPUs / tokens;
- weight sync, engine wake (role switch in) and sleep (role switch out): measured means; the simulator
  charges a sync on every engine start, so the wake it is given is the measured wake minus a sync.
A run's rollout trace (measured segment lengths and tool latencies) is replayed as the workload. Two
kinds of prediction (`workload`):
- "source": the source run's trace stands in for the predicted policy's rollouts: what a user gets before
  running that policy. Its error includes how differently the two runs learned (same seeds, but RL
  amplifies rounding differences, e.g. a different data-parallel width, into different rollouts);
- "own": the predicted policy's own measured trace with the source's cost model: the error of the cost
  model and of the scheduling it drives alone.

Simplifications: the simulator divides a step's training time by its GPU count; the real data-parallel
trainer on logical GPUs that share a few CPU cores does not get faster with more workers, so by default
(`train_scales=False`) a prediction is re-run with the per-token cost rescaled to the predicted policy's
median training GPU count.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from gyre.estimate import EstimateError, fit_step, fit_train_s_per_token_gpu
from gyre.hardware import Costs


class CostFitError(ValueError):
    """Missing or unusable run output; the message names the file."""


def costs_from_profile(profile: dict, *, engine_gpus: int, kv_capacity: int, train_gpus: int,
                       min_train_gpus: int) -> Costs:
    try:  # the decode line and the training rate are fitted as a start-up profile fits them (gyre.estimate)
        step = fit_step(profile.get("engine_decode"))
        train = fit_train_s_per_token_gpu(profile.get("train"), train_gpus)
    except EstimateError as exc:
        raise CostFitError(str(exc)) from None
    a, b, c = step.a, step.b, step.c
    pre = np.asarray(profile.get("engine_prefill") or [[1, 0.0]], dtype=np.float64).reshape(-1, 2)
    prefill = float(pre[:, 1].sum()) / max(float(pre[:, 0].sum()), 1.0)
    req = np.asarray(profile.get("requests") or [], dtype=np.float64).reshape(-1, 4)  # new, gen, batch, wall
    request_s = 0.0
    if len(req):
        engine_s = (a + b * np.maximum(req[:, 2], 1.0)) * req[:, 1] + prefill * req[:, 0]
        request_s = max(0.0, float(np.mean(req[:, 3] - engine_s)))
    mean = lambda k, d=0.0: float(np.mean(profile[k])) if profile.get(k) else d  # noqa: E731
    return Costs(
        engine_gpus=engine_gpus, kv_capacity_tokens=kv_capacity, step_a=a, step_b=b, step_c=c,
        prefill_s_per_token=prefill, train_s_per_token_gpu=train, min_train_gpus=min_train_gpus,
        sync_s=mean("sync"), engine_wake_s=max(0.0, mean("wake") - mean("sync")), engine_sleep_s=mean("sleep"),
        trainer_onload_s=0.0, trainer_offload_s=0.0, kv_transfer_s_per_token=0.0, migration="reprefill",
        request_s=request_s,
    )


class TraceSource:
    """Replays a trace's groups in order (cycling if a policy asks for more) as a simulator source."""

    def __init__(self, groups, workload) -> None:
        if not groups:
            raise CostFitError("trace has no groups")
        self.groups = groups
        self.config = workload
        self.i = 0

    def next_group(self):
        import dataclasses

        g = self.groups[self.i % len(self.groups)]
        k = self.i // len(self.groups)
        self.i += 1
        if k == 0:
            return g
        off = k * (max(e.exec_id for x in self.groups for e in x.executions) + 1)
        gid = g.group_id + k * len(self.groups)
        return dataclasses.replace(g, group_id=gid, executions=[
            dataclasses.replace(e, exec_id=e.exec_id + off, group_id=gid) for e in g.executions])


def simulate_with(costs: Costs, trace, policy: str, steps: int, n_gpus: int, params: dict | None = None
                  ) -> tuple[float, float]:
    """Simulated makespan of `policy` on the trace's workload with the calibrated costs, and its median
    training GPU count."""
    from gyre.metrics import compute_metrics
    from gyre.policies import make_policy
    from gyre.sim.cluster.backend import SimCluster

    src = TraceSource(trace.groups, trace.workload)
    sim = SimCluster(n_gpus=n_gpus, costs=costs, source=src)
    sim.run(make_policy(policy, **(params or {})), steps)
    m = compute_metrics(sim.log, n_gpus=n_gpus, policy=policy)
    return m.makespan_s, float(m.steps["gpus"].median())


def load_run(run_dir: Path, policy: str):
    from gyre.traces.schema import TraceError, read_trace

    prof, tr = run_dir / f"profile_{policy}.json", run_dir / f"trace_{policy}.jsonl"
    if not prof.exists() or not tr.exists():
        raise CostFitError(f"{run_dir}: no profile/trace for policy {policy!r} (run gyre-real run first)")
    try:
        return json.loads(prof.read_text()), read_trace(tr)
    except (ValueError, TraceError) as exc:
        raise CostFitError(f"{tr}: {exc}") from None


def fitted_costs(run_dir: str | Path, source: str):
    """The cost model calibrated on `source`'s run in `run_dir`, that run's trace, and its median training GPUs."""
    run_dir = Path(run_dir)
    profile, trace = load_run(run_dir, source)
    run = trace.run
    src_gpus = float(pd.read_csv(run_dir / f"steps_{source}.csv")["gpus"].median())
    costs = costs_from_profile(profile, engine_gpus=run["gpus_per_engine"], kv_capacity=run["kv_capacity"],
                               train_gpus=src_gpus, min_train_gpus=run["min_train_gpus"])
    return costs, trace, src_gpus


def describe(costs: Costs) -> str:
    """One line: the calibrated constants a prediction rests on."""
    return (f"engine step {costs.step_a * 1e3:.2f} ms + {costs.step_b * 1e3:.3f} ms/sequence + "
            f"{costs.step_c * 1e6:.3f} us/KV token; prefill {costs.prefill_s_per_token * 1e3:.3f} ms/token; "
            f"request latency outside the engine {costs.request_s * 1e3:.1f} ms/turn; training "
            f"{costs.train_s_per_token_gpu * 1e3:.3f} ms/token x GPU; wake {costs.engine_wake_s:.3f} s, "
            f"sleep {costs.engine_sleep_s:.3f} s, sync {costs.sync_s:.3f} s")


def predict_makespans(run_dir: str | Path, source: str, predict: list[str], *, train_scales: bool = False,
                      workload: str = "source", calibrated: tuple | None = None) -> pd.DataFrame:
    """Predicted (calibrated on `source`) vs measured makespan for each policy in `predict`.

    `workload`: "source" replays the source run's trace for every prediction; "own" replays each
    predicted policy's own trace (it must have been run). `train_scales`: whether the real trainer's step
    time shrinks with its GPU count (False: the prediction is re-run with the per-token cost at the
    predicted policy's median training GPU count). `calibrated`: `fitted_costs(run_dir, source)`, if the
    caller has it already."""
    if workload not in ("source", "own"):
        raise CostFitError(f"workload must be 'source' or 'own', not {workload!r}")
    run_dir = Path(run_dir)
    costs, trace, src_gpus = calibrated if calibrated is not None else fitted_costs(run_dir, source)
    run = trace.run
    summary = pd.read_csv(run_dir / "summary.csv").set_index("policy")
    rows = []
    for p in predict:
        tr = trace if workload == "source" or p == source else load_run(run_dir, p)[1]
        args = (tr, p, int(run["steps"]), int(run["n_gpus"]), run.get("params", {}).get(p))
        pred, gpus = simulate_with(costs, *args)
        if not train_scales:  # the trainer's time per token is taken as the same on any GPU count
            c2 = dataclasses.replace(costs, train_s_per_token_gpu=costs.train_s_per_token_gpu / src_gpus * gpus)
            pred, _ = simulate_with(c2, *args)
        meas = float(summary.loc[p, "makespan_s"]) if p in summary.index else float("nan")
        rows.append({"policy": p, "calibrated_on": source, "workload": workload, "predicted_s": pred, "measured_s": meas,
                     "error": (pred - meas) / meas if not math.isnan(meas) else float("nan")})
    return pd.DataFrame(rows)
