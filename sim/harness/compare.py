"""Compare policies on one workload and seed: every registered policy (or those named), each at its best,
at equal work and equal staleness.

A baseline is only fair at its best setting, so a policy the run config does not parameterize is tuned
by its own search (policies.tuner: the policy's `search`, else its whole `grid`; eta in {0, 1, 2, 4})
and the fastest run is reported ("hindsight": tuned on the very run it is scored on). A baseline that
needs tuning is also tuned the way a user could, on a pilot of the first 1/6 of the steps, and that
setting run in full is reported beside it as `<name>-pilot`.

Equal work: a search ranks only runs doing equal work (policies.tuning: scheduler-induced deadline cuts
within 1% of the run's executions of the least-cutting run it tried), and the table marks each row
whose cuts exceed the least of the table's rows by more than that (`equal_work` False; never the best).
Equal staleness: eta is the learning algorithm's choice, so a policy searched over several etas gets one
row per eta, `<name>-eta<e>` (its best at that eta, from the runs its search already made); a baseline
keeps its row tuned over eta as well, `<name>`, labelled so. `speedup_vs_<baseline>_same_eta` divides
that baseline's row at the row's own eta by the row's makespan; `speedup_vs_best` divides by the fastest
equal-work baseline tuned with hindsight. Runs go to worker processes (gyre.sim.harness.workers: they end with
the comparison) or, with `ray`, to Ray tasks (gyre.sim.harness.sweep: the same results), one search round at a time
(every policy's next batch together).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from gyre import outputs, plots
from gyre.config import RunConfig
from gyre.hardware import admission_limit
from gyre.outputs import RunOutput
from gyre.policies import REGISTRY, ClusterShape, baselines, sweep, tuner
from gyre.policies.tuning import EqualWork, equal_work, fastest_at_equal_work
from gyre.sim.harness.runner import SimResult, simulate
from gyre.sim.harness.sweep import run_map


@dataclass(frozen=True)
class Candidate:
    policy: str
    params: dict[str, Any]

    @property
    def label(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.policy}({args})" if args else self.policy


ETAS = (0, 1, 2, 4)  # the staleness bounds a comparison tries
PILOT_SHARE = 6  # a pilot runs the first 1/PILOT_SHARE of the steps


def shape_of(cfg: RunConfig) -> ClusterShape:
    costs = cfg.costs()
    limit = admission_limit(costs.kv_capacity_tokens, cfg.workload.max_context, costs.admission_fill, costs.state_tokens)
    return ClusterShape(n_gpus=cfg.cluster.gpus, gpus_per_engine=costs.engine_gpus,
                        min_train_gpus=costs.min_train_gpus, admit_limit=limit)


def infeasible(cfg: RunConfig, policies: list[str] | None = None) -> dict[str, str]:
    """Policies (of those named, or every registered one) with no setting this cluster can run, and why."""
    shape = shape_of(cfg)
    return {name: (f"no setting fits {shape.n_gpus} GPUs (engines of {shape.gpus_per_engine}, a trainer of "
                   f">= {shape.min_train_gpus})")
            for name in policies or list(REGISTRY)
            if name not in cfg.policy_params and not sweep(name, shape, ETAS)}


def candidates(cfg: RunConfig, policies: list[str] | None = None, etas: tuple[int, ...] = ETAS) -> list[Candidate]:
    """Every policy at its configured params; where none are configured, every set of its sweep grid."""
    shape = shape_of(cfg)
    out = []
    for name in policies or list(REGISTRY):
        if name in cfg.policy_params:
            out.append(Candidate(name, dict(cfg.policy_params[name])))
        else:
            out += [Candidate(name, params) for params in sweep(name, shape, etas)]
    return out


@dataclass
class Tuned:
    """One row of a comparison: the setting chosen, its full run, and how it was chosen."""

    best: Candidate
    result: SimResult
    how: str  # "as configured", "hindsight, grid of 8", "hindsight, search 12 of 84", "pilot (1 of 8 steps): ..."
    tried: list[tuple[RunConfig, Candidate, float]]


def tune(
    cfg: RunConfig,
    policies: list[str] | None = None,
    *,
    etas: tuple[int, ...] = ETAS,
    pilot: bool = True,
    source_factory: Callable[[], Any] | None = None,
    workers: int | None = None,
    on_done: Callable[[Candidate, SimResult], None] | None = None,
    ray: str | None = None,
) -> dict[str, Tuned]:
    """Every policy at its best (its configured params, or tuned by its search), plus pilot-tuned baselines.

    Keys are policy names, and `<name>-pilot` for a baseline tuned on the first steps // PILOT_SHARE
    steps. All searches advance together, one round (every active search's next batch) at a time. `ray`
    ("auto" or a cluster address) runs each round's runs as Ray tasks (gyre.sim.harness.sweep.run_map)."""
    shape = shape_of(cfg)
    pilot_cfg = replace(cfg, steps=max(1, cfg.steps // PILOT_SHARE))
    skip = infeasible(cfg, policies)
    names = [n for n in policies or list(REGISTRY) if n not in skip]
    searches: dict[str, tuple[RunConfig, str, Any]] = {}
    fixed: dict[str, Candidate] = {}
    for name in names:
        given = cfg.policy_params.get(name, {})
        if given and set(given) & {k for p in sweep(name, shape, etas) for k in p}:  # it sets what a search would
            fixed[name] = Candidate(name, dict(given))
            continue
        # else its search runs, each run with the given params too (`simulate` merges cfg.policy_params)
        searches[name] = (cfg, name, tuner(name, shape, etas))
        grid = sweep(name, shape, etas)
        if pilot and name in baselines() and len(grid) > 1 and pilot_cfg.steps < cfg.steps:
            searches[f"{name}-pilot"] = (pilot_cfg, name, tuner(name, shape, etas))
    tried: dict[str, list[tuple[RunConfig, Candidate, SimResult]]] = {k: [] for k in searches}
    # (steps, label) -> result, shared by every search. A search's runs are kept without their event logs
    # and groups (`_light`: a long run's log is gigabytes, and a search makes ~100 runs); the full result
    # is kept only for each search's best so far at each eta (`full`), and a best whose full result was
    # dropped is run again at the end (the simulator is deterministic)
    results: dict[tuple[int, str], SimResult] = {}
    full: dict[tuple[int, str], SimResult] = {}

    def run_round(jobs: list[tuple[RunConfig, Candidate]]) -> None:
        todo = list({(c.steps, cand.label): (c, cand) for c, cand in jobs if (c.steps, cand.label) not in results}.values())
        if todo:
            for (c, cand), r in zip(todo, _run_jobs(todo, source_factory, workers, on_done, ray)):
                results[(c.steps, cand.label)], full[(c.steps, cand.label)] = _light(r), r

    def keep_best() -> None:
        want = {(c.steps, b.label) for c, bs in (_bests(t) for t in tried.values() if t) for b in bs}
        for k in [k for k in full if k not in want]:
            del full[k]

    # each search is sent makespans at equal work among its runs at the same eta (its per-eta rows' ranking)
    work: dict[tuple[str, Any], EqualWork] = {}
    pending = {}
    for key, (c, name, search) in searches.items():
        batch = next(search, None)
        if batch is not None:
            pending[key] = batch
    while pending:
        jobs = [(searches[k][0], Candidate(searches[k][1], p)) for k, batch in pending.items() for p in batch]
        run_round(jobs)
        nxt = {}
        for key, batch in pending.items():
            c, name, search = searches[key]
            rs = [results[(c.steps, Candidate(name, p).label)] for p in batch]
            seen = {cand.label for _, cand, _ in tried[key]}  # a search may send a run again to rescore it
            tried[key] += [(c, cand, r) for p, r in zip(batch, rs) if (cand := Candidate(name, p)).label not in seen]
            try:
                nxt[key] = search.send(_scores(work, key, c, batch, rs))
            except StopIteration:
                pass
        pending = nxt
        keep_best()
    run_round([(cfg, cand) for cand in fixed.values()]
              + [(cfg, _best(t)) for t in tried.values() if t])
    rows: list[tuple[str, Candidate, str, list]] = [(name, cand, "as configured", []) for name, cand in fixed.items()]
    for key, t in tried.items():
        if not t:
            continue
        name = searches[key][1]
        best = _best(t)
        grid = len(sweep(name, shape, etas))
        of = f"grid of {grid}" if len(t) == grid else f"{len(t)} of {grid}"
        how = (f"pilot ({pilot_cfg.steps} of {cfg.steps} steps), {of}" if key.endswith("-pilot")
               else f"hindsight, {of}" if grid > 1 else "its only setting")
        runs = [(c, cand, r.makespan_s) for c, cand, r in t]
        per_eta = sorted({cand.params["eta"] for _, cand, _ in t if "eta" in cand.params})
        if key.endswith("-pilot") or len(per_eta) < 2:
            rows.append((key, best, how, runs))
            continue
        if name in baselines():  # the baseline tuned over eta as well stays, labelled so
            rows.append((key, best, f"{how}, any eta", runs))
        for e in per_eta:
            at = [x for x in t if x[1].params.get("eta") == e]
            rows.append((f"{name}-eta{e}", _best(at), f"hindsight, {len(at)} at eta {e}",
                         [(c, cand, r.makespan_s) for c, cand, r in at]))
    again = list({(cfg.steps, cand.label): (cfg, cand) for _, cand, _, _ in rows
                  if (cfg.steps, cand.label) not in full}.values())
    for (c, cand), r in zip(again, _run_jobs(again, source_factory, workers, None, ray) if again else []):
        full[(c.steps, cand.label)] = r
    out = {k: Tuned(cand, full[(cfg.steps, cand.label)], how, runs) for k, cand, how, runs in rows}
    return {k: out[k] for k in sorted(out, key=lambda k: _row_order(k, names))}


def _scores(work: dict, key: str, cfg: RunConfig, batch: list[dict], rs: list[SimResult]) -> list[float]:
    """A search's batch scored at equal work among that search's runs at the same eta (policies.tuning)."""
    out = [0.0] * len(batch)
    for eta in dict.fromkeys(p.get("eta") for p in batch):
        at = [i for i, p in enumerate(batch) if p.get("eta") == eta]
        w = work.setdefault((key, eta), EqualWork(_executions(cfg)))
        for i, v in zip(at, w.scores([rs[i].makespan_s for i in at], [_cuts(rs[i]) for i in at])):
            out[i] = v
    return out


def _row_order(key: str, names: list[str]) -> tuple:
    """Rows by policy (in the order named), then the per-eta rows by eta, the tuned-over-eta row, the pilot."""
    name, _, eta = key.partition("-eta")
    if eta.isdigit() and name in names:
        return names.index(name), 0, int(eta)
    name = key.removesuffix("-pilot")
    return names.index(name), 1 if key == name else 2, 0


def _executions(cfg: RunConfig) -> int:
    """The executions a run of `cfg` must train (the share of which bounds unequal work)."""
    return cfg.steps * cfg.workload.groups_per_step * cfg.workload.group_size


def _cuts(r: SimResult) -> int:
    return int(r.metrics.extra.get("sched_cuts", 0))


def _best(tried: list[tuple[RunConfig, Candidate, SimResult]]) -> Candidate:
    """The fastest candidate doing equal work (policies.tuning); on a tie (a pilot too short for the
    staleness bound to bind) the larger eta."""
    i = fastest_at_equal_work([r.makespan_s for _, _, r in tried], [_cuts(r) for _, _, r in tried],
                              _executions(tried[0][0]), tie=[-cand.params.get("eta", 0) for _, cand, _ in tried])
    return tried[i][1]


def _light(r: SimResult) -> SimResult:
    """The result without its event log and groups: what a search ranks by (makespan, scheduler cuts) and the
    table's figures (metrics) stay."""
    return replace(r, log=[], groups=[])


def _bests(tried: list[tuple[RunConfig, Candidate, SimResult]]) -> tuple[RunConfig, list[Candidate]]:
    """A search's best run over all its runs and at each eta (the rows `tune` reports for it)."""
    c = tried[0][0]
    etas = sorted({cand.params["eta"] for _, cand, _ in tried if "eta" in cand.params})
    return c, [_best(tried)] + [_best([x for x in tried if x[1].params.get("eta") == e]) for e in etas]


def _run_jobs(jobs: list[tuple[RunConfig, Candidate]], source_factory, workers, on_done,
              ray: str | None = None) -> list[SimResult]:
    args = [(c, cand, source_factory) for c, cand in jobs]
    done = (lambda i, r: on_done(args[i][1], r)) if on_done else None
    return run_map(_run, args, workers=workers, ray=ray, on_done=done)


def _run(args: tuple[RunConfig, Candidate, Any]) -> SimResult:
    cfg, cand, source_factory = args
    source = source_factory() if source_factory is not None else None
    return simulate(cfg, cand.policy, cand.params, source=source)


def run_candidates(
    cfg: RunConfig,
    cands: list[Candidate],
    *,
    source_factory: Callable[[], Any] | None = None,
    workers: int | None = None,
    on_done: Callable[[Candidate, SimResult], None] | None = None,
    ray: str | None = None,
) -> list[SimResult]:
    return _run_jobs([(cfg, c) for c in cands], source_factory, workers, on_done, ray)


def best_per_policy(cands: list[Candidate], results: list[SimResult]) -> dict[str, tuple[Candidate, SimResult]]:
    """Each policy's fastest candidate among its candidates doing equal work."""
    out = {}
    for policy in dict.fromkeys(c.policy for c in cands):
        mine = [(c, r) for c, r in zip(cands, results) if c.policy == policy]
        i = fastest_at_equal_work([r.makespan_s for _, r in mine], [_cuts(r) for _, r in mine],
                                  _executions(mine[0][1].config))
        out[policy] = mine[i]
    return out


def comparison_table(best: dict[str, tuple[Candidate, SimResult]], how: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per entry of `best` (row name -> (candidate, result)); `how` says how each was tuned."""
    rows = []
    bound = min(max(r.bound.work_s, r.bound.critical_path_s) for _, r in best.values())
    for name, (c, r) in best.items():
        s = r.metrics.summary()
        s["policy"] = name
        s["config"] = c.label
        s["engine_limit"] = c.params.get("max_running") or shape_of(r.config).admit_limit  # executions per engine
        s["tuned"] = (how or {}).get(name, "as configured")
        s["eta"] = c.params.get("eta", r.bound.eta)
        s["steps_per_burst"] = getattr(r.config.workload, "steps_per_burst", 1)  # mu: steps per weight publication
        s["bound_s"] = bound
        s["vs_bound"] = r.makespan_s / bound
        s["eta_bound_s"] = r.bound.makespan_s  # the bound under this policy's own staleness bound
        s["vs_eta_bound"] = r.makespan_s / r.bound.makespan_s
        s["sim_wall_s"] = r.wall_s
        s["events"] = r.events
        rows.append(s)
    df = pd.DataFrame(rows)
    df["equal_work"] = equal_work([_cuts(r) for _, r in best.values()], max(_executions(r.config) for _, r in best.values()))
    equal = dict(zip(best, df["equal_work"]))
    bases = [b for b in baselines() if b in best]
    for base in bases:
        df[f"speedup_vs_{base}"] = best[base][1].makespan_s / df["makespan_s"]
        at = {r.bound.eta: r.makespan_s for k, (_, r) in best.items() if k.startswith(f"{base}-eta")}
        if at:  # equal staleness: against the baseline's best at the row's own eta
            df[f"speedup_vs_{base}_same_eta"] = [at.get(e, math.nan) for e in df["eta"]] / df["makespan_s"]
    fair = [best[b][1].makespan_s for b in bases if equal[b]]
    if bases:  # the headline: against the fastest baseline doing equal work, each tuned with hindsight
        df["speedup_vs_best"] = (min(fair) if fair else math.nan) / df["makespan_s"]
    return df


def tuned_table(tuned: dict[str, Tuned]) -> tuple[dict[str, tuple[Candidate, SimResult]], pd.DataFrame, pd.DataFrame]:
    """(best per row, the comparison table, every run a search tried) of a `tune` result."""
    best = {k: (t.best, t.result) for k, t in tuned.items()}
    table = comparison_table(best, {k: t.how for k, t in tuned.items()})
    sweep = pd.DataFrame([{"config": cand.label, "makespan_s": m, "row": k, "steps": c.steps}
                          for k, t in tuned.items() for c, cand, m in t.tried])
    return best, table, sweep


def requested_rows(table: pd.DataFrame, policies: list[str] | None) -> pd.DataFrame:
    """One row per policy named (its tuned-over-eta or only row): no per-eta or pilot rows. Every policy when
    none was named."""
    names = policies or list(dict.fromkeys(p.split("-eta")[0].removesuffix("-pilot") for p in table["policy"]))
    keep = []
    for name in names:
        if (table["policy"] == name).any():
            keep.append(name)
            continue
        at = table[table["policy"].str.startswith(f"{name}-eta")]  # searched per eta only: its fastest equal-work row
        if len(at):
            fair = at[at["equal_work"]] if at["equal_work"].any() else at
            keep.append(fair.loc[fair["makespan_s"].idxmin(), "policy"])
    return table[table["policy"].isin(keep)].reset_index(drop=True)


def run_title(cfg: RunConfig) -> str:
    """'<preset>, <model>, <gpus> x <gpu>': what a result table's title names."""
    c = cfg.cluster
    gpu = getattr(getattr(c, "gpu", None), "name", None)
    return f"{cfg.name}, {c.model.name}, {c.gpus} GPUs" + (f" ({gpu})" if gpu else "")


def write_outputs(out: Path, cfg: RunConfig, best: dict[str, tuple[Candidate, SimResult]], table: pd.DataFrame,
                  sweep: pd.DataFrame | None = None) -> dict[str, Path]:
    """gyre.outputs' files for the best run of each policy, plus sweep.csv (every run) and gpu_hours.png."""
    runs = [RunOutput(name=name, label=f"{name}: {c.label}", log=r.log, metrics=r.metrics)
            for name, (c, r) in best.items()]
    paths = outputs.write_outputs(out, runs, table, preset=cfg.name, seed=cfg.seed, n_gpus=cfg.cluster.gpus)
    if sweep is not None:
        sweep.to_csv(out / "sweep.csv", index=False)
    paths["gpu_hours"] = plots.step_breakdown(table.to_dict(orient="records"), out / "gpu_hours.png")
    return paths
