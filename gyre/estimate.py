"""The cost estimate a policy may observe: what a training step and an engine step cost on this cluster.

A real RL system knows what a step costs before it takes one: it has profiled the model or calibrated it.
`CostEstimate` is that knowledge, read-only, on both backends (`Cluster.estimate`):

- `train_s(tokens, attn_ctx_tokens, gpus)`: seconds of one training step of a batch with `tokens` trained
  tokens whose attention contexts sum to `attn_ctx_tokens` (the sum over trained tokens of the context
  each attends to), on `gpus` GPUs (data parallel: the time divides by the GPU count);
- `decode_tokens_per_s(n, context_tokens)`: an engine's decode throughput (tokens/s, all sequences
  together) while it runs `n` sequences whose contexts sum to `context_tokens`;
- `prefill_s(n, context_tokens, offset)`: the engine seconds one prefilled token (a prompt, a tool's output)
  at `offset` adds to a step decoding those `n` sequences (chunked prefill: a step carries the decodes and a
  chunk of the prefill queue within the token budget, so prefill slows the decodes it shares steps with);
  None where the estimate has no prefill figure (a calibration without one: stated by `describe`);
- `loaded_step_s(n, context_tokens, prefill_per_token)`: the mean step per decoded token when each decoded
  token brings `prefill_per_token` tokens to prefill on the same engine (its prompt and tool outputs, a
  ratio the policy observes): the decode step plus n x that ratio prefilled tokens at `prefill_s`, each at
  the sequences' mean context (a tool's output is prefilled after its sequence's context);
- `kv_capacity` (KV tokens an engine holds), `engine_gpus`, `min_train_gpus` (the trainer's memory
  minimum) and `max_running` (sequences an engine runs at once; 0: no limit);
- what a role switch costs: `engine_start_s` (an engine serving after it is started), `engine_stop_s`,
  and `trainer_start_s` (the trainer's state loaded onto GPUs that ran an engine).

Where the numbers come from: the simulator's derived costs (gyre.hardware.Costs: the roofline engine step,
training FLOPs at the trainer's MFU), or on the real backend a calibration file (a JSON object of the
fields below, written by `gyre-real calibrate --estimate-out`) or a start-up profile (gyre.real.profile).
Both real sources fit measured timings with the same functions: `fit_step` (the engine step line,
least squares over decode steps), `fit_train_s_per_token_gpu` (measured training seconds x GPUs over
trained tokens) and, for the start-up profile, `fit_prefill_s_per_token` (its prompts' prefill seconds
over their tokens; a calibration takes the calibrated cost model's). It is hardware and model knowledge, not foresight: nothing in it depends on the
workload's future.

`batch_counts` turns observed executions into the two counts `train_s` takes: trained tokens are the
executions' trajectory tokens (the group's shared prompt counted once per execution, a small overcount),
and the attention sum is, per execution of L tokens, L x min(L, C) / 2 with C the largest context seen
(a causal sequence of L tokens attends to L^2 / 2 context tokens; one compacted whenever its context
reaches C attends to about C / 2 per token). These are exact training's counts: where role-bounded path
sampling trains fewer paths (gyre.trajectory.sample, j_max), a caller scales them by the cluster's observed
`trained_share` (what the latest finished step trained over its exact counts; (1.0, 1.0) under exact training,
so the product is the counts themselves), as policies.elastic does; `batch_counts` itself stays a pure function
of the executions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from gyre.config import ConfigError


class EstimateError(ConfigError):
    """A missing, negative or non-finite cost estimate (the message names the file and field)."""


@dataclass(frozen=True, kw_only=True)
class LinearStep:
    """An engine step as a calibrated line: a + b x sequences + c x context tokens (seconds)."""

    a: float
    b: float
    c: float

    def __call__(self, n: int, ctx: float) -> float:
        return self.a + self.b * n + self.c * ctx


@dataclass(frozen=True, kw_only=True)
class CostEstimate:
    """Read-only cost knowledge of one cluster (see the module docstring)."""

    engine_gpus: int
    kv_capacity: int  # KV tokens one engine holds
    min_train_gpus: int
    max_running: int  # sequences one engine runs at once (0: no limit)
    train_s_per_token_gpu: float  # training seconds per trained token on one GPU
    train_s_per_attn_gpu: float  # training seconds per (token x attended context token) on one GPU
    step_a: float  # engine step seconds, fixed part (used when `step` is not given)
    step_b: float  # engine step seconds per running sequence
    step_c: float  # engine step seconds per context token read
    engine_start_s: float  # from starting an engine to its serving the latest weights (wake + sync)
    engine_stop_s: float  # from stopping an engine to its GPUs being free
    trainer_start_s: float  # loading the trainer's state onto GPUs that ran an engine
    source: str = ""  # where the figures come from (stated in the run's output)
    step: object = None  # a function (n, ctx) -> seconds that replaces the linear step (the simulator's roofline)
    # engine seconds per prefilled token in a step's chunk (a line's; None: not measured, prefill counted free)
    prefill_s_per_token: float | None = None
    prefill: object = None  # a function (n, ctx, offset) -> prefill_s (the simulator's roofline), replacing the line

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("source", "step", "prefill") or (f.name == "prefill_s_per_token" and v is None):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise EstimateError(f"cost estimate{' ' + self.source if self.source else ''}: {f.name} must be a "
                                    f"finite number >= 0, got {v!r}")
        for name in ("engine_gpus", "kv_capacity", "min_train_gpus"):
            if getattr(self, name) < 1:
                raise EstimateError(f"cost estimate{' ' + self.source if self.source else ''}: {name} must be >= 1, "
                                    f"got {getattr(self, name)!r}")
        if self.train_s_per_token_gpu <= 0:
            raise EstimateError(f"cost estimate{' ' + self.source if self.source else ''}: train_s_per_token_gpu "
                                f"must be > 0, got {self.train_s_per_token_gpu!r}")
        if self.step is None and self.step_a + self.step_b <= 0:
            raise EstimateError(f"cost estimate{' ' + self.source if self.source else ''}: step_a + step_b must be "
                                f"> 0 (an engine step takes time)")

    # --- what a policy asks ---
    def train_s(self, tokens: float, attn_ctx_tokens: float, gpus: int) -> float:
        """Seconds of one training step of `tokens` tokens (attention contexts summing to `attn_ctx_tokens`)
        on `gpus` GPUs."""
        return (tokens * self.train_s_per_token_gpu + attn_ctx_tokens * self.train_s_per_attn_gpu) / max(gpus, 1)

    def step_s(self, n: int, context_tokens: float) -> float:
        """Seconds of one engine step decoding `n` sequences whose contexts sum to `context_tokens`."""
        f = self.step if self.step is not None else LinearStep(a=self.step_a, b=self.step_b, c=self.step_c)
        return f(n, context_tokens)

    def prefill_s(self, n: int, context_tokens: float, offset: float) -> float | None:
        """Engine seconds one prefilled token at `offset` adds to a step decoding `n` sequences whose contexts
        sum to `context_tokens`; None where the estimate has no prefill figure."""
        if self.prefill is not None:
            return self.prefill(n, context_tokens, offset)
        return self.prefill_s_per_token

    def loaded_step_s(self, n: int, context_tokens: float, prefill_per_token: float) -> float:
        """Seconds per decoded token of an engine running `n` sequences whose every decoded token brings
        `prefill_per_token` tokens to prefill on it (module docstring); the decode step alone where the
        estimate has no prefill figure or nothing is prefilled."""
        step = self.step_s(n, context_tokens)
        if n <= 0 or prefill_per_token <= 0:
            return step
        q = self.prefill_s(n, context_tokens, context_tokens / n)
        return step if q is None else step + n * prefill_per_token * q

    def decode_tokens_per_s(self, n: int, context_tokens: float) -> float:
        """An engine's decode throughput (tokens/s over all its sequences) at `n` running sequences."""
        if n <= 0:
            return 0.0
        return n / self.step_s(n, context_tokens)

    def describe(self) -> str:
        """One line: the figures, and where they come from."""
        q = self.prefill_s(1, 0, 0)
        pf = "not measured (counted free)" if q is None else f"{q * 1e6:.4g} us/token beside 1 decode at offset 0"
        return (f"cost estimate ({self.source or 'unnamed'}): training {self.train_s_per_token_gpu * 1e3:.4g} ms/token "
                f"x GPU + {self.train_s_per_attn_gpu * 1e12:.4g} ps/(token x context token) x GPU; engine of "
                f"{self.engine_gpus} GPU(s) decodes {self.decode_tokens_per_s(1, 0):.4g} tokens/s at 1 sequence, "
                f"{self.decode_tokens_per_s(64, 64 * 1024):.4g} at 64 of 1K context; prefill {pf}; KV "
                f"{self.kv_capacity:,} tokens per engine; trainer needs >= {self.min_train_gpus} GPU(s)")

    def as_dict(self) -> dict:
        """The file form (what `from_file` reads); the simulator's roofline is summarized by its line."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("step", "source", "prefill")}


FILE_FIELDS = tuple(f.name for f in fields(CostEstimate) if f.name not in ("step", "source", "prefill"))
OPTIONAL_FIELDS = ("prefill_s_per_token",)  # a calibration without it has no prefill figure


def from_costs(costs, source: str = "derived costs") -> CostEstimate:
    """The estimate from a cost model (gyre.hardware.Costs): its engine step (roofline or line) and training."""
    attn = (costs.train_attn_flops_per_ctx_token / costs.train_flops_per_s_gpu if costs.train_flops_per_s_gpu
            else 0.0)
    step = (lambda n, ctx: costs.step_time(n, ctx)) if costs.roofline is not None else None

    def prefill(n: int, ctx: float, offset: float) -> float:
        """What the engine charges a chunk of the budget the n decodes leave (sim.cluster.engine), per token."""
        m = max(costs.max_batched_tokens - n, 1)
        return (costs.step_time(n, ctx, m, offset) - costs.step_time(n, ctx)) / m

    return CostEstimate(engine_gpus=costs.engine_gpus, kv_capacity=costs.kv_capacity_tokens,
                        min_train_gpus=costs.min_train_gpus, max_running=costs.max_num_seqs,
                        train_s_per_token_gpu=costs.train_s_per_token_gpu, train_s_per_attn_gpu=attn,
                        step_a=costs.step_a, step_b=costs.step_b, step_c=costs.step_c,
                        engine_start_s=costs.engine_wake_s + costs.sync_s, engine_stop_s=costs.engine_sleep_s,
                        trainer_start_s=costs.trainer_onload_s, source=source, step=step,
                        prefill_s_per_token=costs.prefill_s_per_token, prefill=prefill)


def from_file(path: str | Path) -> CostEstimate:
    """The estimate a calibration file holds (a JSON object of FILE_FIELDS); one line naming the file and
    field on any problem."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise EstimateError(f"{p}: cannot read the cost estimate: {exc}") from None
    if not isinstance(data, dict):
        raise EstimateError(f"{p}: a cost estimate is a JSON object of {', '.join(FILE_FIELDS)}")
    missing = [k for k in FILE_FIELDS if k not in data and k not in OPTIONAL_FIELDS]
    if missing:
        raise EstimateError(f"{p}: cost estimate field {missing[0]} is missing")
    extra = [k for k in data if k not in FILE_FIELDS]
    if extra:
        raise EstimateError(f"{p}: unknown cost estimate field {extra[0]!r}; known: {', '.join(FILE_FIELDS)}")
    for k in ("engine_gpus", "kv_capacity", "min_train_gpus", "max_running"):
        if isinstance(data[k], float) and data[k].is_integer():
            data[k] = int(data[k])
    return CostEstimate(**data, source=str(p))


def write_file(est: CostEstimate, path: str | Path) -> None:
    Path(path).write_text(json.dumps(est.as_dict(), indent=1) + "\n")


def fit_step(decode) -> LinearStep:
    """The engine step line a + b x sequences + c x context tokens, least squares over measured decode steps
    [(sequences, context tokens, seconds)]. A coefficient the noise makes negative is 0; a line whose fixed
    part is 0 takes the median step as it (a step never costs nothing)."""
    dec = np.asarray(decode if decode is not None else [], dtype=np.float64).reshape(-1, 3)
    if len(dec) < 3:
        raise EstimateError("profile has fewer than 3 decode steps; run longer")
    X = np.column_stack([np.ones(len(dec)), dec[:, 0], dec[:, 1]])
    coef, *_ = np.linalg.lstsq(X, dec[:, 2], rcond=None)
    a, b, c = (max(0.0, float(x)) for x in coef)
    if a == 0.0:
        a = float(np.median(dec[:, 2]))
    return LinearStep(a=a, b=b, c=c)


def fit_train_s_per_token_gpu(train, gpus: float) -> float:
    """Training seconds per trained token on one GPU: the measured steps [(tokens, wall seconds, ...)] on
    `gpus` GPUs, their seconds x GPUs over their tokens (a step's fixed cost is spread over its tokens)."""
    tr = np.asarray(train if train is not None else [], dtype=np.float64)
    if not len(tr):
        raise EstimateError("profile has no training step")
    tr = tr.reshape(len(tr), -1)
    if not np.sum(tr[:, 0]) > 0:
        raise EstimateError(f"profile's training steps trained {np.sum(tr[:, 0])} tokens; a rate needs some")
    return float(np.sum(tr[:, 1]) / np.sum(tr[:, 0])) * gpus


def fit_prefill_s_per_token(prefill) -> float | None:
    """Engine seconds per prefilled token: the measured prefills [(tokens, seconds)], their seconds over
    their tokens (prefilled alone, so an upper bound on a token's cost beside decodes); None without any."""
    pf = np.asarray(prefill if prefill is not None else [], dtype=np.float64).reshape(-1, 2)
    tokens = float(np.sum(pf[:, 0])) if len(pf) else 0.0
    if not tokens > 0:
        return None
    rate = float(np.sum(pf[:, 1])) / tokens
    if not math.isfinite(rate) or rate < 0:
        raise EstimateError(f"profile's prefills give {rate!r} s per token")
    return rate


def batch_counts(executions: Iterable, max_context: float = math.inf,
                 share: tuple[float, float] = (1.0, 1.0)) -> tuple[float, float]:
    """(trained tokens, attention context sum) of finished executions, from their trajectory tokens and
    the largest context seen (module docstring), each times its `share` (`Cluster.trained_share`: what the
    last step trained of its exact work; (1.0, 1.0) while every path trains)."""
    tokens = attn = 0.0
    for x in executions:
        n = float(x.trajectory_tokens)
        tokens += n
        attn += 0.5 * n * min(n, max_context)
    return tokens * share[0], attn * share[1]
