"""gyre-sim: user errors exit 2 with one line; runs write their outputs; the flag set is frozen."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gyre.sim.cli.app import app

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
        (["run", "--set", "cluster.cell_gpus=7"], "cluster.cell_gpus=7 cannot hold the core's training state"),
        (["run", "--set", "cluster.cell_gpus=24"], "cluster.cell_gpus=24 must divide the 64 GPUs"),
        (["run", "--set", "cluster.standalone_gpus=16", "--set", "cluster.cell_gpus=32"], "must divide the 48 GPUs"),
        (["run", "--set", "workload.steps_per_burst=0"], "workload.steps_per_burst must be an integer >= 1"),
        (["run", "--set", "cluster.cell_gpus"], "expected KEY=VALUE"),
        (["run", "--set", "nope.streaming=true"], "unknown policy 'nope'"),
        # async's ordered admission left the core (experiments/LOG.md, 2026-12-05): its knobs are unknown fields
        (["run", "--set", "async.predictor=history"], "policy_params.async: policy 'async' has no parameter 'predictor'"),
        (["run", "--set", "async.lookahead=2"], "policy_params.async: policy 'async' has no parameter 'lookahead'"),
        (["run", "--steps", "1", "--j-max", "0"], "SamplingConfig.j_max must be an integer >= 1"),
        (["run", "--role-priority", "main,boss,sub-agent,sub-agent-summary"], "unknown role 'boss'"),
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
                         "--workload", "--trace-out", "--engine", "--faults", "--checkpoint-every", "--set", "--j-max", "--role-priority"}, sorted(run_flags)
    compare_flags = {o for p in cmd.commands["compare"].params for o in p.opts}
    assert compare_flags == {"--preset", "-p", "--gpus", "--steps", "--seed", "--policy", "--out", "-o",
                             "--engine", "--faults", "--checkpoint-every", "--ray", "--set", "--rows", "--j-max", "--role-priority"}, sorted(compare_flags)


def test_presets_lists_models_with_kv_and_state_bytes():
    """`gyre-sim presets` lists every model with its full / linear layers, KV bytes per token and state bytes per
    sequence: Qwen3-Next 12 / 36, 2 x 12 x 2 x 256 x 2 B = 24,576 and 36 x (32 x 128^2 + 3 x 8,192) x 2 B."""
    res = runner.invoke(app, ["presets"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in res.output.splitlines() if line.count("│") == 6}
    assert rows["qwen3-next-80b-a3b"][1:] == ["48 (12 / 36)", "24,576", "39,518,208"], rows["qwen3-next-80b-a3b"]
    assert rows["moe-2.4t-a95b"][1:] == ["92 (23 / 69)", "23,552", "299,581,440"], rows["moe-2.4t-a95b"]
    assert rows["moe-2.4t-a95b-gqa"][1:] == ["96 (96 / 0)", "196,608", "0"], rows["moe-2.4t-a95b-gqa"]
    assert "xlong-swe-kv" in res.output and "moe-2.4t-a95b-gqa" in res.output


def test_result_table_prints_every_config_and_figure_in_full(monkeypatch):
    """At the 140 columns `make demo` prints to, the result table elides nothing and wraps no row: each row's
    config is one line under it, every figure whole (the demo's table once read `async(et…` and `12.…`)."""
    import pandas as pd
    from rich.console import Console

    from gyre.sim.cli import console as out

    rec = Console(width=140, record=True, file=open("/dev/null", "w"))
    monkeypatch.setattr(out, "console", rec)
    row = dict(engine_limit=4, speedup_vs_colocate=0.957, speedup_vs_async_same_eta=1.0, speedup_vs_best=0.248,
               equal_work=True, deadline_hit=0, sched_cuts=0, tokens_generated=54.2e6, preemptions=11_981,
               staleness_max=0, executions=1024, bound_s=6336.0, tuned="hindsight, 14 at eta 0")
    table = pd.DataFrame([
        {**row, "policy": "async-eta0", "config": "async(eta=0,max_running=4,rollout_gpus=35)", "makespan_s": 46_944.0},
        {**row, "policy": "elastic-eta0", "config": "elastic(eta=0,max_running=2)", "makespan_s": 45_864.0},
    ])
    out.print_table(table, "demo")
    text = rec.export_text()
    assert "…" not in text, text
    cells = " ".join(c.strip() for line in text.splitlines() for c in line.split("│"))
    for piece in ("async(eta=0,max_running=4,rollout_gpus=35)", "elastic(eta=0,max_running=2)",
                  "13.04 h", "12.74 h", "0.957x", "1.000x", "0.248x", "54.2M", "11,981"):
        assert piece in cells, f"{piece!r} not whole in:\n{text}"
    table_lines = [line for line in text.splitlines() if "│" in line]
    assert len(table_lines) == 2, f"one line per row (no wrapped config):\n{text}"


@pytest.mark.parametrize("n, text", [(812, "812"), (200_499, "200.5K"), (54.2e6, "54.2M"), (3_210_000, "3.21M"),
                                     (1.05e9, "1.05B"), (999, "999"), (12_345, "12.3K")])
def test_token_counts_print_with_units(n, text):
    """Token counts print in K/M/B with a decimal: 200,499 is 200.5K, never '0M'."""
    from gyre.sim.cli.console import tokens

    assert tokens(n) == text, f"{n} printed as {tokens(n)!r}"


def test_requested_rows_keeps_one_row_per_named_policy():
    """--rows requested keeps the named policies' rows only: a baseline's tuned-over-eta row, and for a policy
    searched per eta its fastest equal-work eta row; pilots and other etas go."""
    import pandas as pd

    from gyre.sim.harness.compare import requested_rows

    t = pd.DataFrame({"policy": ["async", "async-eta0", "async-eta1", "async-pilot", "elastic-eta0", "elastic-eta1",
                                 "colocate"],
                      "makespan_s": [10.0, 12, 10, 11, 9, 8, 20], "equal_work": [True] * 5 + [False, True]})
    got = list(requested_rows(t, ["async", "elastic"])["policy"])
    assert got == ["async", "elastic-eta0"], f"rows kept: {got} (elastic-eta1 does unequal work)"
    got = list(requested_rows(t, None)["policy"])
    assert got == ["async", "elastic-eta0", "colocate"], f"rows kept with no policy named: {got}"
