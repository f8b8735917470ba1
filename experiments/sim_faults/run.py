"""What injected faults cost each policy at scale: makespan and recovery under 0 to 16 random engine kills and
a random trainer-worker kill (with and without a checkpoint every step), in the simulator.

Workload: preset xlong-swe-small (64 H200s, the 30B-A3B MoE, one-GPU engines), `--steps` steps, `--seeds`
seeds. Policies: every registered one but waterlevel (the simulator refuses injected faults during its streaming
steps: not modelled), each at its defaults with eta = `--eta` where it has one. Faults
(gyre.faults specs, their moments drawn from the run's seed): none; random-engines:1, :4, :16;
random-trainers:1 without checkpoints and with a checkpoint every step. An engine is back after
Costs.engine_restart_s (gyre.hardware: process start-up + weight load), a trainer worker after
Costs.trainer_restart_s.

Outputs (results/): runs.csv (one row per policy, faults and seed: makespan, its slowdown against the same
seed without faults, the fault summary columns, decoded tokens lost and tokens re-prefilled), table.csv
(medians over seeds) and slowdown.png.
Usage: python experiments/sim_faults/run.py [--steps 8] [--seeds 3] [--eta 1] [--jobs 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from gyre.config import override  # noqa: E402
from gyre.policies import REGISTRY, takes  # noqa: E402
from gyre.presets import get_preset  # noqa: E402
from gyre.sim.harness.runner import simulate  # noqa: E402
from gyre.sim.harness.sweep import RAY_HELP, progress_lines, run_map  # noqa: E402

HERE = Path(__file__).resolve().parent
POLICIES = sorted(p for p in REGISTRY if p != "waterlevel")  # faults in streaming steps: not modelled
LEVELS = (  # (label, faults, checkpoint_every)
    ("none", (), 0),
    ("1 engine", ("random-engines:1",), 0),
    ("4 engines", ("random-engines:4",), 0),
    ("16 engines", ("random-engines:16",), 0),
    ("1 trainer", ("random-trainers:1",), 0),
    ("1 trainer ckpt-every-1", ("random-trainers:1",), 1),
)


def one(args: tuple[str, str, tuple[str, ...], int, int, int, int]) -> dict:
    policy, label, faults, every, seed, steps, eta = args
    cfg = override(get_preset("xlong-swe-small"), steps=steps, seed=seed, faults=faults or None,
                   checkpoint_every=every)
    t0 = time.perf_counter()
    r = simulate(cfg, policy, {"eta": eta} if takes(policy, "eta") else {})
    notes = [x[3] for x in r.log if x[0] == "note" and x[2] == "engine_fault"]
    row = {"policy": policy, "faults": label, "seed": seed, "makespan_s": r.makespan_s,
           "tokens_generated": r.metrics.summary()["tokens_generated"],
           "tokens_lost": sum(n["tokens_lost"] for n in notes),
           "reprefill_tokens": sum(n["reprefill_tokens"] for n in notes), "wall_s": time.perf_counter() - t0}
    keys = ("faults", "executions_moved", "respawns", "recovery_s_max", "executions_lost", "executions_duplicated")
    row.update({("faults_fired" if k == "faults" else k): r.metrics.extra.get(k, 0) for k in keys})
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eta", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ray", default=None, help=RAY_HELP)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args()
    jobs = [(p, label, f, every, s, a.steps, a.eta) for p in POLICIES for label, f, every in LEVELS
            for s in range(a.seeds)]
    rows = run_map(one, jobs, workers=a.jobs, ray=a.ray, on_done=progress_lines(len(jobs), "runs"))
    df = pd.DataFrame(rows)
    base = df[df["faults"] == "none"].set_index(["policy", "seed"])["makespan_s"]
    df["slowdown"] = [m / base[(p, s)] for p, s, m in zip(df["policy"], df["seed"], df["makespan_s"])]
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "runs.csv", index=False)
    order = {label: i for i, (label, _, _) in enumerate(LEVELS)}
    table = (df.groupby(["policy", "faults"])
             .agg(runs=("seed", "size"), makespan_h=("makespan_s", lambda x: x.median() / 3600),
                  slowdown_median=("slowdown", "median"), slowdown_max=("slowdown", "max"),
                  faults_fired=("faults_fired", "median"), moved=("executions_moved", "median"),
                  reprefill_tokens=("reprefill_tokens", "median"), recovery_s_max=("recovery_s_max", "max"),
                  lost=("executions_lost", "sum"), duplicated=("executions_duplicated", "sum"))
             .reset_index())
    table = table.sort_values(["policy", "faults"], key=lambda c: c.map(order) if c.name == "faults" else c)
    table.to_csv(out / "table.csv", index=False, float_format="%.4g")
    print(table.to_string(index=False))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [label for label, _, _ in LEVELS]
    for p in POLICIES:
        t = table[table["policy"] == p].set_index("faults").reindex(labels)
        ax.plot(range(len(labels)), t["slowdown_median"], marker="o", label=p)
    ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    ax.set_ylabel("makespan / without faults (median)")
    ax.set_title(f"xlong-swe-small, {a.steps} steps, {a.seeds} seeds", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "slowdown.png", dpi=110)


if __name__ == "__main__":
    main()
