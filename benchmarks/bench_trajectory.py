"""Benchmark of the trajectory processor: packing throughput, duplication, and a real CPU training step.

What it measures (medians over repeats, printed as plain figures):
1. xlong-like GRPO groups (8 executions x 700K tokens each, with compaction, a few sub-agents and retries
   per execution) recorded through the real recording API; then `build_packs` throughput in unique tokens/s
   and packed/unique tokens, at a pack bound equal to the model's context window. Exact ancestor-or-self
   attention needs a token's whole context inside one pack, so the bound must be >= the deepest context:
   a 32K bound is measured on executions that compact before their context passes ~26K tokens (a 32K
   window), and a 128K bound on executions that compact every ~100K tokens. Beside exact packing, role-bounded
   sampling (gyre.trajectory.sample) at J_max = 5 and uncapped: the same throughput measure (the input trees'
   unique tokens per second of build_packs, path draws and cut included), paths drawn, and tokens kept.
2. One training step (forward + backward) of a tiny Llama on CPU over a workload with >= 4x prefix
   sharing: tree packs vs naive packing (every branch its own causal sequence, packed to the same bound).

Simplifications: token ids and log-probs are random; the naive baseline uses the same dense-mask kernel.
Run: PYTHONPATH=. .venv/bin/python benchmarks/bench_trajectory.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from gyre.real.nn.model import TinyLlamaConfig, TinyLlama
from gyre.trajectory import LossRows, Pack, PackConfig, SamplingConfig, TaskRecorder, build_packs
from gyre.trajectory.torch_ops import LossConfig, branches_of, packed_loss


@dataclass(kw_only=True, frozen=True)
class XLongConfig:
    """Shape of one synthetic long-horizon group."""

    executions: int = 8
    tokens_per_execution: int = 700_000
    window: int = 32_768  # model context window = pack bound
    compact_at: int = 26_000  # compact when the context would pass this
    prompt: int = 1_500
    system_prompt: int = 400  # shared start of every compacted context
    summary: int = 1_200
    subagents: float = 3.0  # expected per execution
    retries: float = 3.0  # expected per execution
    vocab: int = 32_000
    turn_scale: int = 1  # turn, tool-output and sub-agent sizes (and the compaction margin) divided by this


def xlong_group(rng: np.random.Generator, cfg: XLongConfig, task_id: str) -> TaskRecorder:
    """Record one group through the recording API."""
    rand = lambda n: rng.integers(0, cfg.vocab, int(n))  # noqa: E731
    lps = lambda n: -rng.exponential(0.5, int(n))  # noqa: E731
    rec = TaskRecorder(task_id, rand(cfg.prompt))
    sys_prompt = rand(cfg.system_prompt)
    k = cfg.turn_scale
    turns = cfg.tokens_per_execution / (1_900 / k)
    for _ in range(cfg.executions):
        ex = rec.start()
        total, ctx = 0, cfg.prompt
        while total < cfg.tokens_per_execution:
            m, t = int(rng.integers(200 // k, 1_500 // k)), int(rng.integers(100 // k, 2_500 // k))
            if ctx + m + t + 2_000 // k > cfg.compact_at:
                ex.compact(np.concatenate([sys_prompt, rand(cfg.summary)]))
                total += cfg.summary
                ctx = cfg.system_prompt + cfg.summary
            mark = ex.point
            ex.append_model(rand(m), lps(m), 0)
            ex.append_env(rand(t))
            total, ctx = total + m + t, ctx + m + t
            if rng.random() < cfg.retries / turns:  # abandon this turn and redo it
                ex.retry(mark)
                ctx -= m + t
            if rng.random() < cfg.subagents / turns:
                room = cfg.window - ctx - 1
                n = int(min(rng.integers(2_000 // k, 8_000 // k), room))
                if n > 0:
                    sub = ex.fork()
                    sub.append_model(rand(n), lps(n), 0)
                    sub.close()
                    total += n
        ex.finish(float(rng.random()))
    return rec


LAST: list = [None]  # result of the latest timed call


def median_times(fn, repeats: int) -> tuple[float, float]:
    """Median wall and median CPU (process) time of `repeats` calls; CPU time is steadier on a busy host."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        LAST[0] = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def bench_packing(name: str, cfg: XLongConfig, groups: int, repeats: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    recs = [xlong_group(rng, cfg, f"{name}-{i}") for i in range(groups)]
    t_rec = time.perf_counter() - t0
    pres = [r.tree.preorder() for r in recs]
    unique = sum(p.size for p in pres)
    advs = [rng.normal(size=cfg.executions) for _ in recs]
    pc = PackConfig(max_tokens=cfg.window)
    t_layout, c_layout = median_times(lambda: [r.tree.preorder() for r in recs], repeats)
    t_pack, c_pack = median_times(lambda: build_packs(pres, advs, pc), repeats)
    batch = LAST[0]
    s = batch.stats
    print(f"[{name}] {groups} group(s) x {cfg.executions} executions x {cfg.tokens_per_execution:,} tokens, "
          f"bound {cfg.window:,}, compaction at ~{cfg.compact_at:,}")
    print(f"  unique tokens            {unique:,}")
    print(f"  naive tokens             {s.naive_tokens:,}  (naive/unique {s.sharing:.3f})")
    print(f"  packed tokens            {s.packed_tokens:,}  in {s.num_packs} packs")
    print(f"  packed/unique            {s.packed_tokens / unique:.4f}  (duplication overhead "
          f"{100 * s.duplication_overhead:.2f}%)")
    print(f"  loss rows                {s.loss_rows:,}")
    print(f"  record throughput        {unique / t_rec / 1e6:.2f} M tokens/s")
    print(f"  tree layout (preorder)   {unique / t_layout / 1e6:.2f} M tokens/s wall, "
          f"{unique / c_layout / 1e6:.2f} M tokens/s CPU")
    print(f"  build_packs throughput   {unique / t_pack / 1e6:.2f} M tokens/s wall (median {t_pack * 1e3:.0f} ms), "
          f"{unique / c_pack / 1e6:.2f} M tokens/s CPU (median {c_pack * 1e3:.0f} ms)")
    print(f"  layout + pack            {unique / (t_layout + t_pack) / 1e6:.2f} M tokens/s wall, "
          f"{unique / (c_layout + c_pack) / 1e6:.2f} M tokens/s CPU")
    for j in (5, None):
        spc = PackConfig(max_tokens=cfg.window, sampling=SamplingConfig(mode="roles", j_max=j))
        t_s, c_s = median_times(lambda: build_packs(pres, advs, spc, np.random.default_rng(seed)), repeats)
        st = LAST[0].stats
        print(f"  sampled J_max={j or 'uncapped':<8}  {unique / t_s / 1e6:.2f} M tokens/s wall ({t_pack / t_s:.2f} of "
              f"exact), {unique / c_s / 1e6:.2f} M tokens/s CPU ({c_pack / c_s:.2f} of exact); {st.paths} of "
              f"{len(batch.branch_execution)} paths, kept {st.kept_tokens / unique:.3f} of the tokens, "
              f"packed {st.packed_tokens:,}")
    print(f"  host load average        {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def naive_packs(branches, bound: int, normalization: str = "token") -> list[Pack]:
    """Every branch its own causal chain, chains packed next-fit into packs of `bound` tokens."""
    total_rows = sum(int(b.trained[1:].sum()) for b in branches)
    packs, cur = [], []

    def flush():
        if not cur:
            return
        ids = np.concatenate([b.tokens for b in cur])
        pos = np.concatenate([np.arange(len(b.tokens)) for b in cur])
        ends = np.cumsum([len(b.tokens) for b in cur])
        leave = np.repeat(ends, [len(b.tokens) for b in cur])
        starts = ends - np.array([len(b.tokens) for b in cur])
        tp = [np.flatnonzero(b.trained[1:]) + 1 for b in cur]
        pred = np.concatenate([s + t - 1 for s, t in zip(starts, tp)])
        tgt = np.concatenate([b.tokens[t] for b, t in zip(cur, tp)])
        olp = np.concatenate([b.old_logprob[t] for b, t in zip(cur, tp)])
        adv = np.concatenate([np.full(len(t), b.advantage) for b, t in zip(cur, tp)])
        n = pred.shape[0]
        z = np.zeros(n, np.int64)
        packs.append(Pack(input_ids=ids, position_ids=pos, leave=leave, rows=LossRows(
            pred=pred, target=tgt, old_logprob=olp, advantage=adv, execution=z, branch=z,
            weight=np.full(n, 1.0 / total_rows))))
        cur.clear()

    used = 0
    for b in branches:
        if used + len(b.tokens) > bound:
            flush()
            used = 0
        cur.append(b)
        used += len(b.tokens)
    flush()
    return packs


def sharing_workload(rng: np.random.Generator, tasks: int, vocab: int) -> list[TaskRecorder]:
    """GRPO groups with a long shared prompt, short answers, tool turns and one retry each: >= 4x sharing."""
    recs = []
    for i in range(tasks):
        rec = TaskRecorder(f"s{i}", rng.integers(0, vocab, 700))
        for _ in range(8):
            ex = rec.start()
            mark = ex.append_model(rng.integers(0, vocab, 24), -rng.exponential(0.5, 24), 0)
            ex.append_env(rng.integers(0, vocab, 16))
            ex.append_model(rng.integers(0, vocab, 24), -rng.exponential(0.5, 24), 0)
            ex.retry(mark)
            ex.append_model(rng.integers(0, vocab, 40), -rng.exponential(0.5, 40), 0)
            ex.finish(float(rng.random()))
        recs.append(rec)
    return recs


def bench_training(repeats: int, seed: int) -> None:
    torch.set_num_threads(1)  # steadier than 2 threads on a shared 2-core host
    rng = np.random.default_rng(seed)
    mcfg = TinyLlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384)
    model = TinyLlama(mcfg, rng, dtype=torch.float32)
    recs = sharing_workload(rng, 2, mcfg.vocab_size)
    advs = [rng.normal(size=8) for _ in recs]
    bound = 2048
    tree = build_packs([r.tree for r in recs], advs, PackConfig(max_tokens=bound))
    branches = [b for r, a in zip(recs, advs) for b in branches_of(r.tree, a)]
    naive = naive_packs(branches, bound)
    naive_tokens = sum(p.size for p in naive)
    cfg = LossConfig()

    def step(packs):
        model.zero_grad()
        loss = packed_loss(model, packs, cfg)
        loss.backward()
        return float(loss.detach())

    step(tree.packs), step(naive)  # warm-up
    # Interleave the two so that both see the same background load on a shared host.
    timed = [(median_times(lambda: step(naive), 1), LAST[0], median_times(lambda: step(tree.packs), 1), LAST[0])
             for _ in range(repeats)]
    t_naive = statistics.median(x[0][0] for x in timed)
    c_naive = statistics.median(x[0][1] for x in timed)
    t_tree = statistics.median(x[2][0] for x in timed)
    c_tree = statistics.median(x[2][1] for x in timed)
    l_naive, l_tree = timed[-1][1], timed[-1][3]
    reduction = naive_tokens / tree.stats.packed_tokens
    speedup = t_naive / t_tree
    print(f"[train step] tiny Llama {mcfg.dim}d x {mcfg.n_layers}L, vocab {mcfg.vocab_size}, fp32, bound {bound}")
    print(f"  naive tokens {naive_tokens:,} in {len(naive)} packs; tree-packed {tree.stats.packed_tokens:,} in "
          f"{tree.stats.num_packs} packs (unique {tree.stats.unique_tokens:,}); losses {l_naive:.6f} vs {l_tree:.6f}")
    print(f"  naive step {t_naive * 1e3:.0f} ms wall / {c_naive * 1e3:.0f} ms CPU, packed step {t_tree * 1e3:.0f} ms "
          f"wall / {c_tree * 1e3:.0f} ms CPU (medians of {repeats})")
    print(f"  token reduction {reduction:.2f}x, speedup {speedup:.2f}x wall ({c_naive / c_tree:.2f}x CPU) = "
          f"{speedup / reduction:.2f} of the reduction")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one smaller group, fewer repeats")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packing-only", action="store_true", help="skip the training step")
    args = ap.parse_args()
    per_exec = 150_000 if args.quick else 700_000
    reps = 3 if args.quick else 5
    bench_packing("xlong-32K", XLongConfig(tokens_per_execution=per_exec), 1, reps, args.seed)
    bench_packing("xlong-128K", XLongConfig(tokens_per_execution=per_exec, window=131_072, compact_at=100_000),
                  1, reps, args.seed + 1)
    if not args.packing_only:
        bench_training(reps, args.seed + 2)


if __name__ == "__main__":
    main()
