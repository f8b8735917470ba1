"""Readers for traces people already have, turned into gyre groups (GroupSpec lists).

- agentic session JSONL: one session per line, a list of sub-requests each with input tokens,
  output tokens and the tool time that followed it. A session is one execution; sub-request i is
  segment i: gen = output, kv = input (the context the engine held), tool_s = tool time after it,
  tool_out = the context growth to the next sub-request (input[i+1] - input[i] - output[i]). A
  context that shrinks is a compaction: a "compact" branch, and no tool-output tokens counted.
- request CSV (e.g. Azure LLM inference traces) and request JSONL: one request is a one-segment
  execution with prompt = kv = context tokens and gen = generated tokens.

Requests and sessions carry no task or GRPO group: groups are consecutive windows of `group_size`
executions in time order (a last, shorter window is kept), and step = group index // groups_per_step.
Field and column names are configurable. Timestamps are numbers (in `time_unit`, seconds by
default) or date-times; a session's tool durations are numbers in `tool_unit` (ns by default).
A record without a needed field is reported with the fields it does have.

Simplifications: a session's tool-output tokens are inferred from context growth; no deadline;
an execution is capped when its generated tokens reach `cap` (when given).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from gyre.gc_pause import no_gc
from gyre.jsonl import json_objects
from gyre.traces.schema import BadLines, Trace, TraceError
from gyre.workload import ExecutionSpec, GroupSpec


TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def unit_seconds(unit: str) -> float:
    if unit not in TIME_UNITS:
        raise TraceError(f"unknown time unit {unit!r}; known: {', '.join(TIME_UNITS)}")
    return TIME_UNITS[unit]


@dataclass(frozen=True, kw_only=True)
class RequestFields:
    """Names of a request trace's columns (CSV) or fields (JSONL); time may be absent ("")."""

    time: str = "TIMESTAMP"
    input: str = "ContextTokens"
    output: str = "GeneratedTokens"
    time_unit: str = "s"  # of numeric timestamps

    def __post_init__(self) -> None:
        unit_seconds(self.time_unit)


AZURE_FIELDS = RequestFields()
JSONL_FIELDS = RequestFields(time="timestamp", input="input_length", output="output_length")


@dataclass(frozen=True, kw_only=True)
class SessionFields:
    requests: str = "requests"
    input: str = "input_toks"
    output: str = "output_toks"
    tool_ns: str = "tool_duration_ns"  # tool time after a sub-request (optional), in tool_unit
    time: str = "timestamp"  # session start (optional), in time_unit when a number
    time_unit: str = "s"
    tool_unit: str = "ns"
    task: str = "task_id"  # the session's task (optional): sessions of one task form one group

    def __post_init__(self) -> None:
        unit_seconds(self.time_unit), unit_seconds(self.tool_unit)


@dataclass(frozen=True, kw_only=True)
class Grouping:
    group_size: int = 8
    groups_per_step: int = 64
    cap: int | None = None  # generation length cap: executions reaching it are marked capped

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.groups_per_step < 1:
            raise TraceError(f"group_size and groups_per_step must be >= 1, got {self.group_size}, "
                             f"{self.groups_per_step}")


def _to_seconds(raw: list, lines: list[int], bad: BadLines, unit: str = "s") -> np.ndarray:
    """Timestamps (numbers in `unit`, or date-time strings) to seconds; NaN where bad (reported)."""
    scale = unit_seconds(unit)
    if isinstance(raw, np.ndarray) and raw.dtype.kind in "iuf":  # already parsed (the CSV fast path)
        return raw.astype(float) * scale
    s = pd.Series(raw, dtype=object)
    num = pd.to_numeric(s, errors="coerce")
    if num.notna().all():
        return num.to_numpy(dtype=float) * scale
    dt = pd.to_datetime(s.astype(str), errors="coerce", format="ISO8601")
    if dt.notna().sum() < num.notna().sum():  # mostly numbers: the strings are the bad ones
        out = num.to_numpy(dtype=float) * scale
    else:
        out = (dt - dt.min()).dt.total_seconds().to_numpy(dtype=float)
    for i in np.flatnonzero(np.isnan(out)):
        bad.bad(lines[i], f"bad timestamp {raw[i]!r}")
    return out


def _group(specs: list[ExecutionSpec], times: np.ndarray, g: Grouping, path: str, bad: BadLines) -> Trace:
    """Sort executions by time (stable), cut into groups, renumber ids; keep the arrival times."""
    order = np.argsort(times, kind="stable").tolist()
    specs = [specs[i] for i in order]
    for k, s in enumerate(specs):
        gid = k // g.group_size
        s.exec_id, s.group_id, s.task_id, s.step = k, gid, gid, gid // g.groups_per_step
    return _cut(specs, np.asarray(times)[order], g, path, bad)


def _cut(specs: list[ExecutionSpec], times: np.ndarray, g: Grouping, path: str, bad: BadLines) -> Trace:
    """Groups of consecutive, already numbered executions (ids 0..n-1 in time order)."""
    if not specs:
        raise TraceError(f"{path}: no executions (every line was bad or the file is empty)")
    k = g.group_size
    groups = [GroupSpec(group_id=gid, task_id=gid, step=gid // g.groups_per_step, executions=specs[i : i + k])
              for gid, i in enumerate(range(0, len(specs), k))]
    return Trace(path=path, groups=groups, times=dict(enumerate(np.asarray(times, dtype=float).tolist())),
                 skipped=bad.skipped)


def _request_specs(inp: np.ndarray, outp: np.ndarray, g: Grouping) -> list[ExecutionSpec]:
    """One-segment executions, numbered 0..n-1 in the given order and grouped by g."""
    cap = g.cap if g.cap is not None else math.inf
    k, per_step, inf = g.group_size, g.groups_per_step, math.inf
    return [
        ExecutionSpec(exec_id=i, group_id=i // k, task_id=i // k, step=i // k // per_step, prompt=a, gen=[b],
                      tool_s=[], tool_out=[], kv=[a], branches=[], capped=b >= cap, deadline_s=inf)
        for i, (a, b) in enumerate(zip(inp.tolist(), outp.tolist()))
    ]


def _is_count(v) -> bool:
    """A token count as written: a JSON integer, or a CSV field of digits (not "7" in JSON, not 12.0)."""
    if type(v) is int:
        return True
    return isinstance(v, str) and v.strip().lstrip("+-").isdigit()


def _check_tokens(name: str, lo: int, lines: list[int], raw, bad: BadLines, csv_text: bool = False) -> np.ndarray:
    """Token counts: integers >= lo; a string in JSON, a float or a decimal point is a bad value, reported with
    the value as written (a plain Python repr, never numpy's)."""
    if isinstance(raw, np.ndarray) and raw.dtype.kind in "iu":  # already parsed (the CSV fast path)
        num = raw.astype(float)
        typed = np.ones(len(num), bool)
    else:
        num = pd.to_numeric(pd.Series(raw, dtype=object), errors="coerce").to_numpy(dtype=float, copy=True)
        typed = np.fromiter((_is_count(v) if csv_text else type(v) is int for v in raw), bool, len(raw))
    ok = typed & np.isfinite(num) & (num >= lo) & (num == np.floor(num))
    for i in np.flatnonzero(~ok):
        v = raw[i].item() if isinstance(raw[i], np.generic) else raw[i]
        kind = "" if typed[i] else (" is a string; write it as a JSON number" if isinstance(v, str) else
                                    f" is a {type(v).__name__}")
        bad.bad(lines[i], f"bad {name} {v!r}{kind} (an integer >= {lo})")
    num[~ok] = np.nan
    return num


def _finish_requests(path: str, lines: list[int], t_raw: list | None, in_raw: list, out_raw: list,
                     f: RequestFields, g: Grouping, bad: BadLines, csv_text: bool = False) -> Trace:
    n = len(lines)
    inp = _check_tokens(f.input, 0, lines, in_raw, bad, csv_text)
    outp = _check_tokens(f.output, 1, lines, out_raw, bad, csv_text)
    t = _to_seconds(t_raw, lines, bad, f.time_unit) if t_raw is not None else np.arange(n, dtype=float)
    keep = np.isfinite(inp) & np.isfinite(outp) & np.isfinite(t)
    bad.skipped = sorted(dict(reversed(bad.skipped)).items())  # one entry per line (its first reason)
    t = t[keep]
    order = np.argsort(t, kind="stable")  # time order (stable: ties keep file order)
    with no_gc():
        specs = _request_specs(inp[keep].astype(np.int64)[order], outp[keep].astype(np.int64)[order], g)
        return _cut(specs, t[order], g, path, bad)


def _clean_csv(path: str | Path, f: RequestFields):
    """The C parser's reading of a well-formed request CSV: (lines, times, inputs, outputs), or None.

    Only a file where every line after the header is one row, with integer token columns and no
    missing value, takes this path; anything else (blank lines, quoted newlines, bad or missing
    values, wrong field counts) returns None and is read line by line, so every bad line is still
    reported as `file:line: reason`."""
    need = [c for c in (f.time, f.input, f.output) if c]
    try:
        raw = Path(path).read_bytes()
        df = pd.read_csv(io.BytesIO(raw), skip_blank_lines=False, encoding="utf-8", low_memory=False)
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError, OSError):
        return None  # e.g. a row with more fields than the header
    df.columns = [str(c).strip() for c in df.columns]
    n_lines = raw.count(b"\n") + (0 if raw.endswith(b"\n") else 1)
    if (any(c not in df.columns for c in need) or len(set(df.columns)) != df.shape[1]
            or not isinstance(df.index, pd.RangeIndex) or len(df) != n_lines - 1):
        return None  # a column missing or twice, rows longer than the header, blank lines or quoted newlines
    df = df[need]
    if df.isna().any().any() or not all(df[c].dtype.kind in "iu" for c in (f.input, f.output)):
        return None
    lines = range(2, len(df) + 2)
    t = df[f.time].to_numpy() if f.time else None
    if t is not None and t.dtype.kind not in "iuf":
        t = t.tolist()  # date-time strings: parsed (and checked) by _to_seconds
    return lines, t, df[f.input].to_numpy(), df[f.output].to_numpy()


def read_request_csv(path: str | Path, *, fields: RequestFields = AZURE_FIELDS, grouping: Grouping = Grouping(),
                     skip_bad: bool = False) -> Trace:
    """A CSV of requests with context and generated token columns (header row required)."""
    f = fields
    bad = BadLines(path, skip_bad)
    fast = _clean_csv(path, f)
    if fast is not None:
        return _finish_requests(str(path), *fast, f, grouping, bad)
    with open(path, newline="", encoding="utf-8") as fh:
        rd = csv.reader(fh)
        try:
            header = next(rd)
        except StopIteration:
            raise TraceError(f"{path}:1: empty file (expected a header row)") from None
        except csv.Error as exc:
            raise TraceError(f"{path}:1: {exc}") from None
        cols = [c.strip() for c in header]
        need = [c for c in (f.time, f.input, f.output) if c]
        missing = [c for c in need if c not in cols]
        if missing:
            raise TraceError(f"{path}:1: missing column {missing[0]!r} (header has {', '.join(cols)}; "
                             "--time-field, --input-field and --output-field name the columns)")
        it, ii, io = (cols.index(f.time) if f.time else -1), cols.index(f.input), cols.index(f.output)
        width = len(cols)
        lines: list[int] = []
        t_raw: list = []
        in_raw: list = []
        out_raw: list = []
        while True:
            try:
                row = next(rd)
            except StopIteration:
                break
            except csv.Error as exc:
                bad.bad(rd.line_num, f"unparsable CSV: {exc}")
                continue
            if not row:
                continue
            if len(row) != width:
                bad.bad(rd.line_num, f"wrong field count: expected {width} fields, saw {len(row)}")
                continue
            lines.append(rd.line_num)
            if it >= 0:
                t_raw.append(row[it])
            in_raw.append(row[ii])
            out_raw.append(row[io])
    return _finish_requests(str(path), lines, t_raw if f.time else None, in_raw, out_raw, f, grouping, bad,
                            csv_text=True)


def _json_lines(path: str | Path, bad: BadLines):
    """Yield (line number, parsed object) for each non-blank line (gyre.jsonl); a bad one goes to `bad`."""
    with open(path, encoding="utf-8") as fh:
        yield from json_objects(fh, bad.bad)


def read_request_jsonl(path: str | Path, *, fields: RequestFields = JSONL_FIELDS, grouping: Grouping = Grouping(),
                       skip_bad: bool = False) -> Trace:
    """JSONL of requests, e.g. {"timestamp": 0.5, "input_length": 812, "output_length": 95}."""
    bad = BadLines(path, skip_bad)
    lines: list[int] = []
    t_raw: list = []
    in_raw: list = []
    out_raw: list = []
    for lineno, obj in _json_lines(path, bad):
        missing = [k for k in (f for f in (fields.time, fields.input, fields.output) if f) if k not in obj]
        if missing:
            bad.bad(lineno, f"missing field {missing[0]!r}: {has_fields(obj)} (--time-field, --input-field, "
                            "--output-field name the fields)")
            continue
        lines.append(lineno)
        if fields.time:
            t_raw.append(obj[fields.time])
        in_raw.append(obj[fields.input])
        out_raw.append(obj[fields.output])
    return _finish_requests(str(path), lines, t_raw if fields.time else None, in_raw, out_raw, fields, grouping, bad)


def has_fields(obj: dict) -> str:
    """'the record has a, b, c' (what a user needs to pick the right --*-field)."""
    return f"the record has {', '.join(map(str, obj)) or 'no fields'}"


class MissingField(KeyError):
    """A needed field is absent; str() is the one-line reason."""

    def __str__(self) -> str:
        return self.args[0]


def _session_spec(obj: dict, f: SessionFields, g: Grouping) -> ExecutionSpec:
    if f.requests not in obj:
        raise MissingField(f"missing field {f.requests!r} (the list of sub-requests): {has_fields(obj)}")
    reqs = obj[f.requests]
    if not isinstance(reqs, list) or not reqs:
        raise ValueError(f"field {f.requests!r} must be a non-empty list")
    inp, out, tool = [], [], []
    tool_scale = unit_seconds(f.tool_unit)
    for i, r in enumerate(reqs):
        if not isinstance(r, dict):
            raise ValueError(f"sub-request {i} of {f.requests!r} is not a JSON object")
        for name in (f.input, f.output):
            if name not in r:
                raise MissingField(f"missing field {name!r} in sub-request {i}: {has_fields(r)}")
        a, b, ns = r[f.input], r[f.output], r.get(f.tool_ns, 0) or 0
        if type(a) is not int or a < 0 or type(b) is not int or b < 1:
            which, v = (f.input, a) if type(a) is not int or a < 0 else (f.output, b)
            raise ValueError(f"sub-request {i}: bad {which} {v!r} ({f.input} >= 0 and {f.output} >= 1 must be JSON "
                             "integers, not strings or floats)")
        if type(ns) not in (int, float) or not ns >= 0:
            raise ValueError(f"bad {f.tool_ns} {ns!r} (a number >= 0)")
        inp.append(a), out.append(b), tool.append(ns * tool_scale)
    n = len(reqs)
    tool_out, branches = [], []
    for i in range(n - 1):
        grow = inp[i + 1] - inp[i] - out[i]
        if inp[i + 1] < inp[i]:
            branches.append((i + 1, "compact"))
        tool_out.append(max(grow, 0) if inp[i + 1] >= inp[i] else 0)
    cap = g.cap if g.cap is not None else math.inf
    return ExecutionSpec(exec_id=0, group_id=0, task_id=0, step=0, prompt=inp[0], gen=out, tool_s=tool[: n - 1],
                         tool_out=tool_out, kv=inp, branches=branches, capped=sum(out) >= cap, deadline_s=math.inf)


def read_sessions(path: str | Path, *, fields: SessionFields = SessionFields(), grouping: Grouping = Grouping(),
                  skip_bad: bool = False) -> Trace:
    """Agentic session JSONL: one session (one execution) per line with a list of sub-requests."""
    bad = BadLines(path, skip_bad)
    specs: list[ExecutionSpec] = []
    with no_gc():
        return _read_sessions(path, fields, grouping, bad, specs)


def _read_sessions(path, fields: SessionFields, grouping: Grouping, bad: BadLines, specs: list) -> Trace:
    t_raw: list = []
    lines: list[int] = []
    tasks: list = []
    for lineno, obj in _json_lines(path, bad):
        try:
            spec = _session_spec(obj, fields, grouping)
        except MissingField as exc:
            bad.bad(lineno, str(exc))
            continue
        except (TypeError, ValueError) as exc:
            bad.bad(lineno, f"invalid session: {exc}")
            continue
        specs.append(spec)
        lines.append(lineno)
        t_raw.append(obj.get(fields.time, len(specs)))
        tasks.append(obj.get(fields.task))
    t = _to_seconds(t_raw, lines, bad, fields.time_unit) if specs else np.zeros(0)
    keep = np.flatnonzero(np.isfinite(t))
    bad.skipped.sort()
    given = [tasks[i] for i in keep]
    if given and all(v is not None for v in given):
        return group_by_task([specs[i] for i in keep], t[keep], [str(v) for v in given], grouping, str(path), bad)
    if any(v is not None for v in given):
        missing = next(lines[i] for i in keep if tasks[i] is None)
        bad.bad(missing, f"field {fields.task!r} (the task) is on some sessions but not this one")
    return _group([specs[i] for i in keep], t[keep], grouping, str(path), bad)


def group_by_task(specs: list[ExecutionSpec], times: np.ndarray, tasks: list[str], g: Grouping, path: str,
                  bad: BadLines) -> Trace:
    """One group per task (its executions, however many), tasks in the order of their first execution's time;
    ids renumbered in that order, step = group index // groups_per_step."""
    if not specs:
        raise TraceError(f"{path}: no executions (every line was bad or the file is empty)")
    order = np.argsort(times, kind="stable").tolist()
    by_task: dict[str, list[int]] = {}
    for i in order:
        by_task.setdefault(tasks[i], []).append(i)
    groups, out_t, k = [], {}, 0
    for gid, idx in enumerate(by_task.values()):
        ex = []
        for i in idx:
            s = specs[i]
            s.exec_id, s.group_id, s.task_id, s.step = k, gid, gid, gid // g.groups_per_step
            out_t[k] = float(times[i])
            ex.append(s)
            k += 1
        groups.append(GroupSpec(group_id=gid, task_id=gid, step=gid // g.groups_per_step, executions=ex))
    return Trace(path=path, groups=groups, times=out_t, skipped=bad.skipped, task_groups=True,
                 task_names=list(by_task))
