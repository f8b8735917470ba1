"""Where elastic's gain comes from, per architecture: each policy's GPU-time split into terms, and the physics.

For every cell of a regime map already run (`run.py ... --name MAP`, whose CSV names each cell's equal-work
async split and its pilot split), re-run colocate, async at the map's hindsight split (the fastest at equal
work), async at the pilot's split when it differs, and elastic, all at the map's eta and steps (the simulator
is deterministic: the makespans equal the map's, which this checks; --plot-only redraws from the CSV), and
split each run's N x makespan into gyre.gpu_time's terms. Elastic's gain over a baseline B is then
N x (T_B - T_elastic) = sum over terms of (term_B - term_elastic): the terms that shrink are where the gain
comes from.

Writes results/explain_<MAP>.csv (one row per cell, policy and term: GPU-hours, share of N x makespan),
results/explain_<MAP>_gain.csv (per cell and baseline: each term's GPU-hours saved by elastic and its share
of the saving), results/explain_<MAP>_physics.csv (experiments/regime_map/physics.py, from the cost model
only) and one figure per architecture, results/explain_<MAP>_<arch>.png.

python experiments/regime_map/explain.py --map map_hybrid_1m [--jobs 1] [--plot-only]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from physics import cell_physics  # noqa: E402
from run import ETA, OUT, cell_config  # noqa: E402

from gyre.gpu_time import TERMS, counts, decompose  # noqa: E402
from gyre.hardware import admission_limit  # noqa: E402
from gyre.sim.harness.runner import simulate  # noqa: E402
from gyre.sim.harness.sweep import RAY_HELP, progress_lines, run_map  # noqa: E402

CELL = ["arch", "window", "gpus", "growth", "training"]
LABELS = {"rollout_decoding": "rollout: decoding",
          "rollout_thin": "rollout: decoding, engine < half full",
          "weight_sync": "rollout: weight sync",
          "kv_reprefill": "rollout: KV re-prefill", "rollout_waiting": "rollout: none decoding (tools, prefill)",
          "rollout_empty": "rollout: engine empty (tail)", "train": "train", "switching": "role switches",
          "idle_first_batch": "idle before the first step (first batch)",
          "idle": "idle after it (trainer waits for a batch)"}
COLORS = {"rollout_decoding": "#2b7bba", "rollout_thin": "#807dba", "weight_sync": "#9ecae1", "kv_reprefill": "#e6550d",
          "rollout_waiting": "#6baed6", "rollout_empty": "#c6dbef", "train": "#31a354", "switching": "#fdae6b",
          "idle_first_batch": "#969696", "idle": "#d9d9d9"}


def _cell_cfg(row, steps: int):
    heavy = row.training == "heavy"
    return cell_config(int(row.window), int(row.gpus), row.growth == "3x", heavy, row.arch, steps)


def _run(job):
    key, policy, label, cfg, params = job
    r = simulate(cfg, policy, params)
    c = r.costs
    full = admission_limit(c.kv_capacity_tokens, cfg.workload.context_window, c.admission_fill, c.state_tokens)
    terms = decompose(r.log, cfg.cluster.gpus, c.sync_s, full_at=min(full, c.max_num_seqs or full))
    cuts = r.metrics.summary().get("sched_cuts", 0)
    return key, label, params.get("rollout_gpus", 0), r.makespan_s, cuts, terms, counts(r.log), cfg.steps


def _async_params(row, which: str) -> dict:
    """The map's chosen async split at eta 4, and its per-engine cap where the map searched one (maps written
    before the cap search have no `async_<which>_cap` column: no cap)."""
    cap = getattr(row, f"async_{which}_cap", None)
    return {"eta": ETA, "rollout_gpus": int(getattr(row, f"async_{which}_R")),
            **({"max_running": int(cap)} if cap is not None and cap == cap else {})}


def jobs_for(m: pd.DataFrame) -> list:
    jobs = []
    for row in m.itertuples():
        cfg = _cell_cfg(row, int(row.steps))
        key = tuple(getattr(row, c) for c in CELL)
        best, pilot = _async_params(row, "best"), _async_params(row, "pilot")
        jobs += [(key, "colocate", "colocate", cfg, {}), (key, "elastic", "elastic", cfg, {"eta": ETA}),
                 (key, "async", "async (hindsight)", cfg, best)]
        if pilot != best:
            jobs.append((key, "async", "async (pilot)", cfg, pilot))
    return jobs


def gains(terms: pd.DataFrame) -> pd.DataFrame:
    """Per cell and baseline: GPU-hours each term loses from the baseline to elastic, and its share of the total."""
    rows = []
    for key, d in terms.groupby(CELL, sort=False):
        by = d.pivot_table(index="policy", columns="term", values="gpu_h", sort=False)
        span = d.groupby("policy")["makespan_s"].first()
        for base in by.index.drop("elastic"):
            saved = by.loc[base] - by.loc["elastic"]
            total = float(saved.sum())
            for term in TERMS:
                rows.append({**dict(zip(CELL, key)), "baseline": base, "speedup": span[base] / span["elastic"],
                             "term": term, "saved_gpu_h": float(saved[term]),
                             "share_of_saving": float(saved[term]) / total if total else float("nan")})
    return pd.DataFrame(rows)


GROUPS = {"decoding (full + thin)": ("rollout_decoding", "rollout_thin"), "engines empty": ("rollout_empty",),
          "none decoding": ("rollout_waiting",), "idle, first batch": ("idle_first_batch",), "idle, later": ("idle",),
          "sync, switches, re-prefill": ("weight_sync", "switching", "kv_reprefill"), "train": ("train",)}


def markdown(terms: pd.DataFrame, phys: pd.DataFrame, m: pd.DataFrame) -> str:
    """The README's tables: the physics per cell, and elastic's GPU-hours saved per group of terms."""
    lines = ["| arch | GPUs | KV tokens / engine | executions / engine | train GPU-h / step | rollout GPU-h / step "
             "| balanced R | work-conserving step (h) | group tail alone (h) |", "|" + "---|" * 9]
    for p in phys.itertuples():
        lines.append(f"| {p.arch} | {p.gpus:,} | {p.kv_tokens_per_engine / 1e6:.1f}M | {p.execs_per_engine} | "
                     f"{p.train_gpu_h:,.0f} | {p.rollout_gpu_h:,.0f} | {p.balanced_R:.0f} | {p.work_step_s / 3600:.2f} "
                     f"| {p.group_tail_alone_s / 3600:.2f} |")
    lines += ["", "| arch | cell | GPUs | baseline (R) | baseline h | elastic h | speedup | GPU-h saved | "
              + " | ".join(GROUPS) + " | sched cuts baseline / elastic |", "|" + "---|" * (9 + len(GROUPS))]
    g = gains(terms)
    span = terms.groupby(CELL + ["policy"], sort=False)[["makespan_s", "sched_cuts", "rollout_gpus"]].first()
    for (key, base), d in g.groupby([g[CELL].apply(tuple, axis=1), "baseline"], sort=False):
        saved = d.set_index("term")["saved_gpu_h"]
        b, e = span.loc[(*key, base)], span.loc[(*key, "elastic")]
        r = f" ({int(b.rollout_gpus)})" if b.rollout_gpus else ""
        cells = " | ".join(f"{sum(saved[t] for t in ts):,.0f}" for ts in GROUPS.values())
        lines.append(f"| {key[0]} | {key[1] // 1024}K, {key[3]}, {key[4]} | {key[2]:,} | {base}{r} | "
                     f"{b.makespan_s / 3600:.2f} | {e.makespan_s / 3600:.2f} | {d.speedup.iloc[0]:.3f}x | "
                     f"{saved.sum():,.0f} | {cells} | {int(b.sched_cuts)} / {int(e.sched_cuts)} |")
    return "\n".join(lines)


def figure(terms: pd.DataFrame, phys: pd.DataFrame, arch: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = terms[terms.arch == arch]
    cells = list(d.groupby(CELL[1:], sort=False).groups)
    fig, axes = plt.subplots(len(cells), 1, figsize=(11, 1.8 + 1.5 * len(cells)), squeeze=False)
    for ax, cell in zip(axes[:, 0], cells):
        c = d[(d[CELL[1:]] == pd.Series(cell, index=CELL[1:])).all(axis=1)]
        pols = list(dict.fromkeys(c.policy))
        left = [0.0] * len(pols)
        for term in TERMS:
            v = [float(c[(c.policy == p) & (c.term == term)].gpu_h.iloc[0]) / 1e3 for p in pols]
            ax.barh(range(len(pols)), v, left=left, color=COLORS[term], label=LABELS[term])
            left = [a + b for a, b in zip(left, v)]
        for i, p in enumerate(pols):
            ax.text(left[i], i, f" {c[c.policy == p].makespan_s.iloc[0] / 3600:.2f} h", va="center", fontsize=8)
        ax.set_yticks(range(len(pols)), pols, fontsize=8)
        ax.invert_yaxis()
        ph = phys[(phys.arch == arch) & (phys.window == cell[0]) & (phys.gpus == cell[1])].iloc[0]
        ax.set_title(f"{cell[1]} GPUs, window {cell[0] // 1024}K, growth {cell[2]}, {cell[3]} training: "
                     f"{ph.execs_per_engine} executions/engine, train {ph.train_s_at_min / 3600:.2f} h/step on "
                     f"{ph.trainer_min}, rollout {ph.rollout_s_on_N_minus_min / 3600:.2f} h/step on the rest "
                     f"(balanced R {ph.balanced_R:.0f}), group tail {ph.group_tail_alone_s / 3600:.2f} h", fontsize=8)
        ax.set_xlim(0, max(left) * 1.12)
    axes[-1, 0].set_xlabel("GPU-hours (thousands) = GPUs x makespan, split by what the GPUs did")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle(f"where the GPU-time goes, {arch} ({int(d.steps.iloc[0])} steps)", fontsize=10)
    fig.tight_layout(rect=(0, 0.1 + 0.03 * (3 - len(cells)), 1, 1))
    fig.legend(handles, labels, fontsize=7, ncol=4, loc="lower center")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--map", required=True, help="results/<MAP>.csv of run.py: the cells and their async splits")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--ray", default=None, help=RAY_HELP)
    ap.add_argument("--plot-only", action="store_true", help="redraw the figures from the CSVs")
    ap.add_argument("--markdown", action="store_true",
                    help="print the README's tables (with --plot-only: from the CSVs)")
    a = ap.parse_args()
    src = OUT / f"{a.map}.csv"
    if not src.exists():
        ap.error(f"--map: {src} does not exist (run run.py --name {a.map} first)")
    m = pd.read_csv(src)
    if "arch" not in m:
        ap.error(f"--map: {src} has no arch column (made before the architecture axis)")
    out = OUT / f"explain_{a.map}"
    phys = pd.DataFrame([{**{c: getattr(row, c) for c in CELL}, **cell_physics(_cell_cfg(row, int(row.steps)))}
                         for row in m.itertuples()])  # the cost model only: seconds, redone every time
    if a.plot_only:
        terms = pd.read_csv(f"{out}.csv")
    else:
        t0 = time.perf_counter()
        jobs = jobs_for(m)
        res = run_map(_run, jobs, workers=a.jobs, ray=a.ray, on_done=progress_lines(len(jobs), "runs"))
        rows = []
        for key, label, r_gpus, span, cuts, terms, cnt, steps in res:
            n = key[2]
            for term in TERMS:
                rows.append({**dict(zip(CELL, key)), "steps": steps, "policy": label, "rollout_gpus": r_gpus,
                             "makespan_s": span,
                             "sched_cuts": cuts, **cnt, "term": term, "gpu_h": terms[term] / 3600,
                             "share": terms[term] / (n * span)})
        terms = pd.DataFrame(rows)
        def git(*args: str) -> str:
            here = Path(__file__).parent
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=here).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD")
        terms["commit"] = commit
        terms["policies_commit"] = git("log", "-1", "--format=%h", "--", ":/policies")  # the last change to elastic
        terms.to_csv(f"{out}.csv", index=False)
        gains(terms).to_csv(f"{out}_gain.csv", index=False)
        print(f"{len(jobs)} runs in {time.perf_counter() - t0:.0f} s with {a.jobs} workers (commit {commit})")
        _check_against_map(terms, m)
    phys.to_csv(f"{out}_physics.csv", index=False)
    for arch in dict.fromkeys(terms.arch):
        figure(terms, phys, arch, Path(f"{out}_{arch}.png"))
    if a.markdown:
        print(markdown(terms, phys, m))
        return
    g = gains(terms)
    print(g[g.saved_gpu_h.abs() > 0].pivot_table(index=CELL + ["baseline", "speedup"], columns="term",
                                                 values="saved_gpu_h", sort=False).round(0).to_string())


def _check_against_map(terms: pd.DataFrame, m: pd.DataFrame) -> None:
    """The re-runs are the map's runs: warn where a makespan differs (the code changed since the map ran)."""
    col = {"colocate": "colocate_s", "elastic": "elastic_s", "async (hindsight)": "async_best_s",
           "async (pilot)": "async_pilot_s"}
    spans = terms.groupby(CELL + ["policy"], sort=False)["makespan_s"].first().reset_index()
    both = spans.merge(m, on=CELL)
    for row in both.itertuples():
        want = getattr(row, col[row.policy])
        if abs(row.makespan_s - want) > 1e-6 * want:
            print(f"warning: {row.arch} {row.gpus} GPUs {row.policy}: {row.makespan_s:.1f} s here, {want:.1f} s in "
                  "the map (the code changed since the map ran)")


if __name__ == "__main__":
    main()
