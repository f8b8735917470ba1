"""The physics behind a regime-map cell, from the cost model and the workload alone (no simulation).

For one cell's RunConfig (run.py's `cell_config`): what an engine holds (KV tokens, the admission limit of
executions at the cell's window, a hybrid model's per-sequence state), and one training step's batch (the
first step's groups as the workload draws them) priced both ways:

- training: `Costs.train_time` of the batch's tokens and attention context sum (as the simulator charges a
  step) on the trainer's minimum GPUs and on all N;
- rollout throughput: engine-seconds to decode every generated token with the engine full (the admission
  limit's sequences at the batch's token-weighted mean context, `Costs.step_time`), plus every tool output's
  prefill at its least cost per token (`Costs.min_prefill_s_per_token`), spread over the engines of N - the
  trainer minimum GPUs (async's largest rollout side) and of all N (colocate);
- the balance of the two in GPU-seconds per step (training on the minimum is linear in GPUs, so its
  GPU-seconds do not depend on the trainer's size): the split R that makes a fixed split's two sides take
  equally long, N x rollout / (rollout + training), and the work-conserving step time (rollout + training) / N
  that no allocation beats on throughput;
- rollout latency (the tail): a group is done when its slowest execution is; over the step's groups, the
  median of that slowest execution's decode alone on an engine (`Costs.decode_s_per_token`) plus its tool
  seconds, and the same at a full engine's pace, capped at its deadline: no split of GPUs makes a typical
  group finish sooner than the first figure.

Assumes the first step's groups stand for the run's (growth lengthens later steps) and the engine pace of a
full engine (real engines run partly empty in the tail, which only lengthens rollout).

python experiments/regime_map/physics.py [--cells core] [--arch hybrid,gqa,mla]  ->  results/physics_<cells>.csv
and a markdown table on stdout (seconds of CPU: nothing is simulated).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from gyre.hardware import admission_limit, group_train_attention_ctx
from gyre.workload import sample_group


def _step_groups(cfg):
    w = cfg.workload
    return [sample_group(w, g, 0, cfg.seed) for g in range(w.groups_per_step)]


def cell_physics(cfg, groups=None) -> dict[str, float]:
    """The figures of the module docstring for one cell (seconds, tokens, counts); `groups`: the step's
    groups, if not the first step's."""
    c = cfg.costs()
    n_gpus, window = cfg.cluster.gpus, cfg.workload.context_window
    limit = admission_limit(c.kv_capacity_tokens, window, c.admission_fill, c.state_tokens)
    if c.max_num_seqs:
        limit = min(limit, c.max_num_seqs)
    groups = _step_groups(cfg) if groups is None else groups
    execs = [e for g in groups for e in g.executions]
    tokens = sum(g.executions[0].prompt + sum(e.tokens - e.prompt for e in g.executions) for g in groups)
    attn = sum(group_train_attention_ctx(g.executions) for g in groups)
    gen = np.concatenate([np.asarray(e.gen, float) for e in execs])
    mid = np.concatenate([np.asarray(e.kv, float) + np.asarray(e.gen, float) / 2 for e in execs])
    mean_ctx = float((gen * mid).sum() / gen.sum())
    full_step = c.step_time(limit, limit * mean_ctx)  # one token of every sequence of a full engine
    decode_engine_s = float(gen.sum()) * full_step / limit
    out_tok = np.concatenate([np.asarray(e.tool_out, float) for e in execs if e.tool_out] or [np.zeros(0)])
    out_at = np.concatenate([np.asarray(e.kv[1:], float) - np.asarray(e.tool_out, float)
                             for e in execs if e.tool_out] or [np.zeros(0)])
    prefill_engine_s = float((out_tok * c.min_prefill_s_per_token(out_at)).sum())
    def alone(e) -> float:  # decode alone + tools, capped at the deadline
        pace = c.decode_s_per_token(np.add(e.kv, np.divide(e.gen, 2)))
        return min(e.deadline_s, float(np.dot(e.gen, pace)) + sum(e.tool_s))

    def full(e) -> float:  # decode at a full engine's pace + tools, capped at the deadline
        return min(e.deadline_s, sum(g * c.step_time(limit, limit * (k + g / 2)) for g, k in zip(e.gen, e.kv))
                   + sum(e.tool_s))

    tail_alone = float(np.median([max(map(alone, g.executions)) for g in groups]))
    tail_full = float(np.median([max(map(full, g.executions)) for g in groups]))
    engines_free = (n_gpus - c.min_train_gpus) // c.engine_gpus
    engines_all = n_gpus // c.engine_gpus
    rollout_engine_s = decode_engine_s + prefill_engine_s
    roll_gpu_s = rollout_engine_s * c.engine_gpus
    train_gpu_s = c.train_time(tokens, c.min_train_gpus, attn) * c.min_train_gpus
    return {
        "engine_gpus": c.engine_gpus, "kv_tokens_per_engine": c.kv_capacity_tokens, "state_tokens": c.state_tokens,
        "execs_per_engine": limit, "executions_per_step": len(execs),
        "engines_for_a_step": -(-len(execs) // limit), "trainer_min": c.min_train_gpus,
        "step_tokens": tokens, "mean_decode_ctx": mean_ctx,
        "train_s_at_min": c.train_time(tokens, c.min_train_gpus, attn),
        "train_s_at_N": c.train_time(tokens, n_gpus, attn),
        "rollout_engine_s": rollout_engine_s, "prefill_share": prefill_engine_s / rollout_engine_s,
        "rollout_s_on_N_minus_min": rollout_engine_s / max(engines_free, 1),
        "rollout_s_on_N": rollout_engine_s / engines_all, "rollout_gpu_h": roll_gpu_s / 3600,
        "train_gpu_h": train_gpu_s / 3600, "balanced_R": n_gpus * roll_gpu_s / (roll_gpu_s + train_gpu_s),
        "work_step_s": (roll_gpu_s + train_gpu_s) / n_gpus, "group_tail_alone_s": tail_alone,
        "group_tail_full_engine_s": tail_full,
    }


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from run import ARCHS, OUT, cell_config, cell_list

    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", choices=["core", "all", "1m", "one"], default="core")
    ap.add_argument("--arch", default="hybrid,gqa,mla")
    a = ap.parse_args()
    archs = a.arch.split(",")
    if not set(archs) <= set(ARCHS):
        ap.error(f"--arch: unknown {sorted(set(archs) - set(ARCHS))}; known: {', '.join(ARCHS)}")
    rows = []
    for w, n, growth, heavy, arch in cell_list(a.cells, archs):
        rows.append({"arch": arch, "window": w, "gpus": n, "growth": "3x" if growth else "none",
                     "training": "heavy" if heavy else "light",
                     **cell_physics(cell_config(w, n, growth, heavy, arch, steps=6))})
    df = pd.DataFrame(rows)
    OUT.mkdir(parents=True, exist_ok=True)
    df.to_csv(OUT / f"physics_{a.cells}.csv", index=False)
    print("| arch | window | GPUs | growth | training | executions / engine | train GPU-h / step "
          "| rollout GPU-h / step | balanced R | work-conserving step (h) | group tail alone (h) |")
    print("|" + "---|" * 11)
    for p in df.itertuples():
        print(f"| {p.arch} | {p.window // 1024}K | {p.gpus:,} | {p.growth} | {p.training} | {p.execs_per_engine} | "
              f"{p.train_gpu_h:,.0f} | {p.rollout_gpu_h:,.0f} | {p.balanced_R:.0f} | {p.work_step_s / 3600:.2f} | "
              f"{p.group_tail_alone_s / 3600:.2f} |")


if __name__ == "__main__":
    main()
