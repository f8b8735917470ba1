"""A workload fitted to a trace (`gyre-sim calibrate`): a trace in, a CalibratedWorkload out, with its fit judged on
data held out by time.

The trace's groups are in time (issue) order; the first `split` of its executions (cut at a group
boundary) are fitted, the rest held out. On the fitted part:

1. drift (`drift`: "auto", "off" or "linear"): least squares of log-length on step,
   drift_per_step = exp(slope) - 1. "linear" keeps the fitted slope; "off" none; "auto" treats it as
   a model choice made on held-out data: the slope is fitted on the first 75% of the fitted part
   (and must exceed 2 standard errors), and kept only if de-drifting makes the last 25% closer (KS D
   of log-length) to the first 75% than pooling does; it is then refitted on the whole fitted part.
   "auto" is off for foreign traces (request and session traces), whose steps are windows of
   arrivals, not training steps. The drift factor is held inside the range of window levels the
   fit saw (median per window of steps over the base median), so it is never extrapolated;
   Recency (`recent`: "auto" or "all"), for foreign traces only: the fitted part may be cut to its most
   recent half or quarter when that predicts what follows better across several validation windows
   (choose_window: better by RECENT_MARGIN in most, worse in none, each window holding at least
   RECENT_MIN executions); else all the data. A request log's mix can change
   within a trace (the shared ShareGPT runs' output lengths drop from a median of ~720 to ~595 after
   their first 100 requests): a stationary fit of all of it then misses the future by the change;
2. per-task difficulty: a random-effects (method of moments) split of the de-drifted log-length
   into between-group and within-group variance; difficulty_sigma = sqrt(max(0, between - within/n));
3. lengths are divided by their drift factor and shrunken group effect, then each quantity gets a
   TailDist (tail_dist.fit_tail_dist); lengths at the cap are the point mass, kept out of the scaling.

The held-out part is compared with groups drawn from the calibrated source (gyre.traces.heldout).

Every token-count distribution is clamped at the context window (no draw exceeds it), the length
also at its cap; a tail whose GPD shape has no finite mean falls back to the empirical tail (tail_dist.py),
and the report says which.

Simplifications: difficulty and drift act on the length only; segments of different executions
are pooled; the cap is read from the trace (max_turns of a rollout trace) or given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from operator import attrgetter

import numpy as np

from gyre.traces.calibrated import CalibratedWorkload
from gyre.traces.heldout import TARGETS, evaluate, quantities, split_groups, stationarity
from gyre.traces.tail_dist import detect_cap, fit_tail_dist
from gyre.traces.schema import Trace, TraceError
from gyre.workload import GroupSpec, LogNormal, WorkloadConfig

MODEL_DRAWS = 400_000
DRIFT_MODES = ("auto", "off", "linear")
RECENT_MODES = ("auto", "all")
RECENT_SHARES = (1.0, 0.5, 0.25)
RECENT_MARGIN = 0.01  # KS D a shorter window must gain over the longer one
RECENT_MIN = 50  # executions a window must hold


@dataclass(frozen=True, kw_only=True)
class WorkloadFitOptions:
    split: float = 0.7  # fitted share of executions, by time
    cap: float | None = None  # length cap; None: the trace's max_turns, or a repeated maximum
    k: int | None = None  # the K of "max over K"; None: the batch size
    seed: int = 0
    model_draws: int = MODEL_DRAWS  # model segments drawn for the held-out comparison (at least)
    drift: str = "auto"  # one of DRIFT_MODES
    recent: str = "all"  # one of RECENT_MODES; "all" by default: see experiments/trace_calibration

    def __post_init__(self) -> None:
        if not 0.0 < self.split <= 1.0:
            raise TraceError(f"split must be in (0, 1], got {self.split}")
        if self.recent not in RECENT_MODES:
            raise TraceError(f"unknown recency mode {self.recent!r}; known: {', '.join(RECENT_MODES)}")
        if self.drift not in DRIFT_MODES:
            raise TraceError(f"unknown drift mode {self.drift!r}; known: {', '.join(DRIFT_MODES)}")


def _slope(y: np.ndarray, step: np.ndarray) -> tuple[float, float]:
    """(least-squares slope of y on step, its standard error); (0, inf) with under 3 distinct steps."""
    if len(np.unique(step)) < 3:
        return 0.0, math.inf
    s = step - step.mean()
    b = float((s * (y - y.mean())).sum() / (s * s).sum())
    resid = y - y.mean() - b * s
    se = math.sqrt(float((resid**2).sum()) / max(len(y) - 2, 1) / float((s * s).sum()))
    return b, se


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, side="right") / len(a)
                        - np.searchsorted(b, grid, side="right") / len(b)).max())


def choose_drift(y: np.ndarray, step: np.ndarray, mode: str, foreign: bool) -> tuple[float, dict]:
    """(slope of log-length per step, what was decided and why) for a drift mode (see the module doc)."""
    b, se = _slope(y, step)
    info: dict = {"mode": mode, "slope_fitted": b if math.isfinite(se) else 0.0}
    if mode == "off":
        return 0.0, {**info, "chosen": "off", "why": "--drift off"}
    if mode == "linear":
        return (b if math.isfinite(se) else 0.0), {**info, "chosen": "linear", "why": "--drift linear"}
    if foreign:
        return 0.0, {**info, "chosen": "off", "why": "a foreign trace: its steps are batches of arrivals, not "
                                                       "training steps (--drift linear to fit one anyway)"}
    order = np.argsort(step, kind="stable")
    cut = int(0.75 * len(order))
    inner, held = order[:cut], order[cut:]
    b_in, se_in = _slope(y[inner], step[inner])
    if len(held) < 20 or not math.isfinite(se_in) or abs(b_in) <= 2 * se_in:
        return 0.0, {**info, "chosen": "off", "why": "no slope over 2 standard errors in the first 75%"}
    ks_off = _ks(y[held], y[inner])
    ks_on = _ks(y[held] - b_in * step[held], y[inner] - b_in * step[inner])
    info.update(held_out_ks_off=ks_off, held_out_ks_linear=ks_on)
    if ks_on >= ks_off:
        return 0.0, {**info, "chosen": "off", "why": f"drift does not improve the held-out fit "
                                                      f"(KS D {ks_on:.3f} with, {ks_off:.3f} without)"}
    return b, {**info, "chosen": "linear", "why": f"drift improves the held-out fit (KS D {ks_on:.3f} with, "
                                                  f"{ks_off:.3f} without)"}


RECENT_CUTS = (0.5, 0.625, 0.75)  # validation windows: fit on the fitted part up to each, score on what follows


def choose_window(length: np.ndarray, mode: str, foreign: bool) -> tuple[float, dict]:
    """(share of the fitted part to fit on, its most recent end; what was decided and why): see the module doc.

    Evidence from several validation windows: for each cut in RECENT_CUTS, the part before the cut is fitted
    whole or by its most recent half / quarter, and each is scored (KS D of the length) on the next eighth
    (the last quarter for the last cut). A shorter window is taken only when it is better by RECENT_MARGIN in
    at least two of the windows and worse by that much in none; else all the data."""
    if mode == "all" or not foreign:
        return 1.0, {"mode": mode, "chosen": 1.0, "why": "--recent all" if mode == "all" else
                     "a rollout trace: drift over steps models change"}
    n = len(length)
    ks: dict[float, list[float]] = {}
    for c in RECENT_CUTS:
        cut = int(c * n)
        inner = length[:cut]
        held = length[cut: n if c == RECENT_CUTS[-1] else int((c + 0.125) * n)]
        if len(held) < RECENT_MIN // 2:
            continue
        for w in RECENT_SHARES:
            if math.ceil(w * cut) >= RECENT_MIN:
                ks.setdefault(w, []).append(_ks(inner[cut - math.ceil(w * cut):], held))
    full = ks.get(1.0, [])
    best = 1.0
    for w in sorted(ks, reverse=True):
        if w >= best or len(ks[w]) != len(full) or not full:
            continue
        gain = [a - b for a, b in zip(ks[best], ks[w])]
        if sum(g > RECENT_MARGIN for g in gain) >= 2 and all(g >= -RECENT_MARGIN for g in gain):
            best = w
    ev = "; ".join(f"{w:.0%}: " + ", ".join(f"{v:.3f}" for v in vs) for w, vs in ks.items())
    why = (f"no shorter window predicts what follows better in most validation windows, and worse in none "
           f"(KS D per window, {ev})" if best == 1.0 else
           f"its most recent {best:.0%} predicts what follows better in most of {len(full)} validation windows and "
           f"worse in none (KS D per window, {ev})")
    return best, {"mode": mode, "chosen": best, "why": why, "held_out_ks": {str(w): v for w, v in ks.items()}}


def recent_groups(groups: list[GroupSpec], share: float) -> list[GroupSpec]:
    """The most recent groups holding `share` of the executions (all of them at share 1)."""
    if share >= 1.0:
        return groups
    sizes = np.array([len(g.executions) for g in groups])
    keep = np.cumsum(sizes[::-1]) <= math.ceil(share * sizes.sum())
    return groups[len(groups) - max(1, int(keep.sum())):]


def drift_range(length: np.ndarray, step: np.ndarray, slope: float) -> tuple[float, float]:
    """The drift factors the fitted data support: each window's median over the de-drifted median
    (windows of drift_windows), widened to include 1 (the base level)."""
    if slope == 0.0 or len(length) == 0:
        return 1.0, 1.0
    base = float(np.median(length / np.exp(slope * step)))
    levels = [w["median"] / base for w in drift_windows(length, step)]
    return min(1.0, *levels), max(1.0, *levels)


def _difficulty(y: np.ndarray, group: np.ndarray) -> tuple[float, np.ndarray]:
    """(sigma of group effects, shrunken effect per execution) by one-way random effects."""
    _, inv, cnt = np.unique(group, return_inverse=True, return_counts=True)
    if len(cnt) < 2 or cnt.max() < 2:
        return 0.0, np.zeros(len(y))
    means = np.bincount(inv, weights=y) / cnt
    dev = y - means[inv]
    multi = cnt >= 2
    within = float(np.bincount(inv, weights=dev**2)[multi].sum() / (cnt[multi] - 1).sum())
    between = float(np.var(means[multi]))
    n_bar = float(cnt[multi].mean())
    var_d = max(0.0, between - within / n_bar)
    if var_d == 0.0:
        return 0.0, np.zeros(len(y))
    shrink = var_d / (var_d + within / cnt)
    effect = shrink * (means - means[multi].mean())
    return math.sqrt(var_d), effect[inv]


def _lognormal(x: np.ndarray, default: float = 1.0) -> LogNormal:
    x = x[x > 0]
    if len(x) == 0:
        return LogNormal(median=default, p99_ratio=1.0)
    med = float(np.median(x))
    return LogNormal(median=med, p99_ratio=max(1.0, float(np.quantile(x, 0.99)) / med))


def base_config(trace: Trace, train: list[GroupSpec], q: dict[str, np.ndarray], cap: float) -> WorkloadConfig:
    """The structure of the calibrated workload: from the trace's header, else from its data."""
    turns_total = max(float(q["turns"].sum()), 1.0)
    ex = [e for g in train for e in g.executions]
    kinds = [k for b in map(attrgetter("branches"), ex) if b for _, k in b]
    n_sub, n_retry = kinds.count("subagent"), kinds.count("retry")
    kv_top = np.fromiter(map(max, map(attrgetter("kv"), ex)), dtype=float, count=len(ex))
    gen_top = np.fromiter(map(max, map(attrgetter("gen"), ex)), dtype=float, count=len(ex))
    max_kv = int((kv_top + gen_top).max()) if len(ex) else 1
    sizes = np.bincount([len(g.executions) for g in trace.groups])
    fields = dict(
        prompt_tokens=_lognormal(q["prompt"]), turns=_lognormal(q["turns"]), gen_tokens=_lognormal(q["gen"]),
        tool_out_tokens=_lognormal(q["tool_out"]), tool_s=_lognormal(q["tool_s"], 1e-9), slow_tool_p=0.0,
        subagent_p=n_sub / turns_total, retry_p=n_retry / turns_total,
    )
    if trace.workload is not None:
        return replace(trace.workload, name=f"calibrated-{trace.workload.name}", **fields)
    steps = np.bincount([g.step for g in trace.groups])
    window = max(131072, 1 << int(math.ceil(math.log2(max_kv + 1))))
    return WorkloadConfig(
        name="calibrated", groups_per_step=int(steps[steps > 0].max()), group_size=int(sizes.argmax()),
        max_turns=int(cap if math.isfinite(cap) and q["turns"].max() > 1 else max(q["turns"].max(), 1)),
        context_window=window, summary_tokens=min(4096, window // 4), **fields,
    )


def fit_workload(trace: Trace, opts: WorkloadFitOptions = WorkloadFitOptions()) -> CalibratedWorkload:
    """Fit a CalibratedWorkload on the first `split` of the trace; report fit quality on the rest."""
    if not trace.groups:
        raise TraceError(f"{trace.path}: no executions to calibrate from")
    train, test = split_groups(trace.groups, opts.split)
    multi = any(len(e.gen) > 1 for g in train for e in g.executions)
    target = "turns" if multi else "gen"
    q_all = quantities(train, target)
    share, window_info = choose_window(q_all["length"], opts.recent, bool(trace.times))
    train = recent_groups(train, share)
    q = q_all if share >= 1.0 else quantities(train, target)
    length = q["length"]
    if opts.cap is not None:
        cap = float(opts.cap)
    elif target == "turns" and trace.workload is not None and q["capped"].any():
        cap = float(trace.workload.max_turns)
    else:
        cap = detect_cap(length) or math.inf
    base = base_config(trace, train, q, cap)
    k = opts.k or base.groups_per_step * base.group_size
    at_cap = length >= cap
    y = np.log(np.maximum(length, 1e-9))
    foreign = bool(trace.times)
    slope, drift_info = choose_drift(y[~at_cap], q["step"][~at_cap], opts.drift, foreign)
    if foreign and not trace.task_groups:  # groups are windows of arrivals, not tasks, so no difficulty
        sigma, effect = 0.0, np.zeros(int((~at_cap).sum()))
    else:
        sigma, effect = _difficulty(y[~at_cap] - slope * q["step"][~at_cap], q["group"][~at_cap])
    scaled = length.copy()
    scaled[~at_cap] = length[~at_cap] / np.exp(slope * q["step"][~at_cap] + effect)
    if not np.allclose(scaled, length):
        scaled[~at_cap] = np.minimum(scaled[~at_cap], cap)  # de-scaled lengths are reals, not counts
    cap_arg = cap if math.isfinite(cap) else None
    window = float(base.context_window)
    dists = {"length": fit_tail_dist(scaled, cap=cap_arg, k=k, upper=window if target == "gen" else None)}
    for name in ("gen", "tool_out", "tool_s", "prompt"):
        if len(q[name]) and not (target == "gen" and name == "gen"):
            dists[name] = fit_tail_dist(q[name], k=k, upper=None if name == "tool_s" else window)
    live = length[~at_cap]
    cw = CalibratedWorkload(base=base, dists=dists, scale_target=target, difficulty_sigma=sigma,
                            drift_per_step=math.expm1(slope),
                            drift_range=drift_range(live, q["step"][~at_cap], slope),
                            length_range=(float(live.min()), float(live.max())) if len(live) else (0.0, math.inf),
                            prompt_per_execution=foreign)
    cw.report = {
        "trace": trace.path, "executions": trace.n_executions, "fitted": int(len(length)),
        "held_out": int(sum(len(g.executions) for g in test)), "split": opts.split, "k": k,
        "cap": cap_arg, "context_window": window, "scale_target": target, "difficulty_sigma": sigma,
        "difficulty": difficulty_note(trace, train),
        "drift_per_step": cw.drift_per_step, "drift_range": list(cw.drift_range), "drift": drift_info,
        "recent": window_info,
        "tails": {(target if n == "length" else n): tail_summary(d) for n, d in dists.items()},
        "windows": drift_windows(q["length"], q["step"]),
    }
    held = quantities(test, target) if test else None
    cw.report["stationarity"] = stationarity(np.concatenate([q_all["length"], held["length"]]) if test
                                             else q_all["length"])
    if test:
        cw.report["quality"] = evaluate(cw, test, k, opts, q, held)
        cw.report["verdict"] = verdict(cw.report)
    return cw


def difficulty_note(trace: Trace, train: list[GroupSpec]) -> str:
    """Why the difficulty is (not) fitted: groups that are tasks, and how many of them hold repeated runs."""
    if trace.times and not trace.task_groups:
        return "not fitted: groups are windows of arrivals, not tasks (give sessions a task field)"
    rep = sum(len(g.executions) >= 2 for g in train)
    if rep == 0:
        return f"not fitted: none of the {len(train)} fitted tasks has two runs or more"
    return f"fitted from {rep} of {len(train)} tasks with two runs or more"


def verdict(r: dict) -> str:
    """One line: the targets met, or which were missed and why: drift (the held-out data differ from the fitted
    data beyond chance and the KS target, or the stationarity test found drift), too few held out to judge (a
    perfect model's KS D at that n is over the target), or the model."""
    q = r["quality"]
    names = {"ks_d": "KS", "p99_err": "p99", "maxk_mean_err": "max-of-K"}
    miss = {n: [names[k] for k, ok in m["marks"].items() if not ok] for n, m in q.items()}
    miss = {n: v for n, v in miss.items() if v}
    if not miss:
        return "every quantity meets the targets"
    small = [n for n in miss if q[n]["ks_perfect"] > TARGETS["ks_d"]]
    moved = [n for n in miss if n not in small and q[n].get("ks_data", 0) > max(q[n].get("ks_data_crit", 1.0),
                                                                                 TARGETS["ks_d"])]
    drift = r.get("stationarity", {}).get("verdict") == "drift"
    parts = []
    if small:
        parts.append(f"{', '.join(small)}: too few held out to judge (n {min(int(q[n]['n_test']) for n in small)}: a "
                     f"perfect model's KS D is {max(q[n]['ks_perfect'] for n in small):.2f} there)")
    if moved:
        by = ", ".join(f"{n} KS D {q[n]['ks_data']:.3f} > {q[n]['ks_data_crit']:.3f}" for n in moved)
        parts.append(f"{', '.join(moved)}: the held-out data differ from the fitted data beyond chance ({by}): "
                     "drift, not a bad model; --recent auto or --drift linear model change")
    rest = [n for n in miss if n not in small and n not in moved]
    if rest:
        which = ", ".join(n + " (" + "/".join(miss[n]) + ")" for n in rest)
        parts.append(f"{which}: " + ("the trace's length drifts across its time slices (stationarity), the likely "
                                     "cause" if drift else "missed on data that do not drift: the model does not "
                                                           "fit these"))
    return "misses: " + "; ".join(parts)


def tail_summary(d) -> dict:
    """How a quantity's tail was modelled: threshold u (a value, not a quantile), shape, clamps, notes."""
    out = {"kind": d.kind, "clamp": d.upper, "cap": d.cap, "p_cap": d.p_cap}
    if d.kind == "tail":
        out.update(u=d.u, p_tail=d.p_tail, xi=d.xi if d.p_tail > 0 else None, sigma=d.sigma if d.p_tail > 0 else None)
    if d.note:
        out["note"] = d.note
    return out


def drift_windows(length: np.ndarray, step: np.ndarray, n: int = 8) -> list[dict[str, float]]:
    """Median and p99 of the length per window of steps (the drift the fit saw)."""
    edges = np.unique(np.quantile(step, np.linspace(0, 1, n + 1)))
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (step >= lo) & ((step < hi) | (hi == edges[-1]))
        if m.any():
            rows.append({"steps": f"{int(lo)}-{int(hi)}", "n": int(m.sum()), "median": float(np.median(length[m])),
                         "p99": float(np.quantile(length[m], 0.99))})
    return rows
