"""The one output writer of both backends: a results folder for a set of runs.

Every run folder holds summary.csv and summary.json (one row per run: the table the caller made),
steps_<run>.csv, staleness_<run>.csv and utilization_<run>.parquet (each run's gyre.metrics frames,
tagged with the run's name), role_timeline.png and utilization.png. A backend adds its own files next to
them (the simulator its sweep and GPU-hours figure, the real backend traces, profiles and learning curves).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from gyre import plots
from gyre.metrics import RunMetrics


@dataclass(frozen=True, kw_only=True)
class RunOutput:
    name: str  # file suffix and the `policy` column
    label: str  # the run's title in the role timeline
    log: list[tuple]
    metrics: RunMetrics


def write_outputs(out: Path, runs: Sequence[RunOutput], table: pd.DataFrame, *, preset: str, seed: int,
                  n_gpus: int) -> dict[str, Path]:
    """Write the files every run folder has; returns their paths (summary, timeline, utilization)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary": out / "summary.csv"}
    table.to_csv(paths["summary"], index=False)
    (out / "summary.json").write_text(json.dumps({"preset": preset, "seed": seed,
                                                  "results": table.to_dict(orient="records")}, indent=2, default=float))
    for r in runs:
        r.metrics.steps.assign(policy=r.name).to_csv(out / f"steps_{r.name}.csv", index=False)
        r.metrics.utilization.assign(policy=r.name).to_parquet(out / f"utilization_{r.name}.parquet", index=False)
        r.metrics.staleness.assign(policy=r.name).to_csv(out / f"staleness_{r.name}.csv", index=False)
    paths["timeline"] = plots.role_timelines([(r.label, r.log, n_gpus, r.metrics.makespan_s) for r in runs],
                                             out / "role_timeline.png")
    paths["utilization"] = plots.utilization([(r.name, r.metrics.utilization) for r in runs], n_gpus,
                                             out / "utilization.png")
    return paths
