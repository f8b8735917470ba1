"""A calibrated workload: gyre groups whose per-execution quantities come from fitted distributions.

Same structure as gyre.workload (prompt per task, segments of generated tokens separated by tool
calls, sub-agent/retry events at per-turn rates, compaction past the context window, all folded into
the KV footprint by gyre.workload's walk), but every quantity is drawn from a TailDist fitted to a
trace instead of a lognormal:

- the *length* (turns per execution for multi-turn traces, generated tokens for single-turn ones)
  is TailDist x difficulty x drift, where a task's difficulty is lognormal with log-sd
  `difficulty_sigma`, shared by its group, and the drift factor (1 + drift_per_step) ** step is
  held inside `drift_range` (the levels seen in the fitted data: never extrapolated past them);
  scaling never takes a length below the smallest or above the largest seen (`length_range`),
  unless the unscaled draw already was; a length reaching the cap ends capped;
- tokens per turn, tool-output tokens and tool latency per call, and the prompt are independent
  draws from their own TailDists; the prompt is one per task (the group) in rollout traces and one
  per execution when `prompt_per_execution` (request and session traces: groups there are windows
  of arrivals, not tasks).

`base` is a plain WorkloadConfig (lognormal summaries of the same data) that carries the structure
(group size, groups per step, window, branching rates, deadline) for everything that reads
`source.config`. Simplification: quantities within an execution are independent given its length.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gyre.traces.tail_dist import TailDist
from gyre.traces.schema import TraceError, workload_from_dict, workload_to_dict
from gyre.workload import ExecutionSpec, GroupSpec, WorkloadConfig, _kv_footprint

FORMAT_VERSION = 1


@dataclass(kw_only=True)
class CalibratedWorkload:
    base: WorkloadConfig
    dists: dict[str, TailDist]  # "length" plus "gen", "tool_out", "tool_s", "prompt" (any may be absent)
    scale_target: str  # "turns" or "gen": which quantity `length` is
    difficulty_sigma: float = 0.0
    drift_per_step: float = 0.0
    drift_range: tuple[float, float] = (0.0, math.inf)  # the drift factor is clipped into this range
    length_range: tuple[float, float] = (0.0, math.inf)  # scaling keeps a length inside (smallest, largest seen)
    prompt_per_execution: bool = False
    report: dict[str, Any] = field(default_factory=dict)  # fit quality, provenance (not used to sample)

    def __post_init__(self) -> None:
        if self.scale_target not in ("turns", "gen"):
            raise TraceError(f"scale_target must be 'turns' or 'gen', got {self.scale_target!r}")
        if "length" not in self.dists:
            raise TraceError("a calibrated workload needs a 'length' distribution")

    @property
    def length_cap(self) -> float:
        c = self.dists["length"].cap
        if self.scale_target == "turns":
            return float(self.base.max_turns if c is None else min(c, self.base.max_turns))
        return math.inf if c is None else float(c)

    def to_json(self) -> dict[str, Any]:
        return {
            "gyre_workload": FORMAT_VERSION, "kind": "calibrated", "workload": workload_to_dict(self.base),
            "scale_target": self.scale_target, "difficulty_sigma": self.difficulty_sigma,
            "drift_per_step": self.drift_per_step, "drift_range": _json_range(self.drift_range),
            "length_range": _json_range(self.length_range),
            "prompt_per_execution": self.prompt_per_execution, "dists": {k: d.to_dict() for k, d in self.dists.items()},
            "report": self.report,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, allow_nan=False, default=float))


def _json_range(r: tuple[float, float]) -> list:
    return [r[0], None if math.isinf(r[1]) else r[1]]


def _range(v) -> tuple[float, float]:
    """[lo, hi] from JSON (hi null: unbounded); absent (a file written before bounds): (0, inf)."""
    lo, hi = v if v is not None else (0.0, None)
    return float(lo), math.inf if hi is None else float(hi)


def load_workload(path: str | Path) -> CalibratedWorkload:
    """Read a calibrated workload JSON; a bad file is one line naming it and the field."""
    try:
        d = json.loads(Path(path).read_text())
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise TraceError(f"{path}:1: invalid JSON: {exc}") from None
    if not isinstance(d, dict) or d.get("gyre_workload") != FORMAT_VERSION or d.get("kind") != "calibrated":
        raise TraceError(f"{path}:1: not a calibrated gyre workload (expected gyre_workload={FORMAT_VERSION})")
    try:
        dists = {k: TailDist.from_dict(v) for k, v in d["dists"].items()}
        return CalibratedWorkload(
            base=workload_from_dict(d["workload"], str(path)), dists=dists, scale_target=d["scale_target"],
            difficulty_sigma=float(d.get("difficulty_sigma", 0.0)), drift_per_step=float(d.get("drift_per_step", 0.0)),
            drift_range=_range(d.get("drift_range")), length_range=_range(d.get("length_range")),
            prompt_per_execution=bool(d.get("prompt_per_execution", False)), report=d.get("report", {}),
        )
    except KeyError as exc:
        raise TraceError(f"{path}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{path}: bad field: {exc}") from None


def drift_factor(cw: CalibratedWorkload, step) -> np.ndarray:
    """(1 + drift_per_step) ** step, clipped into cw.drift_range."""
    lo, hi = cw.drift_range
    return np.clip(np.power(1.0 + cw.drift_per_step, np.asarray(step, dtype=float)), lo, hi)


def scaled_length(cw: CalibratedWorkload, raw: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Length draws times their scale (difficulty x drift), bounded: a draw at the cap stays there, and
    scaling moves no draw below the smallest or above the largest length seen, nor past the cap."""
    cap = cw.length_cap
    lo, hi = cw.length_range
    x = np.clip(raw * scale, np.minimum(raw, lo), np.maximum(raw, hi))
    return np.where(raw >= cap, cap, np.minimum(x, cap))


def _draw(cw: CalibratedWorkload, name: str, rng: np.random.Generator, n: int, default: float) -> np.ndarray:
    d = cw.dists.get(name)
    return d.sample(rng, n) if d is not None else np.full(n, default)


def sample_calibrated_group(cw: CalibratedWorkload, group_id: int, step: int, seed: int) -> GroupSpec:
    """One group; deterministic in (seed, group_id), like gyre.workload.sample_group."""
    w = cw.base
    rng = np.random.default_rng([seed, group_id, 0x7ACE])
    k = w.group_size
    scale = math.exp(cw.difficulty_sigma * rng.standard_normal()) * float(drift_factor(cw, step))
    prompts = np.maximum(0, _draw(cw, "prompt", rng, k if cw.prompt_per_execution else 1, 0)).astype(np.int64)
    prompts = np.broadcast_to(prompts, k).tolist()
    cap = cw.length_cap
    length = scaled_length(cw, cw.dists["length"].sample(rng, k), np.full(k, scale))
    capped = length >= cap
    if cw.scale_target == "turns":
        turns = np.maximum(1, np.round(length)).astype(np.int64)
    else:
        turns = np.maximum(1, np.round(_draw(cw, "turns", rng, k, 1))).astype(np.int64)
    total = int(turns.sum())
    gen = np.maximum(1, np.round(_draw(cw, "gen", rng, total, 1))).astype(np.int64)
    if cw.scale_target == "gen":  # single-turn: the length is the (first) segment's tokens
        gen[np.cumsum(turns) - turns] = np.maximum(1, np.round(length)).astype(np.int64)
    tool_out_a = np.maximum(0, np.round(_draw(cw, "tool_out", rng, total, 0))).astype(np.int64)
    tool_s = np.maximum(0.0, _draw(cw, "tool_s", rng, total, 0.0)).tolist()
    u = rng.random(total)
    events = np.where(u < w.subagent_p, 1, np.where(u < w.subagent_p + w.retry_p, 2, 0))
    gen_l, tool_out, capped_l = gen.tolist(), tool_out_a.tolist(), capped.tolist()
    execs = []
    lo = 0
    for j, n in enumerate(turns.tolist()):
        hi = lo + n
        g = gen_l[lo:hi]
        prompt = prompts[j]
        if n == 1 and prompt <= w.context_window:  # the walk, for one segment
            kv, branches = [prompt], []
        else:
            kv, branches = _kv_footprint(prompt, gen[lo:hi], tool_out_a[lo:hi], events[lo:hi], w)
        execs.append(ExecutionSpec(
            exec_id=group_id * k + j, group_id=group_id, task_id=group_id, step=step, prompt=prompt, gen=g,
            tool_s=tool_s[lo : hi - 1], tool_out=tool_out[lo : hi - 1], kv=kv, branches=branches,
            capped=capped_l[j], deadline_s=w.deadline_s,
        ))
        lo = hi
    return GroupSpec(group_id=group_id, task_id=group_id, step=step, executions=execs)


class CalibratedSource:
    """Hands out calibrated groups in order (the WorkloadSource interface: `.config`, `next_group()`)."""

    def __init__(self, cw: CalibratedWorkload, seed: int, first_step: int = 0) -> None:
        self.workload = cw
        self.config = cw.base
        self.seed = seed
        self.first_step = first_step  # drift continues from here (e.g. the steps after a calibration window)
        self.issued = 0

    def next_group(self) -> GroupSpec:
        g = self.issued
        self.issued += 1
        return sample_calibrated_group(self.workload, g, self.first_step + g // self.config.groups_per_step, self.seed)


def sample_quantities(cw: CalibratedWorkload, steps: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """The per-quantity draws of many groups at once (for fit reports): the same model as
    sample_calibrated_group, vectorized, without building specs. steps: one entry per group."""
    rng = np.random.default_rng([seed, 0x5A11])
    k = cw.base.group_size
    scale = np.exp(cw.difficulty_sigma * rng.standard_normal(len(steps))) * drift_factor(cw, steps)
    raw = cw.dists["length"].sample(rng, len(steps) * k)
    length = np.maximum(1, np.round(scaled_length(cw, raw, np.repeat(scale, k))))
    if cw.scale_target == "turns":
        turns = length
    else:
        turns = np.maximum(1, np.round(_draw(cw, "turns", rng, len(length), 1)))
    total = int(turns.sum())
    gen = np.maximum(1, np.round(_draw(cw, "gen", rng, total, 1)))
    if cw.scale_target == "gen":
        gen[(np.cumsum(turns) - turns).astype(np.int64)] = length
    calls = total - len(turns)
    return {
        "length": length, "turns": turns, "gen": gen,
        "tool_out": np.maximum(0, np.round(_draw(cw, "tool_out", rng, calls, 0))),
        "tool_s": np.maximum(0.0, _draw(cw, "tool_s", rng, calls, 0.0)),
        "prompt": np.maximum(0, _draw(cw, "prompt", rng, len(length) if cw.prompt_per_execution else len(steps), 0)),
    }
