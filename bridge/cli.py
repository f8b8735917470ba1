"""The `gyre-real` command: `run` (gyre.real.cli) plus `calibrate`, which calibrates the simulator's cost
model on one real run's profile and predicts (and compares) other policies' real makespans.

It lives in the bridge because `calibrate` runs the simulator: gyre.real never imports gyre.sim.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from gyre.real.cli import app, console, fail


@app.command()
def calibrate(
    run_dir: Annotated[Path, typer.Argument(help="output folder of a `gyre-real run`")],
    source: Annotated[str, typer.Option("--from", help="policy whose profile calibrates the simulator")],
    predict: Annotated[list[str], typer.Option("--predict", help="policies to predict (repeatable)")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="write predictions CSV here")] = None,
    workload: Annotated[str, typer.Option(
        help="rollouts to replay: 'source' (the --from run's; no other run needed) or 'own' (each predicted "
             "policy's measured trace: the cost model's error alone)")] = "source",
    estimate_out: Annotated[Optional[Path], typer.Option(
        "--estimate-out", help="write the calibrated cost estimate here ([cluster] estimate of a real run reads it)")] = None,
) -> None:
    """Calibrate the simulator's cost model on one real run; predict (and compare) other policies."""
    from gyre.bridge.cost_fit import CostFitError, fitted_costs, describe, predict_makespans

    try:
        calibrated = fitted_costs(run_dir, source)
        table = predict_makespans(run_dir, source, predict, workload=workload, calibrated=calibrated)
    except CostFitError as exc:
        fail(str(exc))
        raise
    console.print(f"calibrated on {source}: {describe(calibrated[0])}", soft_wrap=True)
    if estimate_out:
        from gyre.estimate import from_costs, write_file

        write_file(from_costs(calibrated[0], source=f"calibrated on {run_dir} ({source})"), estimate_out)
        console.print(f"wrote the cost estimate to {estimate_out}")
    console.print(table.to_string(index=False))
    if out:
        table.to_csv(out, index=False)
        console.print(f"wrote {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
