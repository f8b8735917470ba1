"""Rollout-length foresight without clairvoyance: how much of the oracle's gain does a predictor buy?

On a workload whose tasks recur over epochs (default xlong-swe-epochs), async and elastic run with the
groups admitted
- in drawn order (predictor `none`),
- longest-predicted first within a lookahead of L steps (policies.admission), for each predictor
  (policies.foresight: `history`, `history+siblings`) and each L given,
- in the oracle order of experiments/elastic_vs_baselines/oracle.py (imported, not copied): the run's
  groups sorted by true solo duration, longest first (and, with --horizons, within windows of h steps);
- with --scale-oracle, sorted by each group's true task difficulty in its epoch (gyre.workload
  task_difficulty), longest first: what a perfect history could know (a task's scale, not the group's own
  draws), so it bounds every predictor that learns from a task's past.
Same seed, so the same groups and the same lower bound (sim/cluster/bound.py, with the staleness term at eta).

Per run: makespan, makespan / bound, speedup over drawn order, staleness and per-token version lag
(max, token-weighted mean; gyre.metrics), and the predictor's quality on the run (Spearman rank
correlation of predicted and observed longest turns per group; share of the observed longest 5% in the
predicted top 5%), and its work: executions, deadline cuts, scheduler-induced cuts (sim/harness/sched_cuts.py),
tokens generated, KV preemptions.

Outputs: results/{preset}_foresight.csv and results/{preset}_foresight.png.

Usage: python experiments/foresight/run.py [--preset xlong-swe-epochs] [--steps 48] [--eta 4] [--lookaheads 4,12]
       [--horizons 4] [--jobs 2]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate
from gyre.workload import ReplaySource
from gyre.sim.harness.sweep import RAY_HELP, progress_lines, run_map

HERE = Path(__file__).resolve().parent
PREDICTORS = ("history", "history+siblings")


def oracle_module():
    """experiments/elastic_vs_baselines/oracle.py, whose `orders` gives the oracle orderings."""
    path = HERE.parent / "elastic_vs_baselines" / "oracle.py"
    spec = importlib.util.spec_from_file_location("elastic_vs_baselines_oracle", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def scale_order(cfg, extra_steps: int) -> list:
    """The run's groups sorted by their task's true difficulty in its epoch, longest first (then drawn order)."""
    from gyre.workload import WorkloadSource, task_difficulty, task_of

    w, gps = cfg.workload, cfg.workload.groups_per_step
    src = WorkloadSource(w, cfg.seed)
    drawn = [src.next_group() for _ in range((cfg.steps + extra_steps) * gps)]
    n = cfg.steps * gps
    scale = [task_difficulty(w, *task_of(w, g.group_id, cfg.seed), cfg.seed) for g in drawn[:n]]
    idx = sorted(range(n), key=lambda i: (-scale[i], i))
    return oracle_module().renumbered([drawn[i] for i in idx] + drawn[n:], gps)


def run_one(job: dict) -> dict:
    cfg = override(get_preset(job["preset"]), steps=job["steps"])
    params = dict(job["params"])
    source = None
    if job["order"] == "task scale":
        source = ReplaySource(scale_order(cfg, job["eta"] + 2), cfg.workload)
    elif job["order"] != "drawn":
        groups = oracle_module().orders(cfg, extra_steps=job["eta"] + 2, horizons=job["horizons"])[job["order"]]
        source = ReplaySource(groups, cfg.workload)
    r = simulate(cfg, job["policy"], params, source=source)
    s = r.metrics.summary()
    q = next((x[3] for x in r.log if x[0] == "note" and x[2] == "foresight"), {})
    row = {"preset": job["preset"], "steps": job["steps"], "policy": job["policy"], "variant": job["variant"],
           "order": job["order"], "predictor": params.get("predictor", "none"), "lookahead": params.get("lookahead"),
           "params": repr(params), "makespan_s": r.makespan_s, "bound_s": r.bound.makespan_s,
           "bound_staleness_s": r.bound.staleness_s, "over_bound": r.makespan_s / r.bound.makespan_s,
           "staleness_max": s["staleness_max"], "lag_max": s["lag_max"], "lag_mean": s["lag_mean"],
           "spearman": q.get("spearman"), "top5_share": q.get("top5_share"),
           "trained_other_groups": s["trained_other_groups"], "executions": s["executions"],
           "deadline_hit": s["deadline_hit"], "sched_cuts": s["sched_cuts"], "tokens_generated": s["tokens_generated"],
           "preemptions": s["preemptions"], "wall_s": r.wall_s}
    print(f"{row['policy']:8s} {row['variant']:28s} {r.makespan_s / 3600:7.2f} h  x{row['over_bound']:.2f} of bound  "
          f"lag max {row['lag_max']} mean {row['lag_mean']:.2f}  spearman {row['spearman']}  top5 {row['top5_share']}"
          f"  cuts {row['deadline_hit']} (sched {row['sched_cuts']})  ({r.wall_s:.0f} s)", flush=True)
    return row


def jobs(args) -> list[dict]:
    base = {"async": {"rollout_gpus": args.async_rollout_gpus, "eta": args.eta}, "elastic": {"eta": args.eta}}
    horizons = tuple(int(h) for h in args.horizons.split(",") if h)
    lookaheads = [int(x) for x in args.lookaheads.split(",") if x]
    out = []
    for policy, params in base.items():
        common = {"preset": args.preset, "steps": args.steps, "eta": args.eta, "horizons": horizons, "policy": policy}
        out.append({**common, "variant": "drawn", "order": "drawn", "params": params})
        for la in lookaheads:
            for p in PREDICTORS:
                out.append({**common, "variant": f"{p}, lookahead {la}", "order": "drawn",
                            "params": {**params, "predictor": p, "lookahead": la}})
        if args.scale_oracle:
            out.append({**common, "variant": "oracle: task difficulty", "order": "task scale", "params": params})
        if args.only_scale_oracle:
            out = [j for j in out if j["order"] == "task scale"]
            continue
        out.append({**common, "variant": "oracle", "order": "oracle", "params": params})
        for h in horizons:
            out.append({**common, "variant": f"oracle, horizon {h}", "order": f"horizon {h}", "params": params})
    return out


def figure(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(df.policy))
    fig, axes = plt.subplots(1, len(policies), figsize=(5.2 * len(policies), 3.8), sharey=True)
    for ax, pol in zip(axes if len(policies) > 1 else [axes], policies):
        d = df[df.policy == pol]
        colors = ["grey" if v == "drawn" else "tab:green" if v.startswith("oracle") else "tab:blue" for v in d.variant]
        ax.barh(range(len(d)), d.makespan_s / 3600, color=colors)
        ax.set_yticks(range(len(d)), d.variant, fontsize=8)
        ax.axvline(d.bound_s.iloc[0] / 3600, ls="--", c="k", lw=0.8)
        ax.text(d.bound_s.iloc[0] / 3600, len(d) - 0.4, " lower bound", fontsize=7)
        for i, (m, o) in enumerate(zip(d.makespan_s, d.over_bound)):
            ax.text(m / 3600, i, f" {m / 3600:.1f} h (x{o:.1f})", va="center", fontsize=7)
        ax.set_xlabel("makespan (h)")
        ax.set_title(f"{pol} {d.params.iloc[0]}", fontsize=8)
        ax.invert_yaxis()
    fig.suptitle(f"{df.preset.iloc[0]}, {df.steps.iloc[0]} steps: admission order by predictor vs oracle", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="xlong-swe-epochs")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--async-rollout-gpus", type=int, default=512, help="async's split (xlong-swe's tuned one)")
    ap.add_argument("--lookaheads", default="4,12", help="comma-separated lookaheads in steps")
    ap.add_argument("--horizons", default="", help="comma-separated oracle horizons in steps (oracle.py --horizons)")
    ap.add_argument("--scale-oracle", action="store_true", help="add the task-difficulty oracle order")
    ap.add_argument("--only-scale-oracle", action="store_true", help="run only the task-difficulty oracle rows and "
                    "merge them into the existing results CSV")
    ap.add_argument("--figure-only", action="store_true", help="redraw the figure from the results CSV")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ray", default=None, help=RAY_HELP)
    args = ap.parse_args()
    out = HERE / "results" / f"{args.preset}_foresight.csv"
    if args.figure_only:
        figure(pd.read_csv(out), out.with_suffix(".png"))
        return
    args.scale_oracle |= args.only_scale_oracle
    todo = jobs(args)
    rows = run_map(run_one, todo, workers=args.jobs, ray=args.ray, on_done=progress_lines(len(todo)))
    df = pd.DataFrame(rows)
    if args.only_scale_oracle:  # merged into the rows of a full run, which supply the drawn order
        old = pd.read_csv(out)
        df = pd.concat([old[old.order != "task scale"], df], ignore_index=True)
        order = {p: i for i, p in enumerate(dict.fromkeys(old.policy))}
        df = df.sort_values("policy", key=lambda c: c.map(order), kind="stable").reset_index(drop=True)
    drawn = df[df.variant == "drawn"].set_index("policy").makespan_s
    df["speedup_vs_drawn"] = df.policy.map(drawn) / df.makespan_s
    out.parent.mkdir(exist_ok=True)
    df.to_csv(out, index=False)
    figure(df, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
