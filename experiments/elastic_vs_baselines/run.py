"""Colocate vs best-tuned async vs elastic vs the lower bound, on xlong-swe (1,024 H200s, the 2.4T MoE)
and short-math: the comparison of the paper this project follows.

Protocol: async is tuned by a sweep over its rollout GPUs R (multiples of the engine size leaving
>= min_train_gpus to train), eta in {0, 1, 2, 4} and its per-engine cap (the engine's admission limit and its
halvings, as `gyre-sim compare` searches it); elastic is swept over the same etas and caps (Elastic.grid). To keep
the sweep affordable the selection runs use `--select-steps` steps of the same workload (same seed);
the chosen configurations are then run for the full `--steps`. Outputs (results/):
- {preset}_selection.csv: every selection run;
- {preset}_table.csv: makespan, speedup over colocate and best async, distance to the bound (bound_s:
  work and critical path, any policy; bound_eta_s: with the staleness term at the row's eta), utilization, GPU-hours by role, migrations, reallocations, simulation wall time;
- {preset}_timeline.png (GPU role per policy), {preset}_breakdown.png (GPU-hours by role and
  per-step durations).

Usage: python experiments/elastic_vs_baselines/run.py [--preset xlong-swe] [--steps 48] [--jobs 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from gyre import plots
from gyre.config import override
from gyre.presets import get_preset
from gyre.policies.elastic import Elastic
from gyre.policies.tuning import fastest_at_equal_work, halvings
from gyre.sim.harness.compare import shape_of
from gyre.sim.harness.runner import simulate
from gyre.sim.harness.sweep import RAY_HELP, progress_lines, run_map

HERE = Path(__file__).resolve().parent
ETAS = (0, 1, 2, 4)


SMOKE = {"cluster.gpus": 8, "workload.groups_per_step": 4}  # --smoke: a tiny cluster, for the test suite


def base_config(preset: str, smoke: bool, steps: int | None = None):
    """The preset (at `steps` if given), shrunk to SMOKE's cluster and batch with `smoke`."""
    cfg = override(get_preset(preset), **(SMOKE if smoke else {}), **({"steps": steps} if steps else {}))
    return cfg.validate()


def run_one(job: tuple[str, int, str, dict, bool]) -> dict:
    """One simulation; returns the summary row plus the small pieces the figures need."""
    preset, steps, policy, params, smoke = job
    cfg = base_config(preset, smoke, steps)
    r = simulate(cfg, policy, params)
    s = r.metrics.summary()
    return {
        **s,
        "params": repr(params),
        "bound_s": max(r.bound.work_s, r.bound.critical_path_s),  # any policy, any eta
        "bound_eta_s": r.bound.makespan_s,  # with the staleness term at this policy's eta
        "bound_work_s": r.bound.work_s,
        "bound_critical_path_s": r.bound.critical_path_s,
        "wall_s": r.wall_s,
        "events": r.events,
        "n_gpus": cfg.cluster.gpus,
        "_roles": [rec for rec in r.log if rec[0] == "role"],
        "_steps": r.metrics.steps[["version", "duration_s"]].to_dict("list"),
    }


def async_grid(preset: str, smoke: bool = False) -> list[dict]:
    """Four rollout splits x every eta x every per-engine cap compare's search tries (the engine's admission
    limit, omitted, and its halvings: policies.tuning.halvings)."""
    cfg = base_config(preset, smoke)
    c = cfg.costs()
    per, n = c.engine_gpus, cfg.cluster.gpus
    rs = [r for r in range(per, n - c.min_train_gpus + 1, per)]
    if len(rs) > 4:  # the top of the range and three evenly spread points below it
        rs = sorted({rs[-1], rs[(3 * len(rs)) // 4], rs[len(rs) // 2], rs[len(rs) // 4]})
    limit = shape_of(cfg).admit_limit
    caps = [{}] + [{"max_running": k} for k in (halvings(limit)[1:] if limit else [])]
    return [dict(rollout_gpus=r, eta=e, **k) for r in rs for e in ETAS for k in caps]


def elastic_grid(preset: str, smoke: bool = False) -> list[dict]:
    """Elastic's own search grid (policies.elastic.Elastic.grid: every eta at every cap async tries)."""
    return Elastic.grid(shape_of(base_config(preset, smoke)), ETAS)


def run_jobs(jobs, n_jobs: int, ray: str | None = None) -> list[dict]:
    return run_map(run_one, jobs, workers=n_jobs, ray=ray, on_done=progress_lines(len(jobs), "runs"))


def _fastest(runs: pd.DataFrame) -> dict:
    """The params of the fastest of `runs` (summary rows) among those doing equal work (policies.tuning)."""
    i = fastest_at_equal_work(list(runs["makespan_s"]), list(runs.get("sched_cuts", [0] * len(runs))),
                              int(runs["executions"].max()) if "executions" in runs else 0)
    return eval(runs.iloc[i]["params"])


def public(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="xlong-swe")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--select-steps", type=int, default=12)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ray", default=None, help=RAY_HELP)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--reuse-selection", action="store_true", help="read {preset}_selection.csv instead of rerunning it")
    ap.add_argument("--smoke", action="store_true", help="the preset on 8 GPUs, 4 groups a step (the test suite's run)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    sel_jobs = [(a.preset, a.select_steps, "async", p, a.smoke) for p in async_grid(a.preset, a.smoke)]
    sel_jobs += [(a.preset, a.select_steps, "elastic", p, a.smoke) for p in elastic_grid(a.preset, a.smoke)]
    if a.reuse_selection:
        sel = pd.read_csv(a.out / f"{a.preset}_selection.csv")
    else:
        sel = public(run_jobs(sel_jobs, a.jobs, a.ray))
        sel.to_csv(a.out / f"{a.preset}_selection.csv", index=False)
    best = {pol: _fastest(sel[sel.policy == pol]) for pol in ("async", "elastic")}
    print(f"selection done in {time.perf_counter() - t0:.0f}s: {best}", flush=True)

    final = [(a.preset, a.steps, "colocate", {}, a.smoke), (a.preset, a.steps, "async", best["async"], a.smoke),
             (a.preset, a.steps, "elastic", best["elastic"], a.smoke)]
    rows = run_jobs(final, a.jobs, a.ray)
    table = public(rows)
    colo, asy = table.iloc[0], table.iloc[1]
    table["speedup_vs_colocate"] = colo.makespan_s / table.makespan_s
    table["speedup_vs_best_async"] = asy.makespan_s / table.makespan_s
    table["makespan_over_bound"] = table.makespan_s / table.bound_s
    table["makespan_over_eta_bound"] = table.makespan_s / table.bound_eta_s
    table["wall_over_colocate"] = table.wall_s / colo.wall_s
    bound = {"policy": "lower bound", "makespan_s": table.bound_s.iloc[0], "params": "",
             "speedup_vs_colocate": colo.makespan_s / table.bound_s.iloc[0],
             "speedup_vs_best_async": asy.makespan_s / table.bound_s.iloc[0], "makespan_over_bound": 1.0}
    table = pd.concat([table, pd.DataFrame([bound])], ignore_index=True)
    table.to_csv(a.out / f"{a.preset}_table.csv", index=False)
    cols = ["policy", "params", "makespan_s", "speedup_vs_colocate", "speedup_vs_best_async", "makespan_over_bound",
            "makespan_over_eta_bound", "utilization", "migrations", "reallocations", "wall_s", "wall_over_colocate"]
    print(table[cols].to_string(), flush=True)

    n = rows[0]["n_gpus"]
    plots.role_timelines([(f"{r['policy']} {r['params']}", r["_roles"], n, r["makespan_s"]) for r in rows],
                         a.out / f"{a.preset}_timeline.png")
    breakdown(rows, a.out / f"{a.preset}_breakdown.png")
    print(f"done in {time.perf_counter() - t0:.0f}s", flush=True)


def breakdown(rows: list[dict], path: Path) -> None:
    """Left: GPU-hours by role per policy. Right: each training step's duration per policy."""
    import matplotlib.pyplot as plt

    keys = ["gpu_h_rollout_busy", "gpu_h_rollout_idle", "gpu_h_train", "gpu_h_switching", "gpu_h_idle"]
    colors = ["#1f77b4", "#aec7e8", "#d62728", "#ff7f0e", "#d9d9d9"]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.8))
    bottom = [0.0] * len(rows)
    for k, c in zip(keys, colors):
        vals = [r[k] for r in rows]
        ax0.bar([r["policy"] for r in rows], vals, bottom=bottom, color=c, label=k.removeprefix("gpu_h_"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax0.set_ylabel("GPU-hours")
    ax0.legend(fontsize=7)
    for r in rows:
        ax1.plot(r["_steps"]["version"], [d / 60 for d in r["_steps"]["duration_s"]], marker=".", label=r["policy"])
    ax1.set_xlabel("training step")
    ax1.set_ylabel("step time (min)")
    ax1.set_yscale("log")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
