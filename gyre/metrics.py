"""Metrics from an event log, as pandas DataFrames (the same log schema from both backends).

Log records are tuples whose first two fields are (kind, time):
  ("role", t, gpus, role)            GPUs change role (gyre.cluster.Role)
  ("engine_up", t, engine, gpus)     ("engine_down", t, engine)
  ("busy", t, engine, 0|1)           an engine starts/stops having a decoding sequence
  ("group", t, group, size)          ("admit", t, exec, engine)   ("start", t, exec, engine)
  ("finish", t, exec, truncated, generated_tokens)
  ("migrate", t, exec, src, dst)     ("sync", t, engine, version)
  ("trained", t, exec, group, version, staleness)
  ("step", t, version, gpus, tokens) ("note", t, kind, fields)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

ROLE_NAMES = ["idle", "rollout", "train", "switching"]
TIMELINE_NAMES = ROLE_NAMES + ["rollout, nothing decoding"]


@dataclass
class RunMetrics:
    policy: str
    n_gpus: int
    makespan_s: float
    steps: pd.DataFrame
    gpu_seconds: dict[str, float]
    utilization: pd.DataFrame
    staleness: pd.DataFrame
    executions: pd.DataFrame
    migrations: int
    reallocations: int
    extra: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, float | str]:
        total = self.n_gpus * self.makespan_s or 1.0
        busy = self.gpu_seconds["rollout_busy"] + self.gpu_seconds["train"]
        st = self.staleness["staleness"] if len(self.staleness) else pd.Series([0])
        return {
            "policy": self.policy,
            "makespan_s": self.makespan_s,
            "steps": len(self.steps),
            "median_step_s": float(self.steps["duration_s"].median()) if len(self.steps) else 0.0,
            "utilization": busy / total,
            **{f"gpu_h_{k}": v / 3600 for k, v in self.gpu_seconds.items()},
            "staleness_mean": float(st.mean()),
            "staleness_max": int(st.max()),
            "tokens_generated": int(self.executions["generated"].sum()) if len(self.executions) else 0,
            "tokens_trained": int(self.steps["tokens"].sum()) if len(self.steps) else 0,
            "truncated": int(self.executions["truncated"].sum()) if len(self.executions) else 0,
            "migrations": self.migrations,
            "reallocations": self.reallocations,
            **self.extra,
        }


def _role_changes(log: list[tuple]) -> list[tuple[float, tuple[int, ...], int]]:
    return [(r[1], r[2], r[3]) for r in log if r[0] == "role"]


def compute_metrics(log: list[tuple], *, n_gpus: int, policy: str) -> RunMetrics:
    steps = pd.DataFrame([r[1:] for r in log if r[0] == "step"], columns=["t_end", "version", "gpus", "tokens"])
    makespan = float(steps["t_end"].max()) if len(steps) else 0.0
    if len(steps):
        steps["duration_s"] = steps["t_end"].diff().fillna(steps["t_end"].iloc[0])
    else:
        steps["duration_s"] = []

    # GPU-seconds by role, and how often a GPU moved between rollout and train
    role = np.zeros(n_gpus, dtype=np.int64)
    since = np.zeros(n_gpus)
    last_work = np.full(n_gpus, -1)
    secs = np.zeros(4)
    realloc = 0
    changes = _role_changes(log)
    for t, gpus, r in changes:
        if t > makespan:
            t = makespan
        idx = np.fromiter(gpus, dtype=np.int64, count=len(gpus))
        np.add.at(secs, role[idx], t - since[idx])
        since[idx] = t
        role[idx] = r
        if r in (1, 2):
            realloc += int(np.count_nonzero((last_work[idx] >= 0) & (last_work[idx] != r)))
            last_work[idx] = r
    np.add.at(secs, role, makespan - since)

    # rollout GPU-seconds in which the engine had something to decode
    engine_gpus: dict[int, int] = {}
    busy_since: dict[int, float] = {}
    rollout_busy = 0.0
    for rec in log:
        if rec[0] == "engine_up":
            engine_gpus[rec[2]] = len(rec[3])
        elif rec[0] == "busy":
            if rec[3]:
                busy_since[rec[2]] = rec[1]
            elif rec[2] in busy_since:
                rollout_busy += (min(rec[1], makespan) - busy_since.pop(rec[2])) * engine_gpus[rec[2]]
    for eid, t0 in busy_since.items():
        rollout_busy += max(0.0, makespan - t0) * engine_gpus[eid]

    gpu_seconds = {
        "rollout_busy": rollout_busy,
        "rollout_idle": float(secs[1]) - rollout_busy,
        "train": float(secs[2]),
        "switching": float(secs[3]),
        "idle": float(secs[0]),
    }
    staleness = pd.DataFrame(
        [r[2:] for r in log if r[0] == "trained"], columns=["exec", "group", "version", "staleness"]
    )
    starts = {r[2]: r[1] for r in log if r[0] == "start"}
    executions = pd.DataFrame(
        [(r[2], starts.get(r[2], np.nan), r[1], r[3], r[4]) for r in log if r[0] == "finish"],
        columns=["exec", "start_s", "end_s", "truncated", "generated"],
    )
    return RunMetrics(
        policy=policy,
        n_gpus=n_gpus,
        makespan_s=makespan,
        steps=steps,
        gpu_seconds=gpu_seconds,
        utilization=utilization_series(log, n_gpus, makespan),
        staleness=staleness,
        executions=executions,
        migrations=sum(1 for r in log if r[0] == "migrate"),
        reallocations=realloc,
    )


def utilization_series(log: list[tuple], n_gpus: int, makespan: float, bins: int = 400) -> pd.DataFrame:
    """GPUs per role, sampled on a uniform time grid (a step function of the role log)."""
    grid = np.linspace(0.0, makespan, bins + 1) if makespan > 0 else np.zeros(1)
    counts = np.zeros((len(grid), 4))
    role = np.zeros(n_gpus, dtype=np.int64)
    cur = np.bincount(role, minlength=4).astype(float)
    j = 0
    for t, gpus, r in _role_changes(log):
        while j < len(grid) and grid[j] < t:
            counts[j] = cur
            j += 1
        idx = np.fromiter(gpus, dtype=np.int64, count=len(gpus))
        np.subtract.at(cur, role[idx], 1)
        role[idx] = r
        np.add.at(cur, role[idx], 1)
    counts[j:] = cur
    df = pd.DataFrame(counts, columns=ROLE_NAMES)
    df.insert(0, "t_s", grid)
    return df


def role_matrix(log: list[tuple], n_gpus: int, makespan: float, bins: int = 600) -> np.ndarray:
    """roles[gpu, time-bin] at each bin start, for the timeline figure: 0 idle, 1 rollout (decoding),
    2 train, 3 switching, 4 rollout with nothing to decode (every execution in a tool call, or none)."""
    grid = np.linspace(0.0, makespan, bins, endpoint=False)
    out = np.zeros((n_gpus, bins), dtype=np.int8)
    for t, gpus, r in _role_changes(log):
        j = int(np.searchsorted(grid, t, side="left"))
        out[list(gpus), j:] = r
    busy = np.zeros((n_gpus, bins), dtype=bool)
    engine_gpus: dict[int, list[int]] = {}
    since: dict[int, float] = {}
    for rec in log:
        if rec[0] == "engine_up":
            engine_gpus[rec[2]] = list(rec[3])
        elif rec[0] == "busy":
            if rec[3]:
                since[rec[2]] = rec[1]
            elif rec[2] in since:
                a, b = np.searchsorted(grid, [since.pop(rec[2]), rec[1]], side="left")
                busy[engine_gpus[rec[2]], max(a - 1, 0) if a == b else a:b] = True
    for eid, t0 in since.items():
        busy[engine_gpus[eid], int(np.searchsorted(grid, t0)):] = True
    out[(out == 1) & ~busy] = 4
    return out
