"""gyre-sim calibrate / replay on agent trajectories and small traces: task groups in one command each, the
partial-step stop, warnings and bad input (one line on stderr, exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gyre.sim.cli.app import app
from tests.test_agent_logs import mini_traj, write

runner = CliRunner()


def _runs(folder, tasks=8, runs=3):
    for t in range(tasks):
        for r in range(runs):
            n = 2 + t + r % 2
            write(folder / f"t{t}.{r}.traj.json",
                  mini_traj(f"task-{t}", [(200 + 40 * i, 20 + i, 3.0 * i, 0.5 + 0.1 * i) for i in range(n)],
                            t0=1e9 + 60 * t + r))
    return folder


def test_folder_calibrates_and_replays_with_task_groups(tmp_path):
    """A folder of mini-swe-agent runs calibrates in one command and replays in one command, one group per task
    (3 runs each), the title counting the executions replayed."""
    d = _runs(tmp_path / "runs")
    r = runner.invoke(app, ["calibrate", str(d), "-o", str(tmp_path / "w.json"), "--split", "0.75"])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "w.json").read_text())["report"]
    assert rep["executions"] == 24 and rep["scale_target"] == "turns", rep["executions"]
    r = runner.invoke(app, ["replay", str(d), "--policy", "colocate", "--groups-per-step", "4", "--preset",
                            "short-math", "-o", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    assert "replay of runs: 24 of 24 executions (8 groups, 2 steps)" in r.output.replace("\n", " "), r.output


def _sessions(path, n):
    path.write_text("".join(json.dumps({"timestamp": i, "requests": [{"input_toks": 100, "output_toks": 5,
                                                                       "tool_duration_ns": 10**9},
                                                                      {"input_toks": 120, "output_toks": 7}]}) + "\n"
                            for i in range(n)))
    return path


def test_replay_smaller_than_one_step_stops_with_counts(tmp_path):
    """198 sessions against 64 groups x 8 stop with the counts and the flags that fit (exit 2, stderr); with
    --partial they run as one step and the title counts the 198 replayed."""
    p = _sessions(tmp_path / "s.jsonl", 198)
    r = runner.invoke(app, ["replay", str(p), "--policy", "colocate", "--preset", "short-math",
                            "-o", str(tmp_path / "rep")])
    assert r.exit_code == 2, r.output
    err = r.stderr.replace("\n", "")
    assert (f"{p}: 198 executions fill no step of 64 groups x 8 (512); --groups-per-step 25 (1 steps) or "
            "--groups-per-step 12 (2 steps) or --groups-per-step 6 (4 steps) with --group-size 8 fits it, or "
            "--partial runs them as one partial step") in err, r.stderr
    assert r.stdout == "", f"nothing on stdout: {r.stdout!r}"
    r = runner.invoke(app, ["replay", str(p), "--policy", "colocate", "--preset", "short-math", "--partial",
                            "-o", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    assert "replay of s.jsonl: 198 of 198 executions (25 groups, 1 steps)" in r.stdout.replace("\n", " "), r.stdout
    assert "running it as one partial step" in r.stderr, r.stderr


def test_a_tiny_trace_is_warned_about(tmp_path):
    """Three executions calibrate with a warning on stderr that so few say little."""
    p = _sessions(tmp_path / "s.jsonl", 3)
    r = runner.invoke(app, ["calibrate", str(p), "-o", str(tmp_path / "w.json"), "--split", "1.0"])
    assert r.exit_code == 0, r.output
    assert "holds only 3 executions" in r.stderr, r.stderr


@pytest.mark.parametrize("name, text, needle", [
    ("r.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,-3,5\n", "r.csv:2: bad ContextTokens -3 (an integer >= 0)"),
    ("r.csv", "TIMESTAMP,Context,GeneratedTokens\n1,3,5\n",
     "missing column 'ContextTokens' (header has TIMESTAMP, Context, GeneratedTokens; --time-field, --input-field "
     "and --output-field name the columns)"),
    ("r.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,3,12.0\n", "r.csv:2: bad GeneratedTokens '12.0'"),
    ("r.jsonl", '{"timestamp": 1, "input_length": "7", "output_length": 3}\n',
     "r.jsonl:1: bad input_length '7' is a string; write it as a JSON number"),
    ("r.jsonl", '{"timestamp": 1, "input_length": 7, "output_length": 12.0}\n',
     "r.jsonl:1: bad output_length 12.0 is a float"),
    ("s.jsonl", '{"requests": [{"input_toks": "7", "output_toks": 3}]}\n', "s.jsonl:1: invalid session: sub-request 0: "
                                                                          "bad input_toks '7'"),
    ("t.jsonl", '{"gyre_trace": 1, "workload": null, "run": {}}\n{"exec": 0, "group": 0, "task": 0, "step": 0, '
                '"prompt": 5, "segments": [{"gen": 3, "kv": 5, "tool_s": 1.0, "tool_out": 2}, {"gen": 0, "kv": 10}]}\n',
     "t.jsonl:2: segments[1]: field 'gen' must be an integer >= 1, got 0"),
])
def test_bad_input_is_one_line_on_stderr(tmp_path, name, text, needle):
    """Each bad input of the issue is one line on stderr naming file, line and field (and segment), exit 2: no numpy
    repr (np.int64), string and float token counts refused, a missing column names the --*-field flags."""
    p = tmp_path / name
    p.write_text(text)
    r = runner.invoke(app, ["calibrate", str(p), "-o", str(tmp_path / "w.json")])
    assert r.exit_code == 2, r.output
    err = r.stderr.replace("\n", "")
    assert needle in err and "np." not in err and "Traceback" not in r.output, r.stderr
    assert r.stdout == "", f"errors go to stderr: {r.stdout!r}"


def test_a_folder_of_other_files_is_one_line(tmp_path):
    """A folder given where a trace file is expected: one line, no raw [Errno 21]."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "notes.txt").write_text("hi")
    r = runner.invoke(app, ["calibrate", str(d), "-o", str(tmp_path / "w.json")])
    assert r.exit_code == 2 and "a folder with no agent trajectory files" in r.stderr, r.output
    assert "Errno" not in r.output, r.output
