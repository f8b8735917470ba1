"""The rollout trace: one JSON line per execution, what the simulator and the real executor both write.

File layout (JSONL, UTF-8):

- line 1, the header: {"gyre_trace": 1, "workload": {...WorkloadConfig...}, "run": {...}} where
  `workload` is what replay needs to rebuild the source (groups_per_step, context window, ...) and
  `run` is free-form provenance (preset, policy, seed, steps, makespan_s);
- then one record per execution, groups contiguous and in the order they were issued:
  {"exec", "group", "task", "step", "version", "prompt", "deadline_s", "capped",
   "segments": [{"gen", "kv", "tool_s", "tool_out"}, ...], "branches": [{"seg", "kind"}, ...],
   "deadline_hit", "reward", "start_s", "end_s"}.
  The last segment has no tool call: its tool_s/tool_out are omitted. `kv` is the KV footprint
  (resident context tokens) at the segment's start, after any branch at that segment.

Records convert to gyre.workload.ExecutionSpec and back exactly: floats go through JSON's repr
round trip, an infinite deadline is written as null. `version` (policy version of the execution's
first token), `deadline_hit`, `reward` and the times are outcomes: null when unknown (a foreign
trace, or a simulator that models no reward).

Simplifications: the file is read whole into memory (1M single-segment executions take ~1 GB of
Python objects); validation is per line and stops at the first bad line unless skip_bad is set.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.gc_pause import no_gc
from gyre.jsonl import json_error
from gyre.workload import ExecutionSpec, GroupSpec, LogNormal, WorkloadConfig

SCHEMA_VERSION = 1
BRANCH_KINDS = ("compact", "subagent", "retry")


class TraceError(ValueError):
    """A malformed trace; the message is one line, `file:line: reason`."""


@dataclass(kw_only=True)
class Outcome:
    """What happened to an execution in the run that produced the trace (all optional)."""

    version: int | None = None
    deadline_hit: bool | None = None
    reward: float | None = None
    start_s: float | None = None
    end_s: float | None = None


@dataclass(kw_only=True)
class Trace:
    """A trace in memory: groups in issue order, per-execution outcomes and (foreign) timestamps."""

    path: str
    groups: list[GroupSpec]
    workload: WorkloadConfig | None = None
    run: dict[str, Any] = field(default_factory=dict)
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    times: dict[int, float] = field(default_factory=dict)  # exec id -> arrival time (s), foreign traces
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line, reason) under skip_bad
    task_groups: bool = False  # a foreign trace whose groups are tasks (repeated runs), not arrival windows
    task_names: list[str] = field(default_factory=list)  # the task of each group, when read from the trace
    notes: list[str] = field(default_factory=list)  # what the reader estimated or could not read (printed)

    @property
    def n_executions(self) -> int:
        return sum(len(g.executions) for g in self.groups)

    def skip_summary(self) -> str:
        if not self.skipped:
            return f"{self.path}: no lines skipped"
        why = Counter(reason.split(":")[0] for _, reason in self.skipped)
        parts = ", ".join(f"{n} x {r}" for r, n in why.most_common())
        return f"{self.path}: skipped {len(self.skipped)} bad lines ({parts}); first at line {self.skipped[0][0]}"


class BadLines:
    """Collects bad lines: raises at the first one, or records it when skip_bad is set."""

    def __init__(self, path: str | Path, skip_bad: bool) -> None:
        self.path = str(path)
        self.skip_bad = skip_bad
        self.skipped: list[tuple[int, str]] = []

    def bad(self, line: int, reason: str) -> None:
        if not self.skip_bad:
            raise TraceError(f"{self.path}:{line}: {reason}")
        self.skipped.append((line, reason))


# ---------------------------------------------------------------- workload config <-> JSON
def workload_to_dict(w: WorkloadConfig) -> dict[str, Any]:
    d = dataclasses.asdict(w)
    if math.isinf(w.deadline_s):
        d["deadline_s"] = None
    return d


def workload_from_dict(d: dict[str, Any], where: str = "workload") -> WorkloadConfig:
    """Build a WorkloadConfig from JSON; a bad field is one line naming it."""
    names = {f.name: f for f in dataclasses.fields(WorkloadConfig)}
    kw: dict[str, Any] = {}
    for k, v in d.items():
        if k not in names:
            raise TraceError(f"{where}: unknown workload field {k!r}")
        if isinstance(v, dict):
            try:
                v = LogNormal(**v)
            except TypeError as exc:
                raise TraceError(f"{where}: workload.{k}: {exc}") from None
        kw[k] = v
    if kw.get("deadline_s", 0) is None:
        kw["deadline_s"] = math.inf
    try:
        return WorkloadConfig(**kw)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: {exc}") from None


# ---------------------------------------------------------------- records <-> specs
def spec_to_record(s: ExecutionSpec, out: Outcome | None = None) -> dict[str, Any]:
    n = len(s.gen)
    segs: list[dict[str, Any]] = []
    for i in range(n):
        seg: dict[str, Any] = {"gen": s.gen[i], "kv": s.kv[i]}
        if i < n - 1:
            seg["tool_s"] = s.tool_s[i]
            seg["tool_out"] = s.tool_out[i]
        segs.append(seg)
    o = out or Outcome()
    return {
        "exec": s.exec_id, "group": s.group_id, "task": s.task_id, "step": s.step, "version": o.version,
        "prompt": s.prompt, "deadline_s": None if math.isinf(s.deadline_s) else s.deadline_s,
        "capped": s.capped, "segments": segs, "branches": [{"seg": i, "kind": k} for i, k in s.branches],
        "deadline_hit": o.deadline_hit, "reward": o.reward, "start_s": o.start_s, "end_s": o.end_s,
    }


def _int(r: dict, key: str, lo: int = 0) -> int:
    v = r[key]
    if type(v) is not int or v < lo:
        raise ValueError(f"field {key!r} must be an integer >= {lo}, got {v!r}")
    return v


def _num(v: Any, key: str) -> float:
    if type(v) not in (int, float) or not v >= 0:
        raise ValueError(f"field {key!r} must be a number >= 0, got {v!r}")
    return v


def record_to_spec(r: dict[str, Any]) -> tuple[ExecutionSpec, Outcome]:
    """Validate one parsed record; raise ValueError('reason') on the first problem."""
    try:
        segs = r["segments"]
        if not isinstance(segs, list) or not segs:
            raise ValueError("field 'segments' must be a non-empty list")
        n = len(segs)
        gen, kv, tool_s, tool_out = [0] * n, [0] * n, [0.0] * (n - 1), [0] * (n - 1)
        for i, seg in enumerate(segs):
            try:
                if not isinstance(seg, dict):
                    raise ValueError("not an object")
                gen[i] = _int(seg, "gen", 1)
                kv[i] = _int(seg, "kv", 0)
                if i < n - 1:
                    tool_s[i] = _num(seg["tool_s"], "tool_s")
                    tool_out[i] = _int(seg, "tool_out", 0)
            except KeyError as exc:
                raise ValueError(f"segments[{i}]: missing field {exc.args[0]!r}") from None
            except ValueError as exc:
                raise ValueError(f"segments[{i}]: {exc}") from None
        branches = []
        for b in r.get("branches") or []:
            if b["kind"] not in BRANCH_KINDS or type(b["seg"]) is not int or not 0 <= b["seg"] < n:
                raise ValueError(f"bad branch {b!r} (kinds: {', '.join(BRANCH_KINDS)}; seg within segments)")
            branches.append((b["seg"], b["kind"]))
        dl = r.get("deadline_s")
        spec = ExecutionSpec(
            exec_id=_int(r, "exec"), group_id=_int(r, "group"), task_id=_int(r, "task"), step=_int(r, "step"),
            prompt=_int(r, "prompt", 0), gen=gen, tool_s=tool_s, tool_out=tool_out, kv=kv, branches=branches,
            capped=bool(r.get("capped", False)), deadline_s=math.inf if dl is None else _num(dl, "deadline_s"),
        )
    except KeyError as exc:
        raise ValueError(f"missing field {exc.args[0]!r}") from None
    except TypeError as exc:
        raise ValueError(f"wrong type: {exc}") from None
    out = Outcome(
        version=r.get("version"), deadline_hit=r.get("deadline_hit"), reward=r.get("reward"),
        start_s=r.get("start_s"), end_s=r.get("end_s"),
    )
    return spec, out


# ---------------------------------------------------------------- files
def write_trace(
    path: str | Path,
    groups: Iterable[GroupSpec],
    *,
    workload: WorkloadConfig,
    run: dict[str, Any] | None = None,
    outcomes: dict[int, Outcome] | None = None,
) -> int:
    """Write header + one line per execution; return the number of executions written."""
    outcomes = outcomes or {}
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        head = {"gyre_trace": SCHEMA_VERSION, "workload": workload_to_dict(workload), "run": run or {}}
        f.write(json.dumps(head, allow_nan=False) + "\n")
        for g in groups:
            for s in g.executions:
                f.write(json.dumps(spec_to_record(s, outcomes.get(s.exec_id)), allow_nan=False) + "\n")
                n += 1
    return n


def read_trace(path: str | Path, *, skip_bad: bool = False) -> Trace:
    """Read a rollout trace; groups must be contiguous and agree on task and step."""
    bad = BadLines(path, skip_bad)
    groups: list[GroupSpec] = []
    outcomes: dict[int, Outcome] = {}
    seen_groups: set[int] = set()
    seen_execs: set[int] = set()
    workload, run = None, {}
    cur: GroupSpec | None = None
    with open(path, encoding="utf-8") as f, no_gc():
        for lineno, line in enumerate(f, 1):
            if lineno == 1:
                try:
                    head = json.loads(line)
                    if not isinstance(head, dict) or head.get("gyre_trace") != SCHEMA_VERSION:
                        raise ValueError
                except ValueError:
                    raise TraceError(f"{path}:1: not a gyre rollout trace (header must be "
                                     f'{{"gyre_trace": {SCHEMA_VERSION}, "workload": ...}})') from None
                workload = workload_from_dict(head.get("workload") or {}, f"{path}:1") if head.get("workload") else None
                run = head.get("run") or {}
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("a record must be a JSON object")
                spec, out = record_to_spec(rec)
            except json.JSONDecodeError as exc:
                bad.bad(lineno, json_error(exc))
                continue
            except ValueError as exc:
                bad.bad(lineno, str(exc))
                continue
            if spec.exec_id in seen_execs:
                bad.bad(lineno, f"duplicate exec id {spec.exec_id}")
                continue
            if cur is None or spec.group_id != cur.group_id:
                if spec.group_id in seen_groups:
                    bad.bad(lineno, f"group {spec.group_id} is not contiguous (records of a group must be adjacent)")
                    continue
                cur = GroupSpec(group_id=spec.group_id, task_id=spec.task_id, step=spec.step, executions=[])
                groups.append(cur)
                seen_groups.add(cur.group_id)
            elif (spec.task_id, spec.step) != (cur.task_id, cur.step):
                bad.bad(lineno, f"group {cur.group_id} mixes task/step ({spec.task_id},{spec.step}) "
                                f"with ({cur.task_id},{cur.step})")
                continue
            seen_execs.add(spec.exec_id)
            cur.executions.append(spec)
            outcomes[spec.exec_id] = out
    if workload is None and not groups:
        raise TraceError(f"{path}:1: empty trace")
    return Trace(path=str(path), groups=groups, workload=workload, run=run, outcomes=outcomes, skipped=bad.skipped)
