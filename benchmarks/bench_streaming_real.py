"""Streaming steps on the real backend (local Ray, 4 logical GPUs, the tiny CPU model): cost and exactness.

One batch of random task trees (sub-agents, retries, compactions; tests/test_trajectory_pack.random_group),
every group finished and scored before the step, trained four ways on fresh trainer state: `train` on one GPU
(the whole batch packed at once), and a streaming step on 1, 2 and 4 one-GPU cells (all joined at the open).
Per way: the step's wall seconds (its call to its version), micro-steps and the cells that trained them, and
its update against one process's naive update of the batch (every branch its own causal sequence): the
relative gap of the gradient norm, and the largest weight gap where the gradient is above 1e-4 of its largest
entry, in units of lr (see tests/test_real_streaming.py). Medians over --repeat runs.

Usage: .venv/bin/python benchmarks/bench_streaming_real.py [--groups 4] [--repeat 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_trajectory_pack import random_group  # noqa: E402

from gyre.cluster import Phase  # noqa: E402
from gyre.real import task as T  # noqa: E402
from gyre.real.backend import RealCluster  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.pool import ActorPool  # noqa: E402
from gyre.real.trainer import Trainer  # noqa: E402
from gyre.trajectory import AdvantageConfig, group_advantages, score_group  # noqa: E402
from gyre.trajectory.torch_ops import LossConfig, branches_of, naive_loss  # noqa: E402

CFG = preset_tiny_test()
WAYS = {"train 1 GPU": None, "stream 1 cell": 1, "stream 2 cells": 2, "stream 4 cells": 4}


class OneStep:
    """Makes the batch's groups (random trees, finished and scored), then trains them `cells` ways (None: train)."""

    name = "bench-streaming"

    def __init__(self, recs, cells: int | None) -> None:
        self.recs, self.cells, self.wall = recs, cells, 0.0

    def run(self, c, steps):
        groups = [c.next_group() for _ in self.recs]
        for g, (rec, scores) in zip(groups, self.recs):
            g.env.recorder = rec
            for ex in g.executions:
                ex.phase = Phase.DONE
            c.verifier._back(g, scores, c.now)
        t0 = time.perf_counter()
        if self.cells is None:
            yield c.train((0,), groups)
        else:
            h = c.open_step((0,), groups)
            for g in range(1, self.cells):
                c.join_step((g,))
            yield h
        self.wall = time.perf_counter() - t0


def naive(recs) -> tuple[dict, float, dict]:
    tc = CFG.pool.trainer_config
    ref = Trainer(CFG.pool.model, tc, seed=CFG.cluster.seed)
    adv_cfg = AdvantageConfig(normalize_std=CFG.cluster.normalize_std)
    branches, off = [], 0
    for rec, scores in recs:
        branches += branches_of(rec.tree, group_advantages(scores, adv_cfg), execution_offset=off)
        off += len(rec.executions)
    naive_loss(ref.model, branches, tc.normalization, LossConfig(clip_low=tc.clip, clip_high=tc.clip)).backward()
    grad = {n: p.grad.detach().clone() for n, p in ref.model.named_parameters()}
    gnorm = float(torch.nn.utils.clip_grad_norm_(list(ref.model.parameters()), tc.grad_clip))
    ref.opt.step()
    return ref.model.state_dict(), gnorm, grad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="out/bench_streaming_real")
    args = ap.parse_args()
    tc = dataclasses.replace(CFG.pool.trainer_config, epochs=1)  # `train` then takes the one step a stream takes
    pool = ActorPool.shared(dataclasses.replace(CFG.pool, trainer_config=tc))
    rng = np.random.default_rng(0)
    recs = []
    for _ in range(args.groups):
        rec, _ = random_group(rng, CFG.cluster.group_size, 8, vocab=T.VOCAB_SIZE)
        recs.append((rec, score_group(rec, lambda s: 0.1 * s.generated_tokens)))
    want, gnorm, grad = naive(recs)
    top = max(float(g.abs().max()) for g in grad.values())
    rows = []
    for rep in range(args.repeat):
        for way, cells in WAYS.items():
            c = RealCluster(pool=pool, config=dataclasses.replace(CFG.cluster, estimate="none"))
            pol = OneStep(recs, cells)
            try:
                c.run(pol, 1)
                w = c.trainer_weights()
            finally:
                c.close()
            note = [r[3] for r in c.log if r[0] == "note" and r[2] == "train"][-1]
            micro = [r for r in c.log if r[0] == "micro"]
            firm = max(float(((w[k] - want[k]).abs() * (grad[k].abs() >= 1e-4 * top)).max()) for k in want)
            rows.append({"way": way, "repeat": rep, "step_s": pol.wall, "micro_steps": len(micro),
                         "cells_trained": len({r[5] for r in micro}), "tokens": note["tokens"],
                         "grad_norm_rel_gap": abs(note["grad_norm"] - gnorm) / gnorm, "weight_gap_lr": firm / tc.lr})
            print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "runs.csv", index=False)
    table = df.groupby("way", sort=False).agg(step_s=("step_s", "median"), micro_steps=("micro_steps", "median"),
                                              cells_trained=("cells_trained", "median"), tokens=("tokens", "median"),
                                              grad_norm_rel_gap=("grad_norm_rel_gap", "max"),
                                              weight_gap_lr=("weight_gap_lr", "max"))
    table.to_csv(out / "summary.csv")
    print(table.to_string())


if __name__ == "__main__":
    main()
