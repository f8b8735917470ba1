"""Which reader a trace file needs, told from the fields its first record has, and reading it.

Formats: "rollout" (gyre's own JSONL, header with `gyre_trace`), "sessions" (JSONL, one session per
line holding a list of sub-request objects), "requests-jsonl" (JSONL, one request per line with an
input and an output token field), "requests-csv" (a CSV with a header row), and agent trajectories
(gyre.traces.agent_logs: one JSON document per run, a file or a folder): "agent" (each file's format
detected), or one of "mini-swe-agent", "swe-agent", "openhands", "atif".

Sniffing (format "auto"): a folder is a folder of agent trajectories. A name ending in .csv is a
request CSV. A file whose first line is not a JSON value by itself, or whose whole text is one JSON
document in an agent format, is read as one JSON document (not JSON Lines): an agent trajectory,
or an error that says it is a JSON document of an unknown kind. Otherwise the first non-blank line
is parsed and judged by its fields, in this order: `gyre_trace` -> rollout; the configured sessions
field (`requests` unless renamed), or else any field holding a non-empty list of objects -> sessions;
the configured request input and output fields -> requests-jsonl, or, when no field was named,
a serving benchmark's (`input_toks`, `output_toks`, `arrival_time`: LLMServingSim's vLLM request
logs) -> requests-jsonl with those names. A list of numbers (e.g. Mooncake's
`hash_ids`) is not a list of sub-requests. A record that fits none is an error naming the fields
it has. Every read error then says which format was used and why (guessed from which fields, or
given with --format), so a wrong guess is visible in the one line the user sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from gyre.traces.agent_logs import AGENT_FORMATS, detect, read_agent_logs
from gyre.traces.readers import (
    Grouping, RequestFields, SessionFields, has_fields, read_request_csv, read_request_jsonl, read_sessions,
)
from gyre.traces.schema import Trace, TraceError, read_trace

FORMATS = ("auto", "rollout", "sessions", "requests-csv", "requests-jsonl", "agent", *AGENT_FORMATS)
CSV_FIELDS = RequestFields()
JSONL_FIELDS = RequestFields(time="timestamp", input="input_length", output="output_length")
# request logs of serving benchmarks: LLMServingSim's vLLM runs (shared/data/vllm_timings/*/requests.jsonl)
SERVING_LOG_FIELDS = (RequestFields(time="arrival_time", input="input_toks", output="output_toks"),)


@dataclass(frozen=True, kw_only=True)
class FieldNames:
    """Names the user gave (None: the format's default); one set serves every format."""

    time: str | None = None
    input: str | None = None
    output: str | None = None
    sessions: str | None = None  # the list of sub-requests in a session record
    task: str | None = None  # a session's task (repeated runs of a task form a group)
    tool: str | None = None  # a sub-request's tool duration
    time_unit: str = "s"  # numeric timestamps
    tool_unit: str = "ns"  # tool durations

    def requests(self, fmt: str) -> RequestFields:
        d = CSV_FIELDS if fmt == "requests-csv" else JSONL_FIELDS
        return RequestFields(time=d.time if self.time is None else self.time, input=self.input or d.input,
                             output=self.output or d.output, time_unit=self.time_unit)

    def session(self) -> SessionFields:
        d = SessionFields()
        return SessionFields(requests=self.sessions or d.requests, input=self.input or d.input,
                             output=self.output or d.output, tool_ns=self.tool or d.tool_ns,
                             time=d.time if self.time is None else self.time, time_unit=self.time_unit,
                             tool_unit=self.tool_unit, task=self.task or d.task)


def _first_record(path: Path):
    """(line, first record) of a JSON Lines file, or (0, the document) when the file is one JSON document."""
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        return lineno, json.loads(line)
                    except ValueError:
                        break
            else:
                raise TraceError(f"{path}: empty file")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); a CSV needs a .csv name "
                         "or --format requests-csv") from None
    try:  # the first line alone is not JSON: a JSON document spread over lines?
        return 0, json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        raise TraceError(f"{path}:{lineno}: cannot tell the format: neither JSON Lines (line {lineno} is not JSON) "
                         "nor one JSON document, and the name does not end in .csv; use --format") from None


@dataclass(frozen=True, kw_only=True)
class Guess:
    fmt: str
    why: str
    names: FieldNames  # the given names, plus the sessions field found when it was guessed


def sniff(path: str | Path, names: FieldNames = FieldNames()) -> Guess:
    """The format a file's name or first record points to (see the module doc)."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{path}: no such file or folder")
    if p.is_dir():
        return Guess(fmt="agent", why="a folder: agent trajectories", names=names)
    if p.suffix.lower() == ".csv":
        return Guess(fmt="requests-csv", why="guessed from the .csv name", names=names)
    lineno, obj = _first_record(p)
    kind = detect(obj)
    if lineno == 0 or (kind is not None and not p.name.endswith(".jsonl")):
        if kind is None:
            have = has_fields(obj) if isinstance(obj, dict) else f"it is a {type(obj).__name__}"
            raise TraceError(f"{path}: one JSON document, not JSON Lines ({have}); not an agent trajectory "
                             f"({', '.join(AGENT_FORMATS)}) either; give --format")
        return Guess(fmt=kind, why=f"one JSON document in the {kind} format", names=names)
    if not isinstance(obj, dict):
        raise TraceError(f"{path}:{lineno}: cannot tell the format: a record must be a JSON object")
    if "gyre_trace" in obj:
        return Guess(fmt="rollout", why="guessed from the 'gyre_trace' header", names=names)
    sf, rf = names.session(), names.requests("requests-jsonl")
    lists = [k for k, v in obj.items() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
    if sf.requests in obj:
        return Guess(fmt="sessions", why=f"guessed from the field {sf.requests!r}", names=names)
    if rf.input in obj and rf.output in obj:
        return Guess(fmt="requests-jsonl", why=f"guessed from the fields {rf.input!r} and {rf.output!r}", names=names)
    for alt in SERVING_LOG_FIELDS:  # a serving benchmark's request log, when the user named no fields
        if names.input is None and names.output is None and alt.input in obj and alt.output in obj:
            return Guess(fmt="requests-jsonl", why=f"guessed from the fields {alt.input!r} and {alt.output!r}",
                         names=replace(names, input=alt.input, output=alt.output,
                                       time=alt.time if names.time is None and alt.time in obj else names.time))
    if lists:
        return Guess(fmt="sessions", why=f"guessed from the field {lists[0]!r} (a list of objects)",
                     names=replace(names, sessions=lists[0]))
    raise TraceError(f"{path}:{lineno}: cannot tell the format: {has_fields(obj)}; a request needs "
                     f"{rf.input!r} and {rf.output!r} (--input-field, --output-field), a session a list of "
                     f"sub-requests (--sessions-field); or give --format")


def load_trace(path: str | Path, fmt: str = "auto", *, names: FieldNames = FieldNames(), skip_bad: bool = False,
               grouping: Grouping = Grouping()) -> Trace:
    """Read a trace in any supported format; a read error says which format was used and why."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt == "auto":
        g = sniff(path, names)
        fmt, why, names = g.fmt, g.why, g.names
    else:
        if not Path(path).exists():
            raise TraceError(f"{path}: no such file or folder")
        if Path(path).is_dir() and fmt not in ("agent", *AGENT_FORMATS):
            raise TraceError(f"{path}: a folder; only agent trajectories (--format agent) are read from a folder")
        why = "given with --format"
    try:
        if fmt in ("agent", *AGENT_FORMATS):
            return read_agent_logs(path, fmt, group_size=grouping.group_size,
                                   groups_per_step=grouping.groups_per_step, cap=grouping.cap, skip_bad=skip_bad)
        if fmt == "rollout":
            return read_trace(path, skip_bad=skip_bad)
        if fmt == "sessions":
            return read_sessions(path, fields=names.session(), grouping=grouping, skip_bad=skip_bad)
        reader = read_request_csv if fmt == "requests-csv" else read_request_jsonl
        return reader(path, fields=names.requests(fmt), grouping=grouping, skip_bad=skip_bad)
    except TraceError as exc:
        raise TraceError(f"{exc} (read as {fmt}, {why})") from None
