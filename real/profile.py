"""The start-up profile: the cost estimate (gyre.estimate) measured on this run's own engine and trainer.

What it measures, before the run's clock starts: one engine (the first engine slot) is woken with the
trainer's weights (`engine_start_s`), decodes a few tokens for 1, 4 and 16 sequences at once, each at two
contexts (a quarter of the task's `max_context` and all of it), and is put back to sleep
(`engine_stop_s`); trainer worker 0 takes one training step on each of two synthetic batches, the run's
batch shape (groups_per_step groups of group_size executions) of L and L / 2 tokens per execution, L the
task's `max_context` or less, so that the larger step trains at most TRAIN_TOKENS tokens and a sequence
fits the trainer's pack. The decode steps
the engine timed fit the engine step line, its prompts' prefills the prefill rate, and the two steps the
training rate, with the functions
`gyre-real calibrate` fits a run's profile with (gyre.estimate.fit_step, fit_train_s_per_token_gpu; the
prefill rate by gyre.estimate.fit_prefill_s_per_token).

Assumptions: a training step's seconds divide by its GPU count (data parallel), measured on one worker;
its fixed cost (optimizer step, packing) is spread over the tokens of a batch of the run's own shape; the
trainer's state is reset after it (the run starts from its own `reset` or checkpoint, as without a
profile); `trainer_start_s` is 0 (each GPU keeps its trainer worker resident). The engine size, KV
capacity and trainer minimum are the cluster's. A figure the timings make non-finite is one line naming
it (gyre.estimate.EstimateError). One profile per pool config and task context serves every run on that
pool (the policies compared in one `gyre-real run` read the same figures).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import ray

from gyre.estimate import (CostEstimate, EstimateError, fit_prefill_s_per_token, fit_step, fit_train_s_per_token_gpu,
                           from_file)
from gyre.trajectory import TaskRecorder

SOURCE = "start-up profile"
DECODE_SEQUENCES = (1, 4, 16)  # sequences decoding at once: the fit needs >= 3 to separate the step's two terms
DECODE_TOKENS = 8  # tokens each sequence decodes per round: steps enough for the least squares, seconds in all
TOKEN_IDS = 8  # synthetic tokens are drawn from ids [0, 8), valid in every vocabulary
# trained tokens of the profile's larger step at most: a step's fixed cost is spread over this many or more
# (the tiny presets' steps train ~1-3K), and a long-context task's full-batch step does not make the profile long
TRAIN_TOKENS = 4096


def _contexts(max_context: int) -> tuple[int, int]:
    """The two prompt lengths profiled: a quarter of the task's largest context and all of it (less the
    decoded tokens, so a sequence never outgrows it)."""
    long = max(2, max_context - DECODE_TOKENS)
    return max(1, long // 4), long


def _train_batch(groups: int, size: int, tokens: int, rng: np.random.Generator) -> list:
    """`groups` synthetic GRPO groups of `size` executions, each a one-token prompt then `tokens` trained
    tokens, with advantages of both signs (every token carries a gradient)."""
    batch = []
    for g in range(groups):
        rec = TaskRecorder(f"profile{g}", [0])
        for _ in range(size):
            ex = rec.start()
            ex.append_model(rng.integers(0, TOKEN_IDS, tokens), np.full(tokens, -np.log(TOKEN_IDS)), 0)
            ex.finish(0.0)
        batch.append((rec.tree.preorder(), np.resize([1.0, -1.0], size)))
    return batch


def _decode(engine, max_context: int) -> dict:
    """The engine's profile of each (sequences, context) round: its "decode" steps [(sequences, context
    tokens, seconds)] and its prompts' "prefill" [(tokens, seconds)]."""
    ray.get(engine.get_profile.remote())  # nothing earlier counts
    rng = np.random.default_rng(0)
    for ctx in _contexts(max_context):
        for n in DECODE_SEQUENCES:
            ray.get([engine.generate.remote(f"profile-{ctx}-{n}-{i}", rng.integers(0, TOKEN_IDS, ctx).tolist(),
                                            DECODE_TOKENS, [], i) for i in range(n)])
    return ray.get(engine.get_profile.remote())


def profile(pool, *, kv_capacity: int, min_train_gpus: int, max_context: int, groups: int,
            group_size: int) -> tuple[CostEstimate, float]:
    """(the estimate measured on `pool`'s first engine and trainer worker 0, seconds the profile took)."""
    t_start = time.perf_counter()
    k = pool.cfg.gpus_per_engine
    engine, trainer = pool.engine(tuple(range(k))), pool.trainers[0]
    t0 = time.perf_counter()
    ray.get(engine.wake.remote(trainer.weights.remote(), 0))
    start_s = time.perf_counter() - t0
    measured = _decode(engine, max_context)
    t0 = time.perf_counter()
    ray.get(engine.sleep.remote())
    stop_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    train = []
    pack = pool.cfg.trainer_config.max_pack_tokens - 1  # a sequence fits one pack beside its one-token prompt
    full = max(2, min(max_context, TRAIN_TOKENS // (groups * group_size), pack))
    for tokens in (full // 2, full):
        batch = ray.put(_train_batch(groups, group_size, tokens, rng))
        t0 = time.perf_counter()
        stats = ray.get(trainer.train.remote(batch))
        train.append((stats["tokens"], time.perf_counter() - t0))
    ray.get(trainer.reset.remote(0))  # the profile's steps leave no trace in the weights
    try:
        step, per_token = fit_step(measured["decode"]), fit_train_s_per_token_gpu(train, 1)
        prefill = fit_prefill_s_per_token(measured.get("prefill"))
    except EstimateError as exc:
        raise EstimateError(f"{SOURCE}: {exc}") from None
    seconds = time.perf_counter() - t_start
    est = CostEstimate(engine_gpus=k, kv_capacity=kv_capacity, min_train_gpus=min_train_gpus, max_running=0,
                       train_s_per_token_gpu=per_token, train_s_per_attn_gpu=0.0,
                       step_a=step.a, step_b=step.b, step_c=step.c, engine_start_s=start_s, engine_stop_s=stop_s,
                       trainer_start_s=0.0, prefill_s_per_token=prefill, source=f"{SOURCE}, {seconds:.1f} s")
    return est, seconds


def startup_estimate(pool, cluster_cfg, max_context: int) -> tuple[CostEstimate, float]:
    """The start-up profile's estimate for a run of `cluster_cfg` on `pool` (measured once per pool config
    and context; the cluster's own sizes), and the seconds it took when it was measured."""
    key = (pool.cfg, max_context, cluster_cfg.groups_per_step, cluster_cfg.group_size)
    cached = pool.startup_profile
    if cached is None or cached[0] != key:
        est, seconds = profile(pool, kv_capacity=cluster_cfg.kv_capacity, min_train_gpus=cluster_cfg.min_train_gpus,
                               max_context=max_context, groups=cluster_cfg.groups_per_step,
                               group_size=cluster_cfg.group_size)
        pool.startup_profile = cached = (key, est, seconds)
    return cached[1], cached[2]


def cluster_estimate(pool, config, max_context: int) -> tuple[CostEstimate | None, float | None]:
    """(the cost estimate [cluster] estimate names: "profile", "none" or a calibration file, with the cluster's
    own engine size, KV capacity and trainer minimum; the start-up profile's seconds, None if not profiled)."""
    if config.estimate == "none":
        return None, None
    seconds = None
    if config.estimate == "profile":
        est, seconds = startup_estimate(pool, config, max_context)
    else:
        est = from_file(config.estimate)
    return dataclasses.replace(est, engine_gpus=pool.cfg.gpus_per_engine, kv_capacity=config.kv_capacity,
                               min_train_gpus=config.min_train_gpus), seconds
