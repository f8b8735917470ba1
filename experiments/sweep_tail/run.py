"""Where elastic wins and where it does not: its speedup over colocate and over async as the rollout tail
gets heavier (turns per execution, p99/median from 2 to 20) and as tool calls get slower.

Base workload: xlong-swe's shape on the small cluster (preset xlong-swe-small: 64 H200s, the 30B-A3B
MoE, 16 groups of 8 per step), `--steps` steps, one seed. Each point changes one knob of that preset:
- tail: workload.turns p99/median in {2, 3.5, 5, 10, 20} (median kept at 120 turns);
- tool latency: workload.tool_s and slow_tool_s medians scaled by {0.33, 1, 3, 10}.
Policies: colocate; async (the largest rollout split, eta as elastic); elastic. Both use `--eta`.
With `--cluster`, a third knob: the headline xlong-swe (2.4T MoE) on {384, 512, 1024} GPUs, `--steps`
steps, eta 4 (the trainer alone needs 328 GPUs, so a fixed split starves rollout on small clusters).

Every row carries its work (executions completed / capped / cut by their deadline, scheduler-induced cuts and
the tokens they lost, tokens generated and trained, KV preemptions; policies.work, gyre.metrics) and its
equal-work mark (policies.tuning.equal_work: its scheduler-induced cuts within 1% of the point's executions of
the least of the point's rows). Rankings are among equal-work rows only: a speedup whose either row does not
do equal work is left out (NaN) and `fastest` names the fastest policy doing equal work at the point.

Outputs (results/): sweep.csv (one row per point and policy) and speedup.png (two panels).
Usage: python experiments/sweep_tail/run.py [--steps 8] [--eta 1] [--jobs 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.policies import takes
from gyre.policies.tuning import equal_work, fastest_at_equal_work
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate
from gyre.workload import LogNormal
from gyre.sim.harness.sweep import RAY_HELP, progress_lines, run_map

HERE = Path(__file__).resolve().parent
TAILS = (2.0, 3.5, 5.0, 10.0, 20.0)
TOOL_SCALES = (0.33, 1.0, 3.0, 10.0)
CLUSTERS = (384, 512, 1024)
POLICIES = ("colocate", "async", "elastic")
WORK = ("executions", "completed", "capped", "deadline_hit", "sched_cuts", "sched_cut_tokens_lost", "tokens_generated",
        "tokens_trained", "preemptions")  # each run's work (gyre.metrics summary, policies.work)


def config(steps: int, knob: str, value: float):
    if knob == "gpus":
        return override(get_preset("xlong-swe"), steps=steps, **{"cluster.gpus": int(value)})
    cfg = override(get_preset("xlong-swe-small"), steps=steps)
    w = cfg.workload
    if knob == "tail":
        w = dataclasses.replace(w, turns=LogNormal(median=w.turns.median, p99_ratio=value))
    else:
        w = dataclasses.replace(
            w,
            tool_s=dataclasses.replace(w.tool_s, median=w.tool_s.median * value),
            slow_tool_s=dataclasses.replace(w.slow_tool_s, median=w.slow_tool_s.median * value),
        )
    return dataclasses.replace(cfg, workload=w)


def run_one(job: tuple[int, str, float, str, int]) -> dict:
    steps, knob, value, policy, eta = job
    params = {"eta": eta} if takes(policy, "eta") else {}
    r = simulate(config(steps, knob, value), policy, params)
    s = r.metrics.summary()
    return {"knob": knob, "value": value, "policy": policy, "eta": eta if params else 0,
            "makespan_s": r.makespan_s, "bound_s": r.bound.makespan_s,
            "utilization": s["utilization"], "migrations": r.metrics.migrations,
            "reallocations": r.metrics.reallocations, **{k: s[k] for k in WORK}, "wall_s": r.wall_s}


def rank(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(`df` with each row's equal-work mark; one row per point: makespans, speedups among equal-work rows
    only, and the fastest policy doing equal work)."""
    marks, points = [], []
    for (knob, value), d in df.groupby(["knob", "value"], sort=False):
        ok = equal_work(d["sched_cuts"].tolist(), int(d["executions"].max()))
        marks += list(zip(d.index, ok))
        span, eq = dict(zip(d["policy"], d["makespan_s"])), dict(zip(d["policy"], ok))
        ratio = lambda base: span[base] / span["elastic"] if eq[base] and eq["elastic"] else float("nan")  # noqa: E731
        i = fastest_at_equal_work(d["makespan_s"].tolist(), d["sched_cuts"].tolist(), int(d["executions"].max()))
        points.append({"knob": knob, "value": value, **span, "elastic_vs_colocate": ratio("colocate"),
                       "elastic_vs_async": ratio("async"), "fastest": d["policy"].iloc[i],
                       "unequal_work": " ".join(p for p in span if not eq[p])})
    mark = dict(marks)
    return df.assign(equal_work=[mark[i] for i in df.index]), pd.DataFrame(points)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--eta", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ray", default=None, help=RAY_HELP)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--cluster", action="store_true", help="only the cluster-size knob (xlong-swe, eta 4)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.cluster:
        jobs = [(a.steps, "gpus", v, p, 4) for v in CLUSTERS for p in POLICIES]
    else:
        jobs = [(a.steps, "tail", v, p, a.eta) for v in TAILS for p in POLICIES]
        jobs += [(a.steps, "tool", v, p, a.eta) for v in TOOL_SCALES for p in POLICIES]
    df = pd.DataFrame(run_map(run_one, jobs, workers=a.jobs, ray=a.ray, on_done=progress_lines(len(jobs), "runs")))
    df, wide = rank(df)
    df = df.merge(wide[["knob", "value", "elastic_vs_colocate", "elastic_vs_async", "fastest"]], on=["knob", "value"])
    name = "cluster" if a.cluster else "sweep"
    df.to_csv(a.out / f"{name}.csv", index=False)
    with pd.option_context("display.width", 200):
        print(wide.to_string(), flush=True)
        print(df.pivot_table(index=["knob", "value"], columns="policy", values="sched_cuts").to_string())
    if not a.cluster:
        figure(wide, a.out / "speedup.png")
    print(f"done in {time.perf_counter() - t0:.0f}s")


def figure(wide: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, knob, label in ((axes[0], "tail", "turns p99/median"), (axes[1], "tool", "tool latency x (median 0.9 s)")):
        d = wide[wide.knob == knob].sort_values("value")
        ax.plot(d.value, d.elastic_vs_colocate, marker="o", label="elastic vs colocate")
        ax.plot(d.value, d.elastic_vs_async, marker="s", label="elastic vs async")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel(label)
    axes[0].set_ylabel("speedup (makespan ratio)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
