"""gyre-sim calibrate / replay / run --trace-out --workload: exit codes and one-line errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from gyre.sim.cli.app import app

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
    assert "nan" not in r.output and "0.00 h" not in r.output, f"no NaN for a policy not run, no 0.00 h: {r.output}"
    unit = "h" if made >= 3600 else "min" if made >= 60 else "s"
    assert f" {unit} " in r.output, f"the makespan {made} s is printed in {unit}: {r.output}"
    r = runner.invoke(app, ["calibrate", str(trace), "-o", str(w), "--split", "0.5"])
    assert r.exit_code == 0 and w.exists(), r.output
    r = runner.invoke(app, ["run", "--preset", "short-math", "--steps", "1", "--workload", str(w),
                            "--out", str(tmp_path / "cal")])
    assert r.exit_code == 0, r.output
    assert "calibrated" in r.output, "the run uses the calibrated workload"


def test_calibrate_and_replay_flag_sets_are_frozen():
    """calibrate and replay take exactly these flags (the trace-reading ones are shared)."""
    import typer.main

    cmd = typer.main.get_command(app)
    reading = {"--format", "--skip-bad", "--group-size", "--groups-per-step", "--time-field", "--input-field",
               "--output-field", "--sessions-field", "--tool-field", "--time-unit", "--tool-unit", "--task-field"}
    cal = {o for p in cmd.commands["calibrate"].params for o in p.opts if o.startswith("-")}
    assert cal == reading | {"--out", "-o", "--split", "--cap", "--k", "--figures", "--seed", "--drift",
                            "--recent"}, sorted(cal)
    rep = {o for p in cmd.commands["replay"].params for o in p.opts if o.startswith("-")}
    assert rep == reading | {"--policy", "--preset", "-p", "--gpus", "--steps", "--out", "-o", "--engine",
                             "--faults", "--checkpoint-every", "--partial", "--rows"}, sorted(rep)


def _requests(path, n=400):
    rows = ({"timestamp": i, "input_length": 100 + 7 * (i % 13), "output_length": 5 + i % 17} for i in range(n))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_calibrate_report_lines(tmp_path):
    """The report names the drift decision, the stationarity test, the targets with their marks, fit and held-out
    KS D side by side with a perfect model's, and a verdict; --split 1.0 says nothing is held out."""
    p = _requests(tmp_path / "r.jsonl")
    r = runner.invoke(app, ["calibrate", str(p), "-o", str(tmp_path / "w.json")])
    assert r.exit_code == 0, r.output
    out = r.output.replace("\n", " ")
    for piece in ("batches of arrivals", "stationarity: stationary", "KS fit", "KS held", "KS perfect", "KS data",
                  "max-of-K err", "targets: KS D <= 0.10", "verdict: every quantity meets the targets", " ok "):
        assert piece in out, f"{piece!r} not in the report:\n{r.output}"
    assert "Warning" not in r.output and "nan" not in r.output, r.output
    r = runner.invoke(app, ["calibrate", str(p), "-o", str(tmp_path / "w.json"), "--split", "1.0"])
    assert r.exit_code == 0 and "no held-out data (--split 1.0)" in r.output, r.output
    assert "KS held" not in r.output, "no empty table"


def test_calibrate_bad_options_exit_2(tmp_path):
    """An unknown drift mode or time unit, or a wrong --format, is one line and exit code 2."""
    p = _requests(tmp_path / "r.jsonl", 20)
    for args, needle in ((["--drift", "sometimes"], "unknown drift mode 'sometimes'"),
                         (["--time-unit", "fortnight"], "unknown time unit 'fortnight'"),
                         (["--format", "sessions"], "(read as sessions, given with --format)")):
        r = runner.invoke(app, ["calibrate", str(p), "-o", str(tmp_path / "w.json"), *args])
        assert r.exit_code == 2 and needle in r.output.replace("\n", ""), (args, r.output)
        assert "Traceback" not in r.output, r.output


def test_sessions_options_on_the_command_line(tmp_path):
    """--sessions-field, --tool-field, --tool-unit and --time-unit read a session trace named otherwise."""
    p = tmp_path / "s.jsonl"
    lines = [json.dumps({"t": i * 10**9, "calls": [{"input_toks": 100, "output_toks": 5 + i % 7, "wait_ms": 250},
                                                   {"input_toks": 130, "output_toks": 3}]}) for i in range(300)]
    p.write_text("\n".join(lines) + "\n")
    r = runner.invoke(app, ["calibrate", str(p), "-o", str(tmp_path / "w.json"), "--format", "sessions",
                            "--sessions-field", "calls", "--tool-field", "wait_ms", "--tool-unit", "ms",
                            "--time-field", "t", "--time-unit", "ns"])
    assert r.exit_code == 0, r.output
    w = json.loads((tmp_path / "w.json").read_text())
    assert w["dists"]["tool_s"]["floor"] == 0.25, "the shortest tool time seen is 250 ms = 0.25 s"
    assert w["report"]["executions"] == 300, "every session read"
