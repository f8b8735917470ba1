"""Agent trajectory readers (mini-swe-agent, SWE-agent, OpenHands, ATIF) on small files written as the formats
document them: exact segments, tool times, task groups, branches, format sniffing and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gyre.traces.formats import load_trace, sniff
from gyre.traces.readers import Grouping
from gyre.traces.schema import TraceError

SHARED = Path("/work/shared/data/agent_trajectories")


def mini_traj(task: str, calls: list[tuple[int, int, float, float]], t0: float = 1_775_892_000.0) -> dict:
    """A mini-swe-agent v2 `.traj.json` (trajectory_format mini-swe-agent-1.1): calls are (prompt_tokens,
    completion_tokens, seconds from t0 to the response, seconds the tool ran after it); the last call has no tool."""
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "<pr_description>fix it</pr_description>"}]
    for i, (p, c, t, tool) in enumerate(calls):
        msgs.append({"role": "assistant", "content": f"step {i}", "tool_calls": [],
                     "extra": {"actions": [{"command": "ls"}], "cost": 0.001, "timestamp": t0 + t,
                               "response": {"id": f"r{i}", "model": "deepseek-chat", "object": "chat.completion",
                                            "usage": {"prompt_tokens": p, "completion_tokens": c,
                                                      "total_tokens": p + c}}}})
        if i < len(calls) - 1:
            msgs.append({"role": "tool", "content": "<returncode>0</returncode>", "tool_call_id": f"call_{i}",
                         "extra": {"raw_output": "", "returncode": 0, "timestamp": t0 + t + tool,
                                   "exception_info": ""}})
    msgs.append({"role": "exit", "content": "", "extra": {"exit_status": "Submitted", "submission": ""}})
    return {"info": {"model_stats": {"instance_cost": 0.01, "api_calls": len(calls)}, "mini_version": "2.2.7",
                     "exit_status": "Submitted", "submission": ""},
            "messages": msgs, "trajectory_format": "mini-swe-agent-1.1", "instance_id": task}


def write(path: Path, doc) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))  # pretty-printed, as mini-swe-agent writes it: not JSON Lines
    return path


def test_mini_swe_agent_segments_exact(tmp_path):
    """Each model call is a segment: gen = completion tokens, kv = prompt tokens, tool_s = the tool result's
    timestamp minus the call's, tool_out = context growth; a shrinking prompt is a compact branch."""
    p = write(tmp_path / "a.traj.json", mini_traj("astropy-1", [(1000, 50, 2.0, 0.25), (1300, 40, 5.0, 1.5),
                                                                (600, 30, 9.0, 0.0)]))
    assert sniff(p).fmt == "mini-swe-agent", sniff(p)
    tr = load_trace(p)
    (e,) = tr.groups[0].executions
    assert (e.prompt, e.gen, e.kv) == (1000, [50, 40, 30], [1000, 1300, 600]), e
    assert e.tool_s == pytest.approx([0.25, 1.5], abs=1e-6), e.tool_s
    assert e.tool_out == [250, 0] and e.branches == [(2, "compact")], (e.tool_out, e.branches)
    assert tr.task_groups and tr.task_names == ["astropy-1"], tr.task_names


def test_folder_of_runs_groups_repeated_tasks(tmp_path):
    """A folder of runs: the runs of one task (instance_id) form one GRPO group, tasks in order of their first
    run's start; step = group index // groups_per_step."""
    d = tmp_path / "runs"
    starts = {"b-1": [100.0], "a-1": [0.0, 50.0, 300.0], "c-1": [200.0, 10.0]}
    for task, ts in starts.items():
        for j, t in enumerate(ts):
            write(d / task / f"{task}.{j}.traj.json", mini_traj(task, [(100, 5, 1.0, 0.5), (120, 6, 3.0, 0.0)],
                                                                t0=1e9 + t))
    assert sniff(d).fmt == "agent", sniff(d)
    tr = load_trace(d, grouping=Grouping(groups_per_step=2))
    assert tr.task_names == ["a-1", "c-1", "b-1"], tr.task_names
    assert [len(g.executions) for g in tr.groups] == [3, 2, 1], [len(g.executions) for g in tr.groups]
    assert [g.step for g in tr.groups] == [0, 0, 1], [g.step for g in tr.groups]
    assert [e.exec_id for g in tr.groups for e in g.executions] == list(range(6)), "ids renumbered in group order"


def test_the_shared_mini_swe_agent_runs_read(tmp_path):
    """The 14 real mini-swe-agent runs in shared/data read as 14 one-run tasks with per-call tokens and tool
    times from their timestamps (every call but the last has a tool time between 0.1 s and 20 s)."""
    if not SHARED.exists():
        pytest.skip("shared data not present")
    tr = load_trace(SHARED)
    assert tr.n_executions == 14 and len(tr.groups) == 14, (tr.n_executions, len(tr.groups))
    tools = [t for g in tr.groups for e in g.executions for t in e.tool_s]
    assert len(tools) == 1165 - 14 and 0.1 < min(tools) and max(tools) < 20, (len(tools), min(tools), max(tools))


def test_swe_agent_splits_run_totals_and_reads_execution_time(tmp_path):
    """SWE-agent 1.x `.traj`: tool_s is each step's execution_time; per-call tokens split the run totals by
    character share (they sum to the totals), and the trace says they are estimates."""
    doc = {"environment": "swe_main", "trajectory": [
        {"action": "ls", "observation": "a b", "response": "x" * 30, "thought": "", "execution_time": 0.5,
         "state": "{}", "query": [{"role": "system", "content": "s" * 100}]},
        {"action": "submit", "observation": "", "response": "y" * 10, "thought": "", "execution_time": 2.0,
         "state": "{}", "query": [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "u" * 100}]},
    ], "history": [], "info": {"model_stats": {"instance_cost": 0.1, "tokens_sent": 3000, "tokens_received": 400,
                                                "api_calls": 2}, "exit_status": "submitted"}}
    p = write(tmp_path / "django-1" / "django-1.traj", doc)
    tr = load_trace(p)
    (e,) = tr.groups[0].executions
    assert (e.gen, e.kv, e.tool_s) == ([300, 100], [1000, 2000], [0.5]), e
    assert tr.task_names == ["django-1"] and any("estimated" in n for n in tr.notes), (tr.task_names, tr.notes)


def openhands_events() -> list[dict]:
    """An OpenHands 0.x event stream: a user message, two tool calls from one model response (one call), their
    observations (cause = the action id), a condensation, a delegate action, and a finish."""
    def resp(rid, p, c):
        return {"model_response": {"id": rid, "usage": {"prompt_tokens": p, "completion_tokens": c}},
                "function_name": "execute_bash", "tool_call_id": "t", "total_calls_in_response": 1}

    return [
        {"id": 0, "timestamp": "2025-05-01T10:00:00", "source": "user", "action": "message", "message": "fix",
         "args": {"content": "fix"}},
        {"id": 1, "timestamp": "2025-05-01T10:00:02", "source": "agent", "action": "run", "message": "ls",
         "args": {"command": "ls"}, "tool_call_metadata": resp("r1", 1000, 40)},
        {"id": 2, "timestamp": "2025-05-01T10:00:02.500", "source": "agent", "action": "read", "message": "cat",
         "args": {"path": "a"}, "tool_call_metadata": resp("r1", 1000, 40)},
        {"id": 3, "timestamp": "2025-05-01T10:00:03", "source": "environment", "observation": "run", "cause": 1,
         "content": "a b", "extras": {"exit_code": 0}},
        {"id": 4, "timestamp": "2025-05-01T10:00:05", "source": "environment", "observation": "read", "cause": 2,
         "content": "...", "extras": {}},
        {"id": 5, "timestamp": "2025-05-01T10:00:06", "source": "agent", "action": "condensation", "args": {}},
        {"id": 6, "timestamp": "2025-05-01T10:00:08", "source": "agent", "action": "run", "message": "pytest",
         "args": {"command": "pytest"}, "tool_call_metadata": resp("r2", 500, 60)},
        {"id": 7, "timestamp": "2025-05-01T10:00:20", "source": "environment", "observation": "run", "cause": 6,
         "content": "ok", "extras": {"exit_code": 0}},
        {"id": 8, "timestamp": "2025-05-01T10:00:21", "source": "agent", "action": "delegate", "args": {}},
        {"id": 9, "timestamp": "2025-05-01T10:00:30", "source": "agent", "action": "finish", "message": "done",
         "args": {}, "tool_call_metadata": resp("r3", 900, 20)},
    ]


def test_openhands_events_one_call_per_response_with_branches(tmp_path):
    """OpenHands: one segment per model response id; tool_s = the last answering observation minus the response's
    first action (3.0 s, 12.0 s); a condensation is a compact branch, a delegate a subagent branch."""
    p = write(tmp_path / "oh.json", {"instance_id": "flask-9", "history": openhands_events()})
    assert sniff(p).fmt == "openhands", sniff(p)
    tr = load_trace(p)
    (e,) = tr.groups[0].executions
    assert (e.gen, e.kv) == ([40, 60, 20], [1000, 500, 900]), e
    assert e.tool_s == pytest.approx([3.0, 12.0]), e.tool_s
    assert e.branches == [(1, "compact"), (2, "subagent")], e.branches
    assert tr.task_names == ["flask-9"], tr.task_names
    bare = write(tmp_path / "list.json", openhands_events())  # a bare event list (the trajectory export)
    assert load_trace(bare).groups[0].executions[0].gen == [40, 60, 20]


def atif_doc(task: str) -> dict:
    """An ATIF-v1.4 trajectory (harbor RFC 0001) with a sub-agent delegation in its second agent step."""
    return {"schema_version": "ATIF-v1.4", "session_id": "s-1", "agent": {"name": "openhands", "version": "0.59"},
            "extra": {"task_id": task}, "steps": [
                {"step_id": 1, "source": "system", "message": "You are...", "timestamp": "2025-10-16T14:30:00Z"},
                {"step_id": 2, "source": "user", "message": "do it", "timestamp": "2025-10-16T14:30:01Z"},
                {"step_id": 3, "source": "agent", "message": "", "timestamp": "2025-10-16T14:30:05Z",
                 "tool_calls": [{"tool_call_id": "c1", "function_name": "bash", "arguments": {"cmd": "ls"}}],
                 "observation": {"results": [{"source_call_id": "c1", "content": "a"}]},
                 "metrics": {"prompt_tokens": 800, "completion_tokens": 30, "cached_tokens": 0}},
                {"step_id": 4, "source": "agent", "message": "", "timestamp": "2025-10-16T14:30:20Z",
                 "tool_calls": [{"tool_call_id": "c2", "function_name": "delegate", "arguments": {}}],
                 "observation": {"results": [{"source_call_id": "c2", "content": "done",
                                              "subagent_trajectory_ref": [{"session_id": "sub-1"}]}]},
                 "metrics": {"prompt_tokens": 900, "completion_tokens": 25}},
                {"step_id": 5, "source": "agent", "message": "finished", "timestamp": "2025-10-16T14:31:00Z",
                 "metrics": {"prompt_tokens": 1000, "completion_tokens": 10}}]}


def test_atif_steps_and_subagent_branch(tmp_path):
    """ATIF: agent steps are segments from their metrics; a result with subagent_trajectory_ref is a subagent
    branch; tool time is not separable from one timestamp a step, so tool_s is 0 and the trace notes it."""
    p = write(tmp_path / "t" / "trajectory.json", atif_doc("task-7"))
    assert sniff(p).fmt == "atif", sniff(p)
    tr = load_trace(p)
    (e,) = tr.groups[0].executions
    assert (e.gen, e.kv, e.tool_s, e.tool_out) == ([30, 25, 10], [800, 900, 1000], [0.0, 0.0], [70, 75]), e
    assert e.branches == [(1, "subagent")] and tr.task_names == ["task-7"], (e.branches, tr.task_names)
    assert any("not separable" in n for n in tr.notes), tr.notes


def test_a_json_document_is_not_called_json_lines(tmp_path):
    """A pretty-printed JSON document that is no agent trajectory is named as such (not 'the first record is not
    JSON'); one in an agent format on a single line is still read as that format."""
    p = write(tmp_path / "x.json", {"foo": 1, "bar": [1, 2]})
    with pytest.raises(TraceError, match=r"x.json: one JSON document, not JSON Lines \(the record has foo, bar\)"):
        sniff(p)
    one = tmp_path / "one.traj.json"
    one.write_text(json.dumps(mini_traj("t", [(10, 2, 1.0, 0.0)])))
    assert sniff(one).fmt == "mini-swe-agent", sniff(one)


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["messages"][2]["extra"]["response"]["usage"].update(completion_tokens="7"),
     "messages[2].extra.response.usage.completion_tokens must be an integer >= 0, got '7'"),
    (lambda d: d["messages"][2]["extra"]["response"]["usage"].update(prompt_tokens=12.0),
     "messages[2].extra.response.usage.prompt_tokens must be an integer >= 0, got 12.0"),
    (lambda d: d["messages"][2]["extra"].pop("response"),
     "messages[2]: missing field 'extra.response.usage' (at 'response'"),
    (lambda d: d["messages"][4]["extra"].update(timestamp="yesterday"), "messages[4].extra.timestamp: bad timestamp"),
])
def test_bad_trajectory_is_one_line_naming_file_and_field(tmp_path, mutate, needle):
    """A bad token count (a string, a float), a missing usage or a bad timestamp stops the read with one line
    naming the file and the field path."""
    d = mini_traj("t", [(100, 5, 1.0, 0.5), (120, 6, 3.0, 0.0)])
    mutate(d)
    p = write(tmp_path / "bad.traj.json", d)
    with pytest.raises(TraceError) as exc:
        load_trace(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}: ") and needle in msg and "\n" not in msg, msg


def test_folder_bad_file_skipped_or_named(tmp_path):
    """In a folder, a bad run stops the read naming its file; --skip-bad reads the rest and counts it; a folder with
    no trajectory files says so."""
    d = tmp_path / "runs"
    write(d / "good.traj.json", mini_traj("a", [(100, 5, 1.0, 0.0)]))
    (d / "broken.traj.json").write_text('{"messages": [')
    with pytest.raises(TraceError, match=r"broken.traj.json:1: invalid JSON document"):
        load_trace(d)
    tr = load_trace(d, skip_bad=True)
    assert tr.n_executions == 1 and len(tr.skipped) == 1, (tr.n_executions, tr.skipped)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="a folder with no agent trajectory files"):
        load_trace(empty)
    with pytest.raises(TraceError, match="a folder; only agent trajectories"):
        load_trace(d, "requests-csv")


def test_repeated_runs_fit_a_task_difficulty(tmp_path):
    """Tasks whose repeated runs differ in length between tasks (3 to 60 turns) but little within a task get a
    difficulty sigma well above 0 (the sessions used to fit 0.000 for lack of a task)."""
    from gyre.traces.workload_fit import WorkloadFitOptions, fit_workload

    d = tmp_path / "runs"
    for t, n in enumerate([3, 5, 8, 12, 18, 25, 35, 45, 60, 4, 6, 10, 15, 22, 30, 40]):
        for r in range(4):
            turns = n + r % 2
            calls = [(100 + 50 * i, 10, 2.0 * i, 0.5) for i in range(turns)]
            write(d / f"task{t}.{r}.traj.json", mini_traj(f"task{t}", calls, t0=1e9 + 100 * t + r))
    tr = load_trace(d, grouping=Grouping(groups_per_step=4))
    cw = fit_workload(tr, WorkloadFitOptions(split=0.75, model_draws=20_000))
    assert cw.scale_target == "turns" and cw.difficulty_sigma > 0.5, cw.difficulty_sigma
    assert cw.report["difficulty"] == "fitted from 12 of 12 tasks with two runs or more", cw.report["difficulty"]
    assert math.isfinite(cw.report["quality"]["turns"]["ks_d"]), cw.report["quality"]
