"""Readers for agent trajectories: one JSON document per run (not JSON Lines), a file or a folder of them.

Every run becomes one execution: model call i is segment i (gen = its output tokens, kv = its input
tokens, the context the engine held), tool_s = the tool time after it, tool_out = the context growth to
the next call (input[i+1] - input[i] - output[i], floored at 0). A context that shrinks is a `compact`
branch; a call whose result came from a sub-agent is a `subagent` branch. Runs of the same task (the
instance id) form one GRPO group, so repeated runs of a task fit the per-task difficulty; groups are in
the order of their first run's start, step = group index // groups_per_step.

Formats, each from its public documentation (the version followed is named):

- mini-swe-agent (`*.traj.json`, `trajectory_format` "mini-swe-agent-1.1", mini-swe-agent v2.x,
  docs/usage/output_files.md): `messages` in OpenAI chat form; an assistant message's
  `extra.response.usage.{prompt_tokens, completion_tokens}` and `extra.timestamp` (epoch s, when the
  response arrived); the tool/user messages that follow carry `extra.timestamp` (when the command
  ended): tool_s = the last of them minus the call's. Task: `instance_id`, else the file name.
  "mini-swe-agent-1" files (v1.x) read the same; their observations may lack timestamps (tool_s 0, noted).
- SWE-agent (`*.traj`, SWE-agent 1.x): `trajectory` steps with `response`, `query` (the messages sent)
  and `execution_time` (s, the tool time); `info.model_stats.{tokens_sent, tokens_received}` are run
  totals only: per-call tokens are those totals split by each call's share of the characters (of its
  query for input, of its response for output). The trace notes that they are estimates.
- OpenHands event log (a JSON list of events, or an object with `history`: OpenHands 0.x event stream,
  `openhands/events/serialization`): events with `id`, `timestamp` (ISO 8601), `source`, `action` or
  `observation`, `cause` (the action an observation answers) and, on agent actions,
  `tool_call_metadata.model_response` (an OpenAI response: `id`, `usage`). One model call per response
  id; tool_s = the last answering observation's timestamp minus the response's first action's. An agent `condensation` action
  is a compact branch at the next call, a `delegate` action a subagent branch. Task: `instance_id`, else
  the file name.
- ATIF (Agent Trajectory Interchange Format, harbor RFC 0001, v1.0-1.5): `schema_version` "ATIF-v1.x",
  `steps` with `source`, `timestamp` (ISO 8601) and on agent steps `metrics.{prompt_tokens,
  completion_tokens}`; an observation result with `subagent_trajectory_ref` is a subagent branch. ATIF
  records one timestamp per step (inference, tool run and observation together), so tool time cannot be
  separated: tool_s = 0, and the trace notes it. Task: `extra.task_id` / `extra.instance_id`, else the
  file name (its folder when the file is `trajectory.json`).

Simplifications: a call with 0 output tokens is counted as 1 (a segment generates at least one); the
tool-output tokens are inferred from context growth; no deadline; capped when output reaches `cap`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gyre.traces.schema import Trace, TraceError
from gyre.workload import ExecutionSpec, GroupSpec

AGENT_FORMATS = ("mini-swe-agent", "swe-agent", "openhands", "atif")
SUFFIXES = (".traj.json", ".traj", ".json")


class LogError(ValueError):
    """A problem inside one document; str() names the field path (the reader adds the file)."""


@dataclass(kw_only=True)
class Call:
    inp: int
    out: int
    t: float | None = None  # when the response arrived (s), when the format records it
    tool_s: float | None = 0.0  # tool time after it; None: not recorded
    branch: str | None = None  # "compact" or "subagent" at this call


@dataclass(kw_only=True)
class Run:
    task: str
    calls: list[Call]
    start: float | None = None
    notes: list[str] = field(default_factory=list)


def detect(doc: Any) -> str | None:
    """Which agent format a parsed JSON document is in (None: none of them)."""
    if isinstance(doc, dict):
        if str(doc.get("schema_version", "")).startswith("ATIF") and isinstance(doc.get("steps"), list):
            return "atif"
        if isinstance(doc.get("trajectory"), list) and ("history" in doc or "info" in doc):
            return "swe-agent"
        if isinstance(doc.get("messages"), list) and ("trajectory_format" in doc or _has_roles(doc["messages"])):
            return "mini-swe-agent"
        if isinstance(doc.get("history"), list) and _is_events(doc["history"]):
            return "openhands"
    if isinstance(doc, list) and _is_events(doc):
        return "openhands"
    return None


def _has_roles(msgs: list) -> bool:
    return bool(msgs) and all(isinstance(m, dict) and "role" in m for m in msgs[:3])


def _is_events(evs: list) -> bool:
    return bool(evs) and all(isinstance(e, dict) and "source" in e and ("action" in e or "observation" in e)
                             for e in evs[:3])


def _tok(v: Any, where: str) -> int:
    """A token count: an integer >= 0 (not a string, not a float)."""
    if type(v) is not int or v < 0:
        raise LogError(f"{where} must be an integer >= 0, got {v!r}")
    return v


def _get(d: Any, path: str, where: str) -> Any:
    cur = d
    for k in path.split("."):
        if not isinstance(cur, dict) or k not in cur:
            have = ", ".join(map(str, cur)) if isinstance(cur, dict) else type(cur).__name__
            raise LogError(f"{where}: missing field {path!r} (at {k!r}: has {have or 'nothing'})")
        cur = cur[k]
    return cur


def _iso(v: Any, where: str) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    t = pd.to_datetime(v, errors="coerce", utc=True)
    if pd.isna(t):
        raise LogError(f"{where}: bad timestamp {v!r} (ISO 8601 or epoch seconds)")
    return t.value / 1e9


def _task_from_path(path: Path) -> str:
    name = path.name
    for s in SUFFIXES:
        if name.endswith(s):
            return path.parent.name if name == "trajectory.json" else name[: -len(s)]
    return path.stem


# ---------------------------------------------------------------- per format
def mini_swe_agent(doc: dict, path: Path) -> Run:
    msgs = doc["messages"]
    calls: list[Call] = []
    untimed = 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise LogError(f"messages[{i}] is not an object")
        role = m.get("role")
        if role == "assistant":
            w = f"messages[{i}]"
            u = _get(m, "extra.response.usage", w)
            ts = (m.get("extra") or {}).get("timestamp")
            calls.append(Call(inp=_tok(u.get("prompt_tokens"), f"{w}.extra.response.usage.prompt_tokens"),
                              out=_tok(u.get("completion_tokens"), f"{w}.extra.response.usage.completion_tokens"),
                              t=None if ts is None else _iso(ts, f"{w}.extra.timestamp"), tool_s=None))
        elif role in ("tool", "user") and calls:
            ts = (m.get("extra") or {}).get("timestamp")
            c = calls[-1]
            if ts is None or c.t is None:
                untimed += 1
                continue
            end = _iso(ts, f"messages[{i}].extra.timestamp")
            c.tool_s = max(c.tool_s or 0.0, end - c.t)
    if not calls:
        raise LogError("no assistant message (no model call)")
    notes = [f"{untimed} tool results without a timestamp (tool time 0)"] if untimed else []
    for c in calls:
        c.tool_s = c.tool_s or 0.0
    task = doc.get("instance_id") or _task_from_path(path)
    return Run(task=str(task), calls=calls, start=calls[0].t, notes=notes)


def swe_agent(doc: dict, path: Path) -> Run:
    steps = doc["trajectory"]
    if not steps:
        raise LogError("'trajectory' is empty (no model call)")
    stats = _get(doc, "info.model_stats", "info")
    sent = _tok(_get(stats, "tokens_sent", "info.model_stats"), "info.model_stats.tokens_sent")
    recv = _tok(_get(stats, "tokens_received", "info.model_stats"), "info.model_stats.tokens_received")
    q_chars, r_chars, tool = [], [], []
    for i, s in enumerate(steps):
        w = f"trajectory[{i}]"
        if not isinstance(s, dict):
            raise LogError(f"{w} is not an object")
        q = s.get("query") or []
        q_chars.append(sum(len(str(m.get("content", ""))) if isinstance(m, dict) else len(str(m)) for m in q))
        r_chars.append(len(str(_get(s, "response", w))))
        t = s.get("execution_time", 0.0)
        if type(t) not in (int, float) or not t >= 0:
            raise LogError(f"{w}.execution_time must be a number >= 0, got {t!r}")
        tool.append(float(t))
    qa, ra = np.array(q_chars, float), np.array(r_chars, float)
    inp = np.round(sent * qa / qa.sum()).astype(int) if qa.sum() > 0 else np.full(len(qa), sent // len(qa))
    out = np.round(recv * ra / ra.sum()).astype(int) if ra.sum() > 0 else np.full(len(ra), recv // len(ra))
    calls = [Call(inp=int(a), out=int(b), tool_s=t) for a, b, t in zip(inp, out, tool)]
    return Run(task=_task_from_path(path), calls=calls,
               notes=["SWE-agent records tokens as run totals: per-call tokens are estimated from character shares"])


def openhands(doc: Any, path: Path) -> Run:
    events = doc["history"] if isinstance(doc, dict) else doc
    at: dict[int, float] = {}
    calls: list[Call] = []
    by_response: dict[str, Call] = {}
    action_call: dict[int, Call] = {}
    pending: str | None = None
    for i, e in enumerate(events):
        w = f"event {i}"
        if not isinstance(e, dict):
            raise LogError(f"{w} is not an object")
        t = _iso(e["timestamp"], f"{w}.timestamp") if "timestamp" in e else None
        if "id" in e and t is not None:
            at[e["id"]] = t
        if e.get("source") == "agent" and e.get("action") in ("condensation", "delegate"):
            pending = "compact" if e["action"] == "condensation" else "subagent"
        resp = (e.get("tool_call_metadata") or {}).get("model_response")
        if e.get("source") == "agent" and "action" in e and isinstance(resp, dict):
            rid = str(resp.get("id", f"event{i}"))
            c = by_response.get(rid)
            if c is None:
                u = _get(resp, "usage", f"{w}.tool_call_metadata.model_response")
                c = Call(inp=_tok(u.get("prompt_tokens"), f"{w}.tool_call_metadata.model_response.usage.prompt_tokens"),
                         out=_tok(u.get("completion_tokens"),
                                  f"{w}.tool_call_metadata.model_response.usage.completion_tokens"),
                         t=t, tool_s=0.0, branch=pending)
                pending = None
                by_response[rid] = c
                calls.append(c)
            if "id" in e:
                action_call[e["id"]] = c
        if "observation" in e and e.get("cause") in action_call and t is not None:
            c = action_call[e["cause"]]
            start = c.t if c.t is not None else at.get(e["cause"])  # from the response: its actions run in turn
            if start is not None:
                c.tool_s = max(c.tool_s or 0.0, t - start)
    if not calls:
        raise LogError("no agent action with tool_call_metadata.model_response (no model call with token usage)")
    task = (doc.get("instance_id") if isinstance(doc, dict) else None) or _task_from_path(path)
    return Run(task=str(task), calls=calls, start=calls[0].t)


def atif(doc: dict, path: Path) -> Run:
    calls: list[Call] = []
    for i, s in enumerate(doc["steps"]):
        w = f"steps[{i}]"
        if not isinstance(s, dict):
            raise LogError(f"{w} is not an object")
        if s.get("source") != "agent":
            continue
        m = _get(s, "metrics", w)
        t = _iso(s["timestamp"], f"{w}.timestamp") if s.get("timestamp") is not None else None
        res = ((s.get("observation") or {}).get("results") or [])
        sub = any(isinstance(r, dict) and r.get("subagent_trajectory_ref") for r in res)
        calls.append(Call(inp=_tok(m.get("prompt_tokens"), f"{w}.metrics.prompt_tokens"),
                          out=_tok(m.get("completion_tokens"), f"{w}.metrics.completion_tokens"), t=t, tool_s=0.0,
                          branch="subagent" if sub else None))
    if not calls:
        raise LogError("no step with source 'agent' (no model call)")
    extra = doc.get("extra") or {}
    task = extra.get("task_id") or extra.get("instance_id") or _task_from_path(path)
    return Run(task=str(task), calls=calls, start=calls[0].t,
               notes=["ATIF records one timestamp per step: tool time is not separable (tool_s 0)"])


PARSERS = {"mini-swe-agent": mini_swe_agent, "swe-agent": swe_agent, "openhands": openhands, "atif": atif}


# ---------------------------------------------------------------- runs -> trace
def run_spec(run: Run, cap: float = math.inf) -> ExecutionSpec:
    """One execution from a run's calls (see the module doc)."""
    inp = [c.inp for c in run.calls]
    out = [max(c.out, 1) for c in run.calls]
    n = len(inp)
    tool_out, branches = [], []
    for i, c in enumerate(run.calls):
        if c.branch is not None and i > 0:
            branches.append((i, c.branch))
        elif i > 0 and inp[i] < inp[i - 1]:
            branches.append((i, "compact"))
    for i in range(n - 1):
        shrink = inp[i + 1] < inp[i]
        tool_out.append(0 if shrink else max(inp[i + 1] - inp[i] - out[i], 0))
    tool_s = [float(c.tool_s or 0.0) for c in run.calls[: n - 1]]
    return ExecutionSpec(exec_id=0, group_id=0, task_id=0, step=0, prompt=inp[0], gen=out, tool_s=tool_s,
                         tool_out=tool_out, kv=inp, branches=branches, capped=sum(out) >= cap, deadline_s=math.inf)


def agent_files(path: Path) -> list[Path]:
    """The trajectory files of a folder (recursively: *.traj.json, *.traj, *.json), sorted; a file is itself."""
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
        raise TraceError(f"{path}: a folder with no agent trajectory files (*.traj.json, *.traj, *.json)")
    return files


def read_document(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: invalid JSON document: {exc.msg} at column {exc.colno}") from None


def read_agent_logs(path: str | Path, fmt: str = "agent", *, group_size: int = 8, groups_per_step: int = 64,
                    cap: float | None = None, skip_bad: bool = False) -> Trace:
    """Agent trajectories (a file or a folder) as a Trace: one execution per run, one group per task."""
    del group_size  # a group is a task's runs, however many
    path = Path(path)
    runs: list[tuple[Run, str]] = []
    skipped: list[tuple[int, str]] = []
    notes: dict[str, int] = {}
    for f in agent_files(path):
        kind = fmt
        try:
            doc = read_document(f)
            kind = detect(doc) if fmt == "agent" else fmt
            if kind is None:
                have = ", ".join(map(str, doc)) if isinstance(doc, dict) else f"a {type(doc).__name__}"
                raise LogError(f"not an agent trajectory (a JSON document with {have}; known: "
                               f"{', '.join(AGENT_FORMATS)})")
            try:
                run = PARSERS[kind](doc, f)
            except (KeyError, TypeError, AttributeError) as exc:
                raise LogError(f"not a {kind} document ({type(exc).__name__}: {exc})") from None
        except LogError as exc:
            msg = f"{f}: {exc}" + (f" (a {kind} document)" if fmt == "agent" and kind else "")
            if not skip_bad:
                raise TraceError(msg) from None
            skipped.append((0, msg))
            continue
        except TraceError as exc:
            if not skip_bad:
                raise
            skipped.append((0, str(exc)))
            continue
        for n in run.notes:
            notes[n] = notes.get(n, 0) + 1
        runs.append((run, str(f)))
    if not runs:
        raise TraceError(f"{path}: no agent run could be read")
    # tasks in the order of their first run (by start time where recorded, else file order)
    order = sorted(range(len(runs)), key=lambda i: (runs[i][0].start is None, runs[i][0].start or 0.0, i))
    tasks: dict[str, list[int]] = {}
    for i in order:
        tasks.setdefault(runs[i][0].task, []).append(i)
    groups, times = [], {}
    cap_v = math.inf if cap is None else cap
    eid = 0
    t0 = min((r.start for r, _ in runs if r.start is not None), default=None)
    for gid, (task, idx) in enumerate(tasks.items()):
        execs = []
        for i in idx:
            s = run_spec(runs[i][0], cap_v)
            s.exec_id, s.group_id, s.task_id, s.step = eid, gid, gid, gid // groups_per_step
            st = runs[i][0].start
            times[eid] = float(eid) if st is None or t0 is None else st - t0
            execs.append(s)
            eid += 1
        groups.append(GroupSpec(group_id=gid, task_id=gid, step=gid // groups_per_step, executions=execs))
    tr = Trace(path=str(path), groups=groups, times=times, skipped=skipped, task_groups=True,
               task_names=list(tasks), notes=[f"{k} ({v} runs)" for k, v in notes.items()])
    return tr
