"""Metrics from an event log, as pandas DataFrames (the same log schema from both backends).

Log records are tuples whose first two fields are (kind, time):
  ("role", t, gpus, role)            GPUs change role (gyre.cluster.Role)
  ("engine_up", t, engine, gpus)     ("engine_down", t, engine)
  ("busy", t, engine, 0|1)           an engine starts/stops having a decoding sequence
  ("group", t, group, size)          ("admit", t, exec, engine)   ("start", t, exec, engine)
  ("finish", t, exec, end, generated_tokens)  end: 0 done, 1 capped (length cap), 2 deadline hit
  ("preempt", t, exec, engine, tokens, gpu_s)  KV full: exec's context freed, to be recomputed (gpu_s)
  ("migrate", t, exec, src, dst)     ("sync", t, engine, version)
  ("move_request", t, exec, src, dst, tokens, gpu_s)  a decoding exec's in-flight model request cancelled at src
                                     (move_at="request"): `tokens` decoded in its segment discarded, their `gpu_s`
                                     lost; the "migrate" (or "park": dst None) record of the move follows
  ("park", t, exec, engine)          ("resume", t, exec, engine)  off every engine (KV freed) / back on one
  ("trained", t, exec, group, version, staleness, lag_tokens, tokens)  staleness: lag of its oldest token;
                                     lag_tokens: sum over its `tokens` generated tokens of (version - generating version)
  ("step", t, version, gpus, tokens) ("note", t, kind, fields)
  streaming steps (gyre.cluster.StepView): ("step_open", t, version, core_gpus, groups)  ("step_extend", t, version, group_ids)
  ("cell_join", t, version, gpus)  ("micro", t_end, version, exec, t_start, first_gpu, tokens)  ("cell_leave", t, version, gpus)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from operator import itemgetter

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
    preemptions: int = 0
    preempt_gpu_s: float = 0.0
    request_moves: int = 0  # in-flight requests cancelled and retried elsewhere ("move_request" records)
    discarded_tokens: float = 0.0  # ... the tokens they had decoded, discarded
    discarded_gpu_s: float = 0.0  # ... and the GPU-seconds those took
    roofline_gpu_s: float | None = None  # GPU-seconds of the work at hardware peak (simulator: gyre.roofline)
    extra: dict[str, float] = field(default_factory=dict)

    def token_lag(self) -> dict[str, float]:
        """Max and token-weighted mean version lag of the trained tokens (the max is the oldest token's)."""
        st = self.staleness
        tokens = float(st["tokens"].sum()) if len(st) else 0.0
        return {"lag_max": int(st["staleness"].max()) if len(st) else 0,
                "lag_mean": float(st["lag_tokens"].sum()) / tokens if tokens else 0.0}

    def summary(self) -> dict[str, float | str]:
        total = self.n_gpus * self.makespan_s or 1.0
        busy = self.gpu_seconds["rollout_busy"] + self.gpu_seconds["train"]
        st = self.staleness["staleness"] if len(self.staleness) else pd.Series([0])
        return {
            "policy": self.policy,
            "makespan_s": self.makespan_s,
            "steps": len(self.steps),
            "median_step_s": float(self.steps["duration_s"].median()) if len(self.steps) else 0.0,
            "utilization": self.roofline_gpu_s / total if self.roofline_gpu_s is not None else float("nan"),
            "busy_share": busy / total,
            **{f"gpu_h_{k}": v / 3600 for k, v in self.gpu_seconds.items()},
            "staleness_mean": float(st.mean()),
            "staleness_max": int(st.max()),
            **self.token_lag(),
            "tokens_generated": int(self.executions["generated"].sum()) if len(self.executions) else 0,
            "tokens_trained": int(self.steps["tokens"].sum()) if len(self.steps) else 0,
            "completed": int((self.executions["end"] == 0).sum()) if len(self.executions) else 0,
            "capped": int((self.executions["end"] == 1).sum()) if len(self.executions) else 0,
            "deadline_hit": int((self.executions["end"] == 2).sum()) if len(self.executions) else 0,
            "preemptions": self.preemptions,
            "preempt_gpu_s": self.preempt_gpu_s,
            "migrations": self.migrations,
            "reallocations": self.reallocations,
            **({"request_moves": self.request_moves, "discarded_tokens": self.discarded_tokens,
                "discarded_gpu_s": self.discarded_gpu_s} if self.request_moves else {}),  # only runs that moved any
            **self.extra,
        }


def _role_changes(log: list[tuple]) -> list[tuple[float, tuple[int, ...], int]]:
    return [(r[1], r[2], r[3]) for r in log if r[0] == "role"]


def by_kind(log: list[tuple]) -> dict[str, list[tuple]]:
    """The log's records split by kind, in log order (one pass; a 1M-execution run logs ~5M records)."""
    out: dict[str, list[tuple]] = {}
    for r in log:
        lst = out.get(r[0])
        if lst is None:
            lst = out[r[0]] = []
        lst.append(r)
    return out


def _frame(records: list[tuple], first: int, columns: list[str]) -> pd.DataFrame:
    """Fields records[i][first:] as columns (column-wise construction: fast for millions of rows)."""
    if not records:
        return pd.DataFrame(columns=columns)
    return pd.DataFrame({c: np.array(list(map(itemgetter(first + i), records))) for i, c in enumerate(columns)})


@dataclass
class _RoleEvents:
    """Every GPU role change flattened to one row per GPU, in log order: (t, gpu, new role, previous role);
    `order` sorts the rows by GPU, keeping log order within a GPU."""

    t: np.ndarray
    gpu: np.ndarray
    role: np.ndarray
    prev: np.ndarray
    order: np.ndarray

    @classmethod
    def of(cls, changes: list[tuple[float, tuple[int, ...], int]]) -> _RoleEvents:
        sizes = np.fromiter((len(g) for _, g, _ in changes), np.int64, len(changes))
        t = np.repeat(np.fromiter((c[0] for c in changes), np.float64, len(changes)), sizes)
        gpu = np.fromiter(itertools.chain.from_iterable(g for _, g, _ in changes), np.int64, int(sizes.sum()))
        role = np.repeat(np.fromiter((c[2] for c in changes), np.int64, len(changes)), sizes)
        order = np.argsort(gpu, kind="stable")  # per GPU, in log order
        prev = np.zeros_like(role)  # every GPU starts idle
        same = gpu[order][1:] == gpu[order][:-1]
        prev[order[1:][same]] = role[order[:-1][same]]
        return cls(t, gpu, role, prev, order)


def compute_metrics(log: list[tuple], *, n_gpus: int, policy: str) -> RunMetrics:
    kinds = by_kind(log)
    steps = _frame(kinds.get("step", []), 1, ["t_end", "version", "gpus", "tokens"])
    makespan = float(steps["t_end"].max()) if len(steps) else 0.0
    if len(steps):
        steps["duration_s"] = steps["t_end"].diff().fillna(steps["t_end"].iloc[0])
    else:
        steps["duration_s"] = []

    # GPU-seconds by role, and how often a GPU moved between rollout and train
    # (vectorized over GPUs: each GPU's role is a step function, each change closes an interval)
    changes = _role_changes(kinds.get("role", []))
    ev = _RoleEvents.of(changes)
    t = np.minimum(ev.t, makespan)
    order = ev.order
    g, ts = ev.gpu[order], t[order]
    first = np.ones(len(g), dtype=bool)
    first[1:] = g[1:] != g[:-1]
    since = np.where(first, 0.0, np.roll(ts, 1))
    secs = np.bincount(ev.prev[order], ts - since, minlength=4)  # the interval each change ends
    last = np.ones(len(g), dtype=bool)
    last[:-1] = g[1:] != g[:-1]
    role_now = np.zeros(n_gpus, dtype=np.int64)
    t_now = np.zeros(n_gpus)
    role_now[g[last]], t_now[g[last]] = ev.role[order][last], ts[last]
    secs = secs + np.bincount(role_now, makespan - t_now, minlength=4)  # the open interval at the end
    # reallocations: consecutive work roles (rollout 1 / train 2) of one GPU that differ
    w = order[(ev.role[order] == 1) | (ev.role[order] == 2)]
    realloc = int(np.count_nonzero((ev.gpu[w][1:] == ev.gpu[w][:-1]) & (ev.role[w][1:] != ev.role[w][:-1])))

    # rollout GPU-seconds in which the engine had something to decode
    engine_gpus = {r[2]: len(r[3]) for r in kinds.get("engine_up", [])}
    busy_since: dict[int, float] = {}
    rollout_busy = 0.0
    for rec in kinds.get("busy", []):
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
    staleness = _frame(kinds.get("trained", []), 2, ["exec", "group", "version", "staleness", "lag_tokens", "tokens"])
    executions = _frame(kinds.get("finish", []), 1, ["end_s", "exec", "end", "generated"])
    executions = executions[["exec", "end_s", "end", "generated"]]
    start = _frame(kinds.get("start", []), 1, ["t", "exec"])
    start_s = pd.Series(start["t"].to_numpy(dtype=float), index=start["exec"].to_numpy())
    start_s = start_s[~start_s.index.duplicated(keep="last")]
    executions.insert(1, "start_s", start_s.reindex(executions["exec"].to_numpy()).to_numpy())
    return RunMetrics(
        policy=policy,
        n_gpus=n_gpus,
        makespan_s=makespan,
        steps=steps,
        gpu_seconds=gpu_seconds,
        utilization=utilization_series(log, n_gpus, makespan, changes=changes),
        staleness=staleness,
        executions=executions,
        migrations=len(kinds.get("migrate", [])),
        reallocations=realloc,
        preemptions=len(kinds.get("preempt", [])),
        preempt_gpu_s=float(sum(r[5] for r in kinds.get("preempt", []))),
        request_moves=len(kinds.get("move_request", [])),
        discarded_tokens=float(sum(r[5] for r in kinds.get("move_request", []))),
        discarded_gpu_s=float(sum(r[6] for r in kinds.get("move_request", []))),
    )


def utilization_series(log: list[tuple], n_gpus: int, makespan: float, bins: int = 400,
                       changes: list[tuple] | None = None) -> pd.DataFrame:
    """GPUs per role, sampled on a uniform time grid (a step function of the role log)."""
    grid = np.linspace(0.0, makespan, bins + 1) if makespan > 0 else np.zeros(1)
    ev = _RoleEvents.of(_role_changes(log) if changes is None else changes)
    # GPUs per role after each change (log order), then the state after the last change at or before each grid time
    delta = np.zeros((len(ev.t) + 1, 4))
    delta[0, 0] = n_gpus  # every GPU starts idle
    np.add.at(delta, (np.arange(1, len(ev.t) + 1), ev.role), 1.0)
    np.add.at(delta, (np.arange(1, len(ev.t) + 1), ev.prev), -1.0)
    after = np.cumsum(delta, axis=0)
    counts = after[np.searchsorted(np.maximum.accumulate(ev.t) if len(ev.t) else ev.t, grid, side="right")]
    df = pd.DataFrame(counts, columns=ROLE_NAMES)
    df.insert(0, "t_s", grid)
    return df


def role_matrix(log: list[tuple], n_gpus: int, makespan: float, bins: int = 600) -> np.ndarray:
    """roles[gpu, time-bin] at each bin start, for the timeline figure: 0 idle, 1 rollout (decoding),
    2 train, 3 switching, 4 rollout with nothing to decode (every execution in a tool call, or none)."""
    grid = np.linspace(0.0, makespan, bins, endpoint=False)
    kinds = by_kind(log)
    ev = _RoleEvents.of(_role_changes(kinds.get("role", [])))
    # the last change at or before each bin start (changes are in log order, so a later one wins)
    last = np.full((n_gpus, bins + 1), -1, dtype=np.int64)
    j = np.searchsorted(grid, ev.t, side="left")
    np.maximum.at(last, (ev.gpu, j), np.arange(len(ev.t)))
    last = np.maximum.accumulate(last[:, :bins], axis=1)
    out = np.where(last >= 0, ev.role[np.maximum(last, 0)], 0).astype(np.int8)
    busy = np.zeros((n_gpus, bins), dtype=bool)
    engine_gpus = {r[2]: list(r[3]) for r in kinds.get("engine_up", [])}
    since: dict[int, float] = {}
    for rec in kinds.get("busy", []):
        if rec[3]:
            since[rec[2]] = rec[1]
        elif rec[2] in since:
            a, b = np.searchsorted(grid, [since.pop(rec[2]), rec[1]], side="left")
            busy[engine_gpus[rec[2]], max(a - 1, 0) if a == b else a:b] = True
    for eid, t0 in since.items():
        busy[engine_gpus[eid], int(np.searchsorted(grid, t0)):] = True
    out[(out == 1) & ~busy] = 4
    return out
