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
                         "--workload", "--trace-out", "--engine", "--faults", "--checkpoint-every"}, sorted(run_flags)
    compare_flags = {o for p in cmd.commands["compare"].params for o in p.opts}
    assert compare_flags == {"--preset", "-p", "--gpus", "--steps", "--seed", "--policy", "--out", "-o",
                             "--engine", "--faults", "--checkpoint-every", "--ray"}, sorted(compare_flags)


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
    """At the 140 columns `make demo` prints to, the result table elides nothing: each row's split, cap and eta
    and every figure appear whole (the demo's table once read `async(et…` and `12.…`)."""
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
    for piece in ("async(eta=0,", "max_running=4,", "rollout_gpus=35)", "elastic(eta=0,", "max_running=2)",
                  "13.04 h", "12.74 h", "0.957x", "1.000x", "0.248x", "54M", "11,981"):
        assert piece in cells, f"{piece!r} not whole in:\n{text}"
