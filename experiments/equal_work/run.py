"""Elastic against async and colocate at equal work and equal staleness, over seeds.

For one preset, `--steps` steps and each of `--seeds`, this runs `gyre-sim compare`'s own tuning
(gyre.sim.harness.compare.tune: async's split search at every eta, elastic at every eta, colocate; no pilot)
and keeps, per seed, the headline of its table:
- for each eta in {0, 1, 2, 4}: elastic at that eta / async at its best split for that eta;
- elastic at eta 0 / colocate (both on-policy);
each with both rows' makespan, deadline cuts, scheduler-induced cuts (cut, would have finished alone),
tokens generated, KV preemptions, and whether each row does equal work (its scheduler-induced cuts
within 1% of the run's executions of the least of the table's rows; a ratio against a row that does not
is printed but marked).

Outputs (results/): <preset>_<steps>steps_rows.csv (every row of every seed's compare table) and
<preset>_<steps>steps.csv (the headline pairs), each rewritten as every seed finishes, keeping the other seeds'
rows already there (`--seeds 1 2` adds to a file holding seed 0). After a change to one policy,
`--rerun elastic --etas 0` runs only that policy's search at those etas and replaces its per-eta rows in each
seed's stored table (the other rows stay; every row's equal-work mark is recomputed over the new table); a policy
the table lacks (`--rerun waterlevel`) is added as rows `waterlevel-eta<e>` (not in the headline pairs).
Usage:
  python experiments/equal_work/run.py --preset xlong-swe-kv --steps 6 --seeds 0 1 2 [--jobs 1]
  python experiments/equal_work/run.py --preset short-math --steps 4 --rerun elastic --etas 0
  python experiments/equal_work/run.py --preset xlong-swe-kv --steps 6 --rerun waterlevel
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.policies.tuning import equal_work
from gyre.presets import get_preset
from gyre.sim.harness.compare import ETAS, tune, tuned_table
from gyre.sim.harness.sweep import RAY_HELP, progress_lines

HERE = Path(__file__).resolve().parent
KEEP = ["policy", "config", "eta", "engine_limit", "makespan_s", "executions", "completed", "capped", "deadline_hit", "sched_cuts",
        "sched_cut_tokens_lost", "tokens_generated", "tokens_trained", "preemptions", "preempt_gpu_s",
        "staleness_max", "equal_work", "vs_eta_bound", "sim_wall_s"]


SMOKE = {"cluster.gpus": 8, "workload.groups_per_step": 4}  # --smoke: a tiny cluster, for the test suite


def compare_table(preset: str, steps: int, seed: int, jobs: int, ray: str | None = None,
                  smoke: bool = False) -> pd.DataFrame:
    """compare's table (colocate, async and elastic at each eta) for one seed."""
    cfg = override(get_preset(preset), steps=steps, seed=seed, **(SMOKE if smoke else {})).validate()
    done = progress_lines(None, f"seed {seed}: runs")
    tuned = tune(cfg, ["colocate", "async", "elastic"], pilot=False, workers=jobs, ray=ray, on_done=lambda c, r: done(0, r))
    _, table, _ = tuned_table(tuned)
    return table.assign(preset=preset, steps=steps, seed=seed)


def rerun_rows(preset: str, steps: int, seed: int, jobs: int, policy: str, etas: tuple[int, ...], stored: pd.DataFrame,
               ray: str | None = None) -> pd.DataFrame:
    """`stored` (one seed's rows) with `policy`'s rows at `etas` replaced by a fresh run of its search at those
    etas, and every row's equal-work mark recomputed (policies.tuning.equal_work) over the new rows."""
    cfg = override(get_preset(preset), steps=steps, seed=seed).validate()
    done = progress_lines(None, f"seed {seed}: {policy} runs")
    fresh = []
    for eta in etas:  # one search per eta: its row is the policy's row at that eta
        tuned = tune(cfg, [policy], etas=(eta,), pilot=False, workers=jobs, ray=ray, on_done=lambda c, r: done(0, r))
        _, table, _ = tuned_table(tuned)
        fresh.append(table.assign(policy=f"{policy}-eta{eta}", preset=preset, steps=steps, seed=seed))
    new = pd.concat(fresh, ignore_index=True)
    rows = stored.set_index("policy")
    for _, r in new.iterrows():  # a policy the table lacks (e.g. waterlevel) gets new rows
        rows.loc[r["policy"], [k for k in KEEP if k != "policy"] + ["preset", "steps", "seed"]] = \
            [r[k] for k in KEEP if k != "policy"] + [preset, steps, seed]
    out = rows.reset_index()
    out["equal_work"] = equal_work(out["sched_cuts"].astype(int).tolist(), int(out["executions"].max()))
    return out


def pairs(table: pd.DataFrame) -> list[dict]:
    """The headline pairs of one seed's table: (elastic at eta, async at eta) and (elastic eta 0, colocate)."""
    t = table.set_index("policy")
    wanted = [(f"elastic-eta{e}", f"async-eta{e}", f"eta {e}: elastic / async") for e in ETAS]
    wanted.append(("elastic-eta0", "colocate", "eta 0: elastic / colocate"))
    out = []
    for a, b, what in wanted:
        if a not in t.index or b not in t.index:
            continue
        ra, rb = t.loc[a], t.loc[b]
        out.append({
            "preset": ra["preset"], "steps": ra["steps"], "seed": ra["seed"], "pair": what,
            "speedup": rb["makespan_s"] / ra["makespan_s"], "equal_work": bool(ra["equal_work"] and rb["equal_work"]),
            "executions": ra["executions"],
            **{f"{side}_{k}": r[k] for side, r in (("elastic", ra), ("other", rb))
               for k in ("config", "engine_limit", "makespan_s", "deadline_hit", "sched_cuts", "tokens_generated", "preemptions")},
        })
    return out


def _merge_seed(path: Path, rows: pd.DataFrame, seed: int) -> pd.DataFrame:
    """Write `rows` as `seed`'s rows of the CSV at `path`, keeping the other seeds' rows already there (so seeds
    run one call at a time, or a run stopped between seeds, lose nothing); atomically (a temporary, renamed)."""
    old = pd.read_csv(path) if path.exists() else rows.iloc[:0]
    out = pd.concat([old[old["seed"] != seed], rows], ignore_index=True).sort_values("seed", kind="stable")
    tmp = path.with_suffix(".tmp")
    out.to_csv(tmp, index=False)
    tmp.replace(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="xlong-swe-kv")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=1, help="worker processes per seed's comparison")
    ap.add_argument("--ray", default=None, help=RAY_HELP)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--rerun", default=None, metavar="POLICY",
                    help="rerun only this policy's search (at --etas) and replace its rows in the stored tables")
    ap.add_argument("--etas", type=int, nargs="+", default=list(ETAS), help="with --rerun: the etas to rerun")
    ap.add_argument("--smoke", action="store_true", help="the preset on 8 GPUs, 4 groups a step (the test suite's run)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    stem = f"{a.preset}_{a.steps}steps"
    for seed in a.seeds:
        t0 = time.perf_counter()
        if a.rerun:
            path = a.out / f"{stem}_rows.csv"
            stored = pd.read_csv(path) if path.exists() else None
            if stored is None or not (stored["seed"] == seed).any():
                raise SystemExit(f"{path}: no rows for seed {seed} to rerun {a.rerun} into (run the seed whole first)")
            table = rerun_rows(a.preset, a.steps, seed, a.jobs, a.rerun, tuple(a.etas), stored[stored["seed"] == seed], a.ray)
        else:
            table = compare_table(a.preset, a.steps, seed, a.jobs, a.ray, smoke=a.smoke)
        rows = table[[*KEEP, "preset", "steps", "seed"]]
        _merge_seed(a.out / f"{stem}_rows.csv", rows, seed)
        head = _merge_seed(a.out / f"{stem}.csv", pd.DataFrame(pairs(table)), seed)
        print(f"{a.preset} {a.steps} steps seed {seed}: {time.perf_counter() - t0:.0f} s wall, "
              f"{table['sim_wall_s'].sum():.0f} s simulating the table's rows; written", flush=True)
    show = head.assign(elastic_h=head["elastic_makespan_s"] / 3600, other_h=head["other_makespan_s"] / 3600)
    cols = ["seed", "pair", "speedup", "equal_work", "elastic_h", "other_h", "other_config", "elastic_deadline_hit",
            "other_deadline_hit", "elastic_sched_cuts", "other_sched_cuts", "elastic_preemptions", "other_preemptions"]
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 40):
        print(show[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"wrote {a.out / (stem + '.csv')} and {stem}_rows.csv")


if __name__ == "__main__":
    main()
