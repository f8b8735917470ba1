"""Benchmark: calibrate and replay a 1M-execution request trace (wall time and peak memory per phase).

The trace is the Azure code trace resampled (seeded) to N rows with increasing timestamps. Phases:
`calibrate` and `replay` call the library (read + fit, read + simulate + metrics + bound);
`calibrate-cli` and `replay-cli` run the `gyre-sim` commands a user runs (outputs and figures included).
Each phase runs in its own process, so its peak RSS and CPU time are its own (os.wait4). CPU time (user + sys) is
reported beside wall time because a shared machine's wall time says more about its load than about
the code: on a loaded machine wall time is a multiple of CPU time, on a quiet one the two are close.
Targets: `gyre-sim replay` under 30 s, `gyre-sim calibrate` under 15 s, each under 4 GiB.

    .venv/bin/python benchmarks/bench_traces.py [--rows 1000000] [--repeat 3] [--policy colocate]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AZURE = "/work/shared/data/azure_llm_inference_2023_code.csv"


def make_trace(path: Path, rows: int, seed: int = 0) -> None:
    import numpy as np
    import pandas as pd

    d = pd.read_csv(AZURE)
    idx = np.random.default_rng(seed).integers(0, len(d), rows)
    out = pd.DataFrame({"TIMESTAMP": np.arange(rows) * 0.01, "ContextTokens": d.ContextTokens.values[idx],
                        "GeneratedTokens": d.GeneratedTokens.values[idx]})
    out.to_csv(path, index=False)


def phase(name: str, trace: str, policy: str, steps: int) -> None:
    from gyre.traces.readers import Grouping, read_request_csv

    t0 = time.perf_counter()
    tr = read_request_csv(trace, grouping=Grouping(group_size=8, groups_per_step=128))
    t_read = time.perf_counter() - t0
    import gc

    gc.freeze()  # the trace lives for the whole run: keep the collector from rescanning it
    if name == "calibrate":
        from gyre.traces.workload_fit import WorkloadFitOptions, fit_workload

        cw = fit_workload(tr, WorkloadFitOptions(split=0.7))
        q = cw.report["quality"]["gen"]
        extra = f"ks_d={q['ks_d']:.4f} p99_err={q['p99_err']:.3f} maxk_err={q['maxk_err']:.3f}"
    else:
        import dataclasses

        from gyre.config import override
        from gyre.presets import get_preset
        from gyre.sim.cli.traces import trace_workload
        from gyre.sim.harness.runner import simulate
        from gyre.workload import ReplaySource

        w = trace_workload(tr)
        whole = len(tr.groups) // w.groups_per_step
        cfg = override(dataclasses.replace(get_preset("short-math"), workload=w), steps=min(steps or whole, whole))
        r = simulate(cfg, policy, source=ReplaySource(tr.groups, w))
        extra = f"steps={cfg.steps} executions={cfg.steps * w.groups_per_step * w.group_size} " \
                f"makespan_s={r.makespan_s:.1f} sim_wall_s={r.wall_s:.1f} events={r.events}"
    print(f"read_s={t_read:.2f} total_s={time.perf_counter() - t0:.2f} {extra}", flush=True)


def _command(name: str, trace: Path, a, tmp: Path) -> list[str]:
    """The library phase (this script, in a child), or the CLI a user runs (`-cli`: outputs included)."""
    cli = str(Path(sys.executable).with_name("gyre-sim"))
    if name == "calibrate-cli":
        return [cli, "calibrate", str(trace), "-o", str(tmp / "workload.json"), "--group-size", "8",
                "--groups-per-step", "128"]
    if name == "replay-cli":
        steps = ["--steps", str(a.steps)] if a.steps else []
        return [cli, "replay", str(trace), "--policy", a.policy, "--preset", "short-math", "--group-size", "8",
                "--groups-per-step", "128", "--out", str(tmp / "replay"), *steps]
    return [sys.executable, __file__, "--phase", name, "--trace", str(trace), "--policy", a.policy,
            "--steps", str(a.steps)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--policy", default="colocate")
    ap.add_argument("--steps", type=int, default=0, help="replay steps (0: every whole batch)")
    ap.add_argument("--phases", default="calibrate,replay,calibrate-cli,replay-cli",
                    help="calibrate/replay: the library calls; calibrate-cli/replay-cli: the gyre-sim commands")
    ap.add_argument("--phase", default=None)
    ap.add_argument("--trace", default=None)
    a = ap.parse_args()
    if a.phase:
        return phase(a.phase, a.trace, a.policy, a.steps)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "big.csv"
        make_trace(trace, a.rows)
        for name in a.phases.split(","):
            walls, peaks, cpus = [], [], []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                p = subprocess.Popen(_command(name, trace, a, Path(tmp)))
                _, status, ru = os.wait4(p.pid, 0)
                walls.append(time.perf_counter() - t0)
                peaks.append(ru.ru_maxrss / 2**20)  # KiB -> GiB
                cpus.append(ru.ru_utime + ru.ru_stime)
                if status != 0:
                    sys.exit(f"{name} failed")
            print(f"{name}: rows={a.rows} wall median {statistics.median(walls):.1f} s "
                  f"(runs {', '.join(f'{w:.1f}' for w in walls)}), CPU median {statistics.median(cpus):.1f} s, "
                  f"peak RSS median {statistics.median(peaks):.2f} GiB")


if __name__ == "__main__":
    main()
