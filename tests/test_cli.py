"""gyre-sim: user errors exit 2 with one line; runs write their outputs; the flag set is frozen."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gyre.sim.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "--policy", "nope"], "unknown policy 'nope'"),
        (["run", "--preset", "nope"], "unknown preset 'nope'"),
        (["run", "--gpus", "0"], "cluster.gpus must be >= 1"),
        (["run", "--policy", "async", "--eta", "-1"], "eta must be >= 0"),
        (["run", "--steps", "0"], "steps must be >= 1"),
        (["compare", "--policy", "nope"], "unknown policy 'nope'"),
        (["run", "--policy", "no.such.module:Policy"], "cannot load policy"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle):
    """Unknown policy/preset and impossible configs give exit code 2 and a single error line."""
    res = runner.invoke(app, args)
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.output
    assert "Traceback" not in res.output


def test_run_writes_outputs(tmp_path):
    """`gyre-sim run` writes a summary, per-step CSV and figures."""
    res = runner.invoke(app, ["run", "--policy", "async", "--preset", "short-math", "--steps", "2", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for name in ("summary.csv", "summary.json", "steps_async.csv", "role_timeline.png", "utilization.png"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_flag_set_is_frozen():
    """The CLI surface does not sprawl: the commands and run's flags are exactly these."""
    import typer.main

    cmd = typer.main.get_command(app)
    assert set(cmd.commands) == {"run", "compare", "presets", "calibrate", "replay", "calibrate-engine"}, sorted(cmd.commands)
    run_flags = {o for p in cmd.commands["run"].params for o in p.opts}
    assert run_flags == {"--policy", "--preset", "-p", "--gpus", "--steps", "--seed", "--eta", "--out", "-o",
                         "--workload", "--trace-out", "--engine", "--faults", "--checkpoint-every"}, sorted(run_flags)
    compare_flags = {o for p in cmd.commands["compare"].params for o in p.opts}
    assert compare_flags == {"--preset", "-p", "--gpus", "--steps", "--seed", "--policy", "--out", "-o",
                             "--engine", "--faults", "--checkpoint-every"}, sorted(compare_flags)
