"""Tail-aware length distributions and how to judge them on held-out data.

TailDist is a three-part mixture, the shape of rollout lengths that decides makespan:
- a point mass `p_cap` at the length cap (executions cut off there);
- an empirical body: the training data at or below a threshold u, kept exactly (the ECDF over its
  distinct values) or, when it has too many distinct values, as 2,049 quantile knots with linear
  interpolation;
- above u, a generalized Pareto tail (scipy.stats.genpareto, MLE with location 0) on the excesses,
  truncated at the cap.
u is chosen among candidate quantiles by held-out error: fit on the first 75% of the training data
(in time order), score tail quantiles on the last 25%, refit on all of it with the winner. The
empirical tail (no GPD: the data's own distribution, up to the largest value seen) is one more
candidate, scored the same way: when it predicts the held-out end better, no tail is extrapolated.
With little data (< SMALL_N values, or too few above every candidate u) the body and tail are
replaced by a two-component Gaussian mixture on log-length (EM), floored at the observed minimum.

Integer data (token counts, turns) stay integer: the tail excess Y is fitted with a continuity
correction (k - 0.5) and sampled as u + ceil(Y). Sampling is inverse-CDF on uniforms from a passed
numpy Generator, so a seed fixes every draw.

Every draw is clamped at `upper` when set (the context window: no token count exceeds it) and
below the cap. The tail is bounded by what the data support: the GPD is truncated at `endpoint` =
the largest value seen x (1 + TAIL_TOL), TAIL_TOL = 0.15 being the calibration target for the p99 and
the max of K (workload_fit.TARGETS): a draw further past the data than the target allows would be a
miss of the target by construction (an unbounded tail of shape 0.665 fitted to tool latencies up to 65 s
reached ~10^4 s). A GPD candidate whose expected max of K overshoots the inner held-out one by more
than TAIL_TOL is rejected in the threshold choice, and the empirical tail is kept when every one is. A GPD tail has a finite mean only for shape xi < 1; a fitted xi >= XI_FINITE is not
used: the tail falls back to the empirical one (the body then holds all the data, up to the largest
value seen), and `note` says so.

fit_quality compares two samples (the model's, drawn large, and held-out data): KS D, Wasserstein-1
(absolute and relative to the held-out mean), relative error of p50/p90/p99, and of the median and
the mean of the maximum over K draws (K at most the held-out size), which is what a batch of K
waits on. The median of the max is the quantile at 0.5 ** (1 / K); the mean is exact for each
sample's empirical distribution: sum of x_(i) * ((i / n) ** K - ((i - 1) / n) ** K).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import optimize, stats

SMALL_N = 200
MIN_TAIL = 30
THRESHOLDS = (0.8, 0.85, 0.9, 0.93, 0.95, 0.97)
MAX_EXACT_VALUES = 4096
KNOTS = 2049
XI_FINITE = 1.0  # a GPD has a finite mean only below this shape
TAIL_TOL = 0.15  # how far past the data a tail may reach (the p99 / max-of-K target, see the module doc)
XI_MIN = -0.5  # below this the GPD likelihood is not regular (below -1 it is unbounded): Smith (1985)


def gpd_ppf(p: np.ndarray, xi: float, sigma: float) -> np.ndarray:
    """Generalized Pareto inverse CDF (numpy; scipy's per-call overhead dominates small draws)."""
    if abs(xi) < 1e-9:
        return -sigma * np.log1p(-p)
    return sigma / xi * ((1.0 - p) ** (-xi) - 1.0)


def gpd_cdf(y: float, xi: float, sigma: float) -> float:
    if y <= 0:
        return 0.0
    if abs(xi) < 1e-9:
        return float(1.0 - np.exp(-y / sigma))
    z = 1.0 + xi * y / sigma
    return 1.0 if z <= 0 else float(1.0 - z ** (-1.0 / xi))


def gpd_mle(y: np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood (xi, sigma) of a generalized Pareto with location 0 (Nelder-Mead from moments),
    the shape held at xi >= XI_MIN: below -0.5 the MLE is not regular, and below -1 the likelihood grows
    without bound as the endpoint sigma / |xi| nears the largest excess (Smith, "Maximum likelihood
    estimation in a class of nonregular cases", Biometrika 1985), so an unconstrained search ends on a
    density that piles up at the endpoint, whatever the data's shape. On the boundary sigma is refitted
    with xi = XI_MIN."""
    m, v = float(np.mean(y)), float(np.var(y))
    xi0 = float(np.clip(0.5 * (1 - m * m / max(v, 1e-12)), -0.4, 0.9))
    s0 = max(m * (1 - xi0), 1e-9)
    ymax = float(np.max(y))
    if xi0 < 0 and 1 + xi0 * ymax / s0 <= 0:  # the moment start ends below the largest value: start exponential
        xi0, s0 = 0.0, max(m, 1e-9)

    def nll(p: np.ndarray) -> float:
        xi, sigma = p[0], math.exp(p[1])
        if xi < 0 and 1 + xi * ymax / sigma <= 0:
            return math.inf
        if abs(xi) < 1e-9:
            return len(y) * p[1] + float(y.sum()) / sigma
        return len(y) * p[1] + (1 + 1 / xi) * float(np.log1p(xi * y / sigma).sum())

    with np.errstate(all="ignore"):  # the search tries shapes whose likelihood overflows: inf, not a warning
        res = optimize.minimize(nll, np.array([xi0, math.log(s0)]), method="Nelder-Mead",
                                options={"xatol": 1e-6, "fatol": 1e-9, "maxiter": 2000})
        if res.x[0] >= XI_MIN:
            return float(res.x[0]), float(math.exp(res.x[1]))
        lo = math.log(-XI_MIN * ymax) + 1e-9  # sigma > |xi| ymax keeps every excess inside the support
        edge = optimize.minimize_scalar(lambda t: nll(np.array([XI_MIN, t])), bounds=(lo, lo + 12.0),
                                        method="bounded", options={"xatol": 1e-9})
    return XI_MIN, float(math.exp(edge.x))


@dataclass(kw_only=True)
class TailDist:
    kind: str  # "tail" (empirical body + GPD tail) or "logmix" (Gaussian mixture on log-length)
    discrete: bool
    p_cap: float = 0.0
    cap: float | None = None
    # kind == "tail"
    body_x: np.ndarray = field(default_factory=lambda: np.zeros(0))
    body_cum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    body_step: bool = True  # exact ECDF steps, else linear between knots
    u: float = 0.0
    p_tail: float = 0.0
    xi: float = 0.0
    sigma: float = 1.0
    # kind == "logmix"
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0))
    mu: np.ndarray = field(default_factory=lambda: np.zeros(0))
    sd: np.ndarray = field(default_factory=lambda: np.zeros(0))
    floor: float = 0.0
    upper: float | None = None  # every draw is clamped here (the context window)
    endpoint: float | None = None  # the GPD tail is truncated here (the largest value seen x (1 + TAIL_TOL))
    note: str = ""  # what the fit did that a reader should know (e.g. an empirical tail fallback)

    def quantile(self, q: np.ndarray) -> np.ndarray:
        """Inverse CDF at probabilities q in [0, 1)."""
        q = np.asarray(q, dtype=float)
        out = np.full(q.shape, np.nan if self.cap is None else float(self.cap))
        p_rest = 1.0 - self.p_cap
        live = q < p_rest
        r = q[live] / p_rest if p_rest > 0 else q[live]
        out[live] = self._body_tail(r) if self.kind == "tail" else self._logmix(r)
        return out

    def mean_max(self, k: int, n: int = 8192) -> float:
        """Expected maximum of k draws: the mean of Q(V ** (1 / k)) over V uniform (midpoint rule)."""
        return float(self.quantile(((np.arange(n) + 0.5) / n) ** (1.0 / k)).mean())

    def sample(self, rng: np.random.Generator, size: int | tuple[int, ...]) -> np.ndarray:
        return self.quantile(rng.random(size))

    def _body_tail(self, r: np.ndarray) -> np.ndarray:
        out = np.empty_like(r)
        pb = 1.0 - self.p_tail
        body = r < pb
        rb = r[body] / pb if pb > 0 else r[body]
        if self.body_step:
            idx = np.minimum(np.searchsorted(self.body_cum, rb, side="right"), len(self.body_x) - 1)
            out[body] = self.body_x[idx]
        else:
            out[body] = np.interp(rb, self.body_cum, self.body_x)
        if self.p_tail > 0:
            rt = (r[~body] - pb) / self.p_tail
            top = min(v for v in (self.cap, self.endpoint, math.inf) if v is not None)
            hi = gpd_cdf(top - self.u, self.xi, self.sigma) if math.isfinite(top) else 1.0
            y = gpd_ppf(rt * hi, self.xi, self.sigma)
            out[~body] = self.u + (np.maximum(np.ceil(y), 1.0) if self.discrete else y)
        if self.discrete:
            out = np.round(out)
        return self._clip(out)

    def _logmix(self, r: np.ndarray) -> np.ndarray:
        # invert the mixture CDF on a fine log grid (monotone, deterministic)
        grid = np.linspace(self.mu.min() - 6 * self.sd.max(), self.mu.max() + 6 * self.sd.max(), 4097)
        cdf = (self.weights[:, None] * stats.norm.cdf((grid[None, :] - self.mu[:, None]) / self.sd[:, None])).sum(0)
        out = np.exp(np.interp(r, cdf, grid))
        out = np.maximum(out, self.floor)
        return self._clip(np.round(out) if self.discrete else out)

    def _clip(self, x: np.ndarray) -> np.ndarray:
        if self.cap is not None:
            x = np.minimum(x, self.cap - 1 if self.discrete else self.cap)
        if self.upper is not None:
            x = np.minimum(x, self.upper)
        if self.endpoint is not None:
            x = np.minimum(x, self.endpoint)
        return x

    def to_dict(self) -> dict[str, Any]:
        d = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in self.__dict__.items()}
        return {k: v for k, v in d.items() if (v != [] or k.startswith("body")) and v != ""}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TailDist:
        kw = {k: (np.asarray(v, dtype=float) if isinstance(v, list) else v) for k, v in d.items()}
        return cls(**kw)


def detect_cap(x: np.ndarray, min_share: float = 0.002, min_count: int = 5) -> float | None:
    """The maximum is a length cap when it repeats (a point mass), not when it is a lone extreme."""
    if len(x) == 0:
        return None
    m = float(np.max(x))
    k = int(np.count_nonzero(x == m))
    return m if k >= min_count and k >= min_share * len(x) else None


def _body(x: np.ndarray, discrete: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    vals, counts = np.unique(x, return_counts=True)
    if len(vals) <= MAX_EXACT_VALUES:
        return vals.astype(float), np.cumsum(counts) / counts.sum(), True
    p = np.linspace(0.0, 1.0, KNOTS)
    return np.quantile(x, p).astype(float), p, False


def _fit_tail(x: np.ndarray, q_u: float, cap: float | None, discrete: bool) -> TailDist | None:
    u = float(np.quantile(x, q_u, method="inverted_cdf"))
    tail = x[x > u]
    if len(tail) < MIN_TAIL or np.count_nonzero(x <= u) == 0:
        return None
    y = tail - u - (0.5 if discrete else 0.0)
    if len(y) > 50_000:  # the MLE does not need more; take an even subsample (deterministic)
        y = np.sort(y)[:: len(y) // 50_000 + 1]
    xi, sigma = gpd_mle(y)
    if xi >= XI_FINITE:  # no finite mean: keep the data's own tail instead
        return _fit_empirical(x, cap, discrete, f"empirical tail: the GPD shape {xi:.2f} above u={u:g} "
                                                f"has no finite mean (xi >= {XI_FINITE:g})")
    bx, bc, step = _body(x[x <= u], discrete)
    return TailDist(kind="tail", discrete=discrete, cap=cap, body_x=bx, body_cum=bc, body_step=step, u=u,
                    p_tail=len(tail) / len(x), xi=float(xi), sigma=float(sigma))


def _fit_empirical(x: np.ndarray, cap: float | None, discrete: bool, note: str = "") -> TailDist:
    """The data's own distribution, up to the largest value seen (no extrapolated tail)."""
    bx, bc, step = _body(x, discrete)
    return TailDist(kind="tail", discrete=discrete, cap=cap, body_x=bx, body_cum=bc, body_step=step,
                    u=float(np.max(x)), note=note)


def _fit_logmix(x: np.ndarray, cap: float | None, discrete: bool, k: int = 2, iters: int = 200) -> TailDist:
    z = np.log(np.maximum(x, 1e-12))
    k = 1 if len(z) < 20 or np.std(z) == 0 else k
    mu = np.quantile(z, (np.arange(k) + 0.5) / k)
    sd = np.full(k, max(np.std(z), 1e-3))
    w = np.full(k, 1.0 / k)
    for _ in range(iters if k > 1 else 0):  # EM (a collapsing component underflows to 0, not a warning)
        with np.errstate(all="ignore"):
            dens = w[:, None] * stats.norm.pdf(z[None, :], mu[:, None], sd[:, None]) + 1e-300
            resp = dens / dens.sum(0)
        nk = resp.sum(1)
        w = nk / nk.sum()
        mu = (resp * z).sum(1) / nk
        sd = np.sqrt(np.maximum((resp * (z - mu[:, None]) ** 2).sum(1) / nk, 1e-6))
    if k == 1:
        mu, sd, w = np.array([z.mean()]), np.array([max(z.std(), 1e-3)]), np.array([1.0])
    return TailDist(kind="logmix", discrete=discrete, cap=cap, weights=w, mu=mu, sd=sd, floor=float(x.min()))


def _tail_score(d: TailDist, test: np.ndarray, k: int) -> float:
    """Mean relative error of p90, p99, and the median and mean of the max of k, model vs test."""
    qs = np.array([0.9, 0.99, 0.5 ** (1.0 / k)])
    m, t = d.quantile(qs), np.quantile(test, qs)
    m = np.append(m, d.mean_max(k))
    t = np.append(t, mean_max(test, k))
    return float(np.mean(np.abs(m - t) / np.maximum(np.abs(t), 1e-12)))


def mean_max(x: np.ndarray, k: int) -> float:
    """Expected maximum of k draws (with replacement) from the empirical distribution of x."""
    x = np.sort(np.asarray(x, dtype=float))
    n = len(x)
    w = np.diff(np.power(np.arange(n + 1) / n, k))
    return float(w @ x)


def fit_tail_dist(x: np.ndarray, *, cap: float | None = None, k: int = 512, upper: float | None = None,
                  thresholds: tuple[float, ...] = THRESHOLDS) -> TailDist:
    """Fit a TailDist to x (in time order: the inner held-out split for the threshold is its end);
    draws are clamped at `upper` (None: unbounded)."""
    x = np.asarray(x, dtype=float)
    if len(x) == 0:
        raise ValueError("cannot fit a distribution to no data")
    discrete = bool(np.all(x == np.round(x)))
    at_cap = x >= cap if cap is not None else np.zeros(len(x), bool)
    rest = x[~at_cap]
    p_cap = float(at_cap.mean())
    if len(rest) == 0:
        return TailDist(kind="tail", discrete=discrete, cap=cap, p_cap=1.0, body_x=np.array([cap]),
                        body_cum=np.array([1.0]), upper=upper)
    best = None
    if len(rest) >= SMALL_N:
        cut = int(0.75 * len(rest))
        inner, held = rest[:cut], rest[cut:]
        kk = min(k, len(held))
        scored, overshoot = [], []
        held_max = mean_max(held, kk)
        for q in thresholds:
            d = _fit_tail(inner, q, cap, discrete)
            if d is None:
                continue
            d.endpoint = _endpoint(inner, discrete)
            if d.p_tail > 0 and d.mean_max(kk) > (1 + TAIL_TOL) * held_max:
                overshoot.append(d.mean_max(kk) / held_max - 1)  # the tail reaches past what the data support
                continue
            scored.append((_tail_score(d, held, kk), q))
        if overshoot and not scored:
            best = _fit_empirical(rest, cap, discrete, f"empirical tail: every GPD tail's max of {kk} overshoots the "
                                                       f"held-out end by {min(overshoot):.0%} or more "
                                                       f"(> {TAIL_TOL:.0%})")
        empirical = _tail_score(_fit_empirical(inner, cap, discrete), held, kk)
        if scored and empirical < min(scored)[0]:  # the GPD extrapolates worse than the data's own tail
            best = _fit_empirical(rest, cap, discrete, f"empirical tail: it predicts the end of the fitted data "
                                                       f"better than a GPD tail (tail error {empirical:.3f} vs "
                                                       f"{min(scored)[0]:.3f})")
        for _, q in sorted(scored) if best is None else []:
            best = _fit_tail(rest, q, cap, discrete)
            if best is not None:
                break
    if best is None:
        best = _fit_logmix(rest, cap, discrete)
    best.p_cap = p_cap
    best.upper = upper
    best.endpoint = _endpoint(rest, discrete)
    return best


def _endpoint(x: np.ndarray, discrete: bool) -> float:
    """The largest value a fitted tail may reach: the largest seen x (1 + TAIL_TOL) (see the module doc)."""
    e = float(np.max(x)) * (1 + TAIL_TOL)
    return float(math.ceil(e)) if discrete else e


def _ecdf_distances(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(KS D, Wasserstein-1) of two samples from their ECDFs on the union of their values."""
    a, b = np.sort(a), np.sort(b)
    grid = np.unique(np.concatenate([a, b]))
    fa = np.searchsorted(a, grid, side="right") / len(a)
    fb = np.searchsorted(b, grid, side="right") / len(b)
    diff = np.abs(fa - fb)
    return float(diff.max()), float((diff[:-1] * np.diff(grid)).sum())


def fit_quality(model: np.ndarray, test: np.ndarray, k: int) -> dict[str, float]:
    """Compare a (large) model sample with held-out data; relative errors are |model - test| / test.
    K is capped at the held-out size (a max over more values than were held out is not measured)."""
    model = np.asarray(model, dtype=float)
    test = np.asarray(test, dtype=float)
    k = max(1, min(int(k), len(test)))
    out: dict[str, float] = {"n_test": float(len(test)), "k": float(k)}
    out["ks_d"], w = _ecdf_distances(model, test)
    out["wasserstein"] = w
    out["wasserstein_rel"] = w / max(float(np.mean(test)), 1e-12)
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("maxk", 0.5 ** (1.0 / k))):
        m, t = float(np.quantile(model, q)), float(np.quantile(test, q))
        out[f"{name}_model"], out[f"{name}_test"] = m, t
        out[f"{name}_err"] = abs(m - t) / max(abs(t), 1e-12)
    m, t = mean_max(model, k), mean_max(test, k)
    out["maxk_mean_model"], out["maxk_mean_test"] = m, t
    out["maxk_mean_err"] = abs(m - t) / max(abs(t), 1e-12)
    return out
