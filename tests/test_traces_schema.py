"""Rollout trace schema: exact spec round trip, replay reproduces a run, malformed lines."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.cli.traces import write_run_trace
from gyre.sim.harness.runner import simulate
from gyre.traces.schema import TraceError, read_trace, write_trace
from gyre.workload import ReplaySource, WorkloadSource


def _small_swe():
    cfg = get_preset("xlong-swe-small")
    w = dataclasses.replace(cfg.workload, groups_per_step=4, subagent_p=0.05, retry_p=0.05, context_window=16384,
                            turns=dataclasses.replace(cfg.workload.turns, median=20))
    return override(dataclasses.replace(cfg, workload=w), steps=2)


def test_specs_round_trip_exactly(tmp_path):
    """Every ExecutionSpec field (kv footprint, branches, float latencies, inf deadline) survives the file."""
    cfg = _small_swe()
    src = WorkloadSource(dataclasses.replace(cfg.workload, deadline_s=float("inf")), seed=3)
    groups = [src.next_group() for _ in range(6)]
    assert any(e.branches for g in groups for e in g.executions), "the scenario should exercise branches"
    write_trace(tmp_path / "t.jsonl", groups, workload=src.config)
    tr = read_trace(tmp_path / "t.jsonl")
    assert tr.groups == groups, "specs differ after a write/read round trip"
    assert tr.workload == src.config, "the header's workload config differs"


@pytest.mark.parametrize("policy", ["colocate", "async"])
def test_replay_reproduces_makespan(tmp_path, policy):
    """A simulated run written as a trace and replayed under the same policy has the same makespan."""
    cfg = _small_swe()
    r = simulate(cfg, policy)
    write_run_trace(r, tmp_path / "run.jsonl", "xlong-swe-small")
    tr = read_trace(tmp_path / "run.jsonl")
    assert tr.run["makespan_s"] == r.makespan_s, "header should record the makespan"
    assert all(o.end_s is not None for o in tr.outcomes.values()), "every issued execution finished"
    again = simulate(cfg, policy, source=ReplaySource(tr.groups, tr.workload))
    assert again.makespan_s == r.makespan_s, f"replay makespan {again.makespan_s} != run {r.makespan_s}"


def _write(tmp_path, lines):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _good(i, group=0):
    return json.dumps({"exec": i, "group": group, "task": group, "step": 0, "prompt": 10,
                       "segments": [{"gen": 5, "kv": 10, "tool_s": 0.5, "tool_out": 3}, {"gen": 2, "kv": 18}]})


HEAD = json.dumps({"gyre_trace": 1, "workload": None, "run": {}})


@pytest.mark.parametrize("bad_line, reason", [
    ("{not json", "invalid JSON"),
    (json.dumps({"exec": 9, "group": 0, "task": 0, "step": 0, "prompt": 1, "segments": []}), "non-empty"),
    (json.dumps({"exec": 9, "group": 0, "task": 0, "step": 0, "segments": [{"gen": 1, "kv": 1}]}), "'prompt'"),
    (json.dumps({"exec": 9, "group": 0, "task": 0, "step": 0, "prompt": 1, "segments": [{"gen": -1, "kv": 1}]}),
     "'gen'"),
    (_good(0), "duplicate exec id"),
])
def test_malformed_rollout_line_names_file_and_line(tmp_path, bad_line, reason):
    """A malformed record stops the read with `file:line: reason`."""
    p = _write(tmp_path, [HEAD, _good(0), bad_line, _good(2)])
    with pytest.raises(TraceError) as exc:
        read_trace(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}:3: "), f"message should name file and line 3: {msg}"
    assert reason in msg, f"message should say why ({reason}): {msg}"


def test_skip_bad_counts_and_keeps_the_rest(tmp_path):
    """--skip-bad reads the good lines and reports each skipped line with its reason."""
    p = _write(tmp_path, [HEAD, _good(0), "{", _good(1), "[1]", _good(2, group=1), _good(3, group=0)])
    tr = read_trace(p, skip_bad=True)
    assert tr.n_executions == 3, f"three good records expected, got {tr.n_executions}"
    assert [ln for ln, _ in tr.skipped] == [3, 5, 7], f"skipped lines: {tr.skipped}"
    assert "not contiguous" in tr.skipped[-1][1], "a split group is reported"
    assert "skipped 3 bad lines" in tr.skip_summary(), tr.skip_summary()


def test_not_a_trace_header(tmp_path):
    """A file without the gyre header is rejected at line 1."""
    p = _write(tmp_path, [_good(0)])
    with pytest.raises(TraceError, match=r":1: not a gyre rollout trace"):
        read_trace(p)
