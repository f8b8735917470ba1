"""Foreign trace readers: request CSV, request JSONL, agentic sessions; malformed input of each."""

from __future__ import annotations

import json

import pytest

from gyre.traces.formats import sniff
from gyre.traces.readers import Grouping, RequestFields, read_request_csv, read_request_jsonl, read_sessions
from gyre.traces.schema import TraceError

AZURE = "/work/shared/data/azure_llm_inference_2023_code.csv"


def test_azure_csv_groups_in_time_order():
    """The Azure CSV reads as 8,819 one-segment executions, cut into groups of 8 in arrival order."""
    tr = read_request_csv(AZURE, grouping=Grouping(group_size=8, groups_per_step=64))
    assert tr.n_executions == 8819, f"rows read: {tr.n_executions}"
    first = tr.groups[0].executions[0]
    assert (first.prompt, first.gen, first.kv) == (4808, [10], [4808]), f"first request: {first}"
    assert len(tr.groups) == 1103 and len(tr.groups[-1].executions) == 3, "the short last group is kept"
    assert tr.groups[64].step == 1, "64 groups per step"
    t = list(tr.times.values())
    assert t == sorted(t), "executions are in time order"


def test_csv_configurable_columns(tmp_path):
    """Column names are configurable; numeric timestamps sort the rows."""
    p = tmp_path / "r.csv"
    p.write_text("t,in,out\n2.0,100,7\n1.0,50,3\n")
    tr = read_request_csv(p, fields=RequestFields(time="t", input="in", output="out"), grouping=Grouping(group_size=2))
    assert [e.gen[0] for e in tr.groups[0].executions] == [3, 7], "sorted by the time column"


@pytest.mark.parametrize("row, reason", [
    ("2023-11-16 18:17:04,12", "wrong field count"),
    ("2023-11-16 18:17:04,abc,12", "bad ContextTokens"),
    ("2023-11-16 18:17:04,100,0", "bad GeneratedTokens"),
    ("not-a-time,100,12", "bad timestamp"),
])
def test_malformed_csv_row(tmp_path, row, reason):
    """A bad CSV row stops with `file:line: reason`; --skip-bad keeps the others and says why."""
    p = tmp_path / "bad.csv"
    p.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,10,5\n{row}\n2023-11-16 18:17:05,20,6\n")
    with pytest.raises(TraceError) as exc:
        read_request_csv(p)
    assert str(exc.value).startswith(f"{p}:3: ") and reason in str(exc.value), str(exc.value)
    tr = read_request_csv(p, skip_bad=True)
    assert tr.n_executions == 2 and tr.skipped[0][0] == 3 and reason in tr.skipped[0][1], tr.skipped


def test_csv_missing_column(tmp_path):
    """A missing column is named at line 1."""
    p = tmp_path / "c.csv"
    p.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(TraceError, match=r":1: missing column 'GeneratedTokens'"):
        read_request_csv(p)


def test_request_jsonl_and_malformed(tmp_path):
    """Request JSONL reads; a bad JSON line and a missing field are reported with their lines."""
    p = tmp_path / "r.jsonl"
    rows = [{"timestamp": i, "input_length": 10 + i, "output_length": 5} for i in range(4)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(2, '{"timestamp": 9, "input_length": 3')
    lines.insert(4, '{"timestamp": 9, "input_length": 3}')
    p.write_text("\n".join(lines) + "\n")
    assert sniff(p).fmt == "requests-jsonl", "format sniffed from the first record"
    with pytest.raises(TraceError, match=r":3: invalid JSON"):
        read_request_jsonl(p)
    tr = read_request_jsonl(p, skip_bad=True)
    assert tr.n_executions == 4, f"good rows: {tr.n_executions}"
    assert [(ln, r.split(":")[0]) for ln, r in tr.skipped] == [(3, "invalid JSON"), (5, "missing field 'output_length'")]


def test_sessions_to_segments(tmp_path):
    """A session's sub-requests become segments: kv = input, tool time, context growth, compaction."""
    s = {"timestamp": 0, "requests": [
        {"input_toks": 100, "output_toks": 20, "tool_duration_ns": 1_500_000_000},
        {"input_toks": 150, "output_toks": 10, "tool_duration_ns": 2_000_000_000},
        {"input_toks": 40, "output_toks": 5},
    ]}
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps(s) + "\n")
    assert sniff(p).fmt == "sessions", "a record holding a list is a session"
    e = read_sessions(p).groups[0].executions[0]
    assert (e.prompt, e.gen, e.kv) == (100, [20, 10, 5], [100, 150, 40]), f"segments: {e}"
    assert (e.tool_s, e.tool_out, e.branches) == ([1.5, 2.0], [30, 0], [(2, "compact")]), f"tools: {e}"


@pytest.mark.parametrize("line, reason", [
    ('{"requests": []}', "non-empty"),
    ('{"requests": [{"input_toks": 5}]}', "missing field 'output_toks'"),
    ('{"requests": [{"input_toks": 5, "output_toks": 2, "tool_duration_ns": -1}]}', "tool_duration_ns"),
    ('{"requests": [', "invalid JSON"),
])
def test_malformed_session(tmp_path, line, reason):
    """A malformed session stops with `file:line: reason`; --skip-bad reports it."""
    good = '{"requests": [{"input_toks": 5, "output_toks": 2}]}'
    p = tmp_path / "s.jsonl"
    p.write_text(f"{good}\n{line}\n{good}\n")
    with pytest.raises(TraceError) as exc:
        read_sessions(p)
    assert str(exc.value).startswith(f"{p}:2: ") and reason in str(exc.value), str(exc.value)
    tr = read_sessions(p, skip_bad=True)
    assert tr.n_executions == 2 and tr.skipped[0][0] == 2, tr.skipped


def test_mooncake_style_requests_are_sniffed_by_fields(tmp_path):
    """A request JSONL with a `hash_ids` list is requests-jsonl (a list of numbers is not a session)."""
    from gyre.traces.formats import load_trace

    p = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 27482 + 10 * i, "input_length": 6955 + i, "output_length": 52, "hash_ids": [46, 47, 48 + i]}
            for i in range(5)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    g = sniff(p)
    assert g.fmt == "requests-jsonl" and "input_length" in g.why, g
    tr = load_trace(p, grouping=Grouping(group_size=2))
    assert [e.prompt for gr in tr.groups for e in gr.executions] == [6955, 6956, 6957, 6958, 6959]


def test_unknown_fields_are_listed(tmp_path):
    """A JSONL whose fields match no format names the fields it has and the options that map them."""
    from gyre.traces.formats import load_trace

    p = tmp_path / "odd.jsonl"
    p.write_text(json.dumps({"arrival": 1.0, "prompt_len": 10, "completion_len": 4}) + "\n")
    with pytest.raises(TraceError) as exc:
        load_trace(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}:1: cannot tell the format") and "arrival, prompt_len, completion_len" in msg, msg
    assert "--input-field" in msg and "--sessions-field" in msg, msg
    from gyre.traces.formats import FieldNames

    tr = load_trace(p, names=FieldNames(time="arrival", input="prompt_len", output="completion_len"))
    assert tr.groups[0].executions[0].gen == [4], "renamed fields read"


def test_wrong_format_says_what_was_used(tmp_path):
    """--format sessions on a request file: the error lists the record's fields and says the format was given."""
    from gyre.traces.formats import load_trace

    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"timestamp": 1, "input_length": 3, "output_length": 4}) + "\n")
    with pytest.raises(TraceError) as exc:
        load_trace(p, "sessions")
    msg = str(exc.value)
    assert f"{p}:1: missing field 'requests'" in msg and "timestamp, input_length, output_length" in msg, msg
    assert "(read as sessions, given with --format)" in msg, msg
    q = tmp_path / "bad.jsonl"
    q.write_text(json.dumps({"timestamp": 1, "input_length": 3, "output_length": 4}) + "\n"
                 + json.dumps({"timestamp": 2, "input_length": 3}) + "\n")
    with pytest.raises(TraceError) as exc:
        load_trace(q)
    msg = str(exc.value)
    assert f"{q}:2: missing field 'output_length': the record has timestamp, input_length" in msg, msg
    assert "(read as requests-jsonl, guessed from the fields 'input_length' and 'output_length')" in msg, msg


def test_sessions_with_other_names_and_ns_times(tmp_path):
    """Sessions whose sub-request list is `sub_requests`, arrival in ns and tool time in ms read with options."""
    from gyre.traces.formats import FieldNames, load_trace

    subs = [{"input_toks": 100, "output_toks": 20, "tool_ms": 1500}, {"input_toks": 150, "output_toks": 10}]
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps({"arrival_ns": 3_000_000_000, "sub_requests": subs}) + "\n"
                 + json.dumps({"arrival_ns": 1_000_000_000, "sub_requests": subs[:1]}) + "\n")
    g = sniff(p)
    assert g.fmt == "sessions" and g.names.sessions == "sub_requests", g
    tr = load_trace(p, names=FieldNames(time="arrival_ns", time_unit="ns", tool="tool_ms", tool_unit="ms"))
    assert list(tr.times.values()) == [1.0, 3.0], f"ns arrivals in seconds, sorted: {tr.times}"
    e = tr.groups[0].executions[1]
    assert (e.gen, e.tool_s, e.tool_out) == ([20, 10], [1.5], [30]), e
    same = load_trace(p, "sessions", names=FieldNames(sessions="sub_requests", time="arrival_ns", time_unit="ns",
                                                      tool="tool_ms", tool_unit="ms"))
    assert same.groups == tr.groups, "the guessed list field equals the one given"
    with pytest.raises(TraceError, match="missing field 'output_toks' in sub-request 0: the record has input_toks"):
        q = tmp_path / "q.jsonl"
        q.write_text(json.dumps({"sub_requests": [{"input_toks": 3}]}) + "\n")
        load_trace(q)


def test_unterminated_string_message(tmp_path):
    """json's 'Unterminated string starting at' reads as one phrase, not 'starting at at column'."""
    p = tmp_path / "r.jsonl"
    p.write_text('{"timestamp": "1')
    with pytest.raises(TraceError) as exc:
        read_request_jsonl(p)
    assert str(exc.value).endswith(":1: invalid JSON: Unterminated string starting at column 15"), str(exc.value)
