"""gyre-real: the command set and each command's flags are frozen (the interface does not sprawl)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")


def test_flag_set_is_frozen():
    """gyre-real has exactly `run` and `calibrate`, with exactly these flags."""
    import typer.main

    from gyre.bridge.cli import app

    cmd = typer.main.get_command(app)
    assert set(cmd.commands) == {"run", "calibrate"}, sorted(cmd.commands)
    run_flags = {o for p in cmd.commands["run"].params for o in p.opts}
    assert run_flags == {"--policy", "--preset", "-p", "--config", "-c", "--steps", "--address", "--seed", "--out",
                         "-o", "--faults", "--checkpoint-every"}, sorted(run_flags)
    cal_flags = {o for p in cmd.commands["calibrate"].params for o in p.opts}
    assert cal_flags == {"run_dir", "--from", "--predict", "--out", "-o", "--workload", "--estimate-out"}, \
        sorted(cal_flags)
