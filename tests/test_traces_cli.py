"""gyre-sim calibrate / replay / run --trace-out --workload: exit codes and one-line errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from gyre.sim.cli import app

runner = CliRunner()


def test_bad_trace_exits_2_with_file_line(tmp_path):
    """A malformed line is one error line naming file:line, exit code 2, no traceback."""
    p = tmp_path / "r.jsonl"
    p.write_text('{"timestamp": 1, "input_length": 3, "output_length": 4}\n{oops\n')
    r = runner.invoke(app, ["calibrate", str(p), "-o", str(tmp_path / "w.json")])
    assert r.exit_code == 2, f"exit {r.exit_code}: {r.output}"
    assert f"{p}:2: invalid JSON" in r.output.replace("\n", ""), r.output
    assert "Traceback" not in r.output, "no traceback for a user error"


def test_run_trace_out_then_replay_same_makespan(tmp_path):
    """`run --trace-out` then `replay --policy` of that trace reports the run's makespan."""
    trace, w = tmp_path / "t.jsonl", tmp_path / "w.json"
    r = runner.invoke(app, ["run", "--preset", "short-math", "--steps", "1", "--policy", "colocate",
                            "--out", str(tmp_path / "run"), "--trace-out", str(trace)])
    assert r.exit_code == 0, r.output
    made = json.loads(trace.read_text().splitlines()[0])["run"]["makespan_s"]
    r = runner.invoke(app, ["replay", str(trace), "--policy", "colocate", "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    got = json.loads((tmp_path / "rep" / "summary.json").read_text())["results"][0]["makespan_s"]
    assert got == made, f"replayed makespan {got} != recorded {made}"
    r = runner.invoke(app, ["calibrate", str(trace), "-o", str(w), "--split", "0.5"])
    assert r.exit_code == 0 and w.exists(), r.output
    r = runner.invoke(app, ["run", "--preset", "short-math", "--steps", "1", "--workload", str(w),
                            "--out", str(tmp_path / "cal")])
    assert r.exit_code == 0, r.output
    assert "calibrated" in r.output, "the run uses the calibrated workload"
