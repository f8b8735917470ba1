"""Ablation of role-bounded path sampling (gyre.trajectory.sample): J_max = 1, 5, uncapped, and exact packing.

Three parts, each writing CSVs under results/ (and a figure where a person would rather look):

- `synthetic`: branching agent groups (benchmarks/bench_trajectory.xlong_group at 1/20 of its turn sizes: a main
  context compacted before 1,800 tokens, 3 sub-agents and 3 retries per execution) trained by a tiny Llama on
  CPU. Per batch and mode, at the same weights: packed tokens, forward-backward CPU time (the modes interleaved, median of repeats) and the norm of
  the batch gradient. Writes results/synthetic.csv.
- `real`: the real backend (local Ray, tiny-cpu preset, the built-in agent task, whose episodes fork sub-agents,
  retry failed tools and compact), colocate, `--steps` steps on `--seeds` seeds per mode: per step the reward,
  loss, gradient norm, trained tokens and paths, and the trainer's seconds. Writes results/real_steps.csv and
  results/real_curves.png.
- `sim`: the simulator's training work per group (gyre.train_work) on xlong-swe and xlong-swe-kv groups: tokens
  and train seconds (the preset's cost model) relative to exact. Writes results/sim_work.csv.
- `elastic`: elastic at J_max = 1 on xlong-swe-small (sub-agents and retries at 5% a turn), `--steps` steps on
  `--seeds` seeds, predicting each step from the observed `Cluster.trained_share` ("observed") and with it pinned
  to (1.0, 1.0) ("blind": exact training's counts, elastic before the observation): per step the predicted step
  end (its "elastic_train" note) minus the actual one, and the trainer's GPUs. Writes results/elastic_prediction.csv.

The paper's figures (mean forward-backward time over the first 42 steps relative to uncapped: J_max = 1 41.4%,
J_max = 5 74.8%; J_max = 1 trains worse with a larger gradient norm) are printed beside ours.
Usage: python experiments/trajectory_sampling/run.py synthetic|real|sim|elastic [--seeds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
MODES = {"exact": None, "uncapped": "uncapped", "J5": 5, "J1": 1}
PAPER = {"J1": 0.414, "J5": 0.748, "uncapped": 1.0}


def sampling(mode: str):
    from gyre.trajectory import SamplingConfig

    return SamplingConfig() if MODES[mode] is None else SamplingConfig(mode="roles", j_max=MODES[mode])


def synthetic(args) -> pd.DataFrame:
    import torch

    from bench_trajectory import XLongConfig, xlong_group
    from gyre.real.nn.model import TinyLlama, TinyLlamaConfig
    from gyre.trajectory import PackConfig, build_packs
    from gyre.trajectory.torch_ops import LossConfig, packed_loss

    torch.set_num_threads(1)
    mcfg = TinyLlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192)
    # the bench's xlong shape at 1/20 of its turn sizes: 3 sub-agents and 3 retries per execution, the main context
    # compacted before 1,800 tokens (about twice per execution), 4 executions per group
    shape = XLongConfig(executions=4, tokens_per_execution=args.tokens, window=2048, compact_at=1800, prompt=120,
                        system_prompt=40, summary=80, vocab=mcfg.vocab_size, turn_scale=20)
    rows = []
    for seed in range(args.seeds):
        model = TinyLlama(mcfg, np.random.default_rng(seed), dtype=torch.float32)
        for batch in range(args.batches):
            rng = np.random.default_rng([seed, batch])
            recs = [xlong_group(rng, shape, f"s{seed}b{batch}g{i}") for i in range(2)]
            advs = [rng.normal(size=shape.executions) for _ in recs]
            packed = {m: build_packs([r.tree for r in recs], advs, PackConfig(
                max_tokens=2048, normalization="sequence", sampling=sampling(m)), np.random.default_rng([seed, batch]))
                for m in MODES}
            times = {m: [] for m in MODES}
            norms = {}
            for rep in range(args.repeats + 1):
                for m in MODES:
                    model.zero_grad()
                    c0 = time.process_time()
                    packed_loss(model, packed[m].packs, LossConfig(), micro_tokens=2048).backward()
                    if rep:  # the first round warms up
                        times[m].append(time.process_time() - c0)
                    norms[m] = float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())))
            for m in MODES:
                st = packed[m].stats
                rows.append({"seed": seed, "batch": batch, "mode": m, "packed_tokens": st.packed_tokens,
                             "unique_tokens": st.unique_tokens, "paths": st.paths, "branches": len(
                                 packed["exact"].branch_execution), "rows": st.loss_rows,
                             "fwd_bwd_cpu_s": statistics.median(times[m]), "grad_norm": norms[m]})
            _save(pd.DataFrame(rows), args.out / "synthetic.csv")  # as it goes: a long run leaves what it measured
            print(f"seed {seed} batch {batch}: " + ", ".join(
                f"{m} {packed[m].stats.packed_tokens} tok {statistics.median(times[m]) * 1e3:.0f} ms |g| {norms[m]:.3g}"
                for m in MODES), flush=True)
    df = pd.DataFrame(rows)
    _save(df, args.out / "synthetic.csv")
    ref = df[df["mode"] == "uncapped"].set_index(["seed", "batch"])
    for col in ("packed_tokens", "fwd_bwd_cpu_s"):
        df[f"{col}_vs_uncapped"] = df[col].to_numpy() / ref.loc[list(zip(df["seed"], df["batch"])), col].to_numpy()
    table = df.groupby("mode").agg(tokens_vs_uncapped=("packed_tokens_vs_uncapped", "mean"),
                                   time_vs_uncapped=("fwd_bwd_cpu_s_vs_uncapped", "mean"),
                                   grad_norm=("grad_norm", "mean"), paths=("paths", "mean"),
                                   branches=("branches", "mean")).reindex(list(MODES))
    table["paper_time_vs_uncapped"] = [PAPER.get(m, float("nan")) for m in table.index]
    print(table.to_string(float_format=lambda x: f"{x:.3f}"))
    return df


def real(args) -> pd.DataFrame:
    from gyre.real.config import preset_tiny_cpu
    from gyre.real.pool import ActorPool
    from gyre.real.runner import run_real

    base = dataclasses.replace(preset_tiny_cpu(), steps=args.steps)
    rows, t0 = [], time.perf_counter()
    for m in MODES:
        tc = dataclasses.replace(base.pool.trainer_config, sampling=sampling(m))
        pool_cfg = dataclasses.replace(base.pool, trainer_config=tc)
        pool = ActorPool.shared(pool_cfg)
        for seed in range(args.seeds):
            cfg = dataclasses.replace(base, pool=pool_cfg, cluster=dataclasses.replace(base.cluster, seed=seed))
            r = run_real(cfg, "colocate", pool=pool)
            for rec in r.log:
                if rec[0] == "note" and rec[2] == "train":
                    s = rec[3]
                    rows.append({"mode": m, "seed": seed, "step": s["version"], "reward_mean": s["reward_mean"],
                                 "loss": s["loss"], "grad_norm": s["grad_norm"], "tokens": s["tokens"],
                                 "paths": s.get("paths", -1), "rows": s["rows"], "train_s": s["train_s"],
                                 "pack_s": s["pack_s"]})
            _save(pd.DataFrame(rows), args.out / "real_steps.csv")
            print(f"[{time.perf_counter() - t0:5.0f}s] {m} seed {seed}: makespan {r.makespan_s:.1f} s", flush=True)
    df = pd.DataFrame(rows)
    df["fwd_bwd_s"] = df["train_s"] - df["pack_s"]
    per = df.groupby(["mode", "seed"]).agg(tokens=("tokens", "mean"), fwd_bwd_s=("fwd_bwd_s", "mean"),
                                           grad_norm=("grad_norm", "mean"), reward_last5=(
                                               "reward_mean", lambda s: s.iloc[-5:].mean())).reset_index()
    ref = per[per["mode"] == "uncapped"].set_index("seed")
    per["tokens_vs_uncapped"] = per["tokens"].to_numpy() / ref.loc[per["seed"], "tokens"].to_numpy()
    per["time_vs_uncapped"] = per["fwd_bwd_s"].to_numpy() / ref.loc[per["seed"], "fwd_bwd_s"].to_numpy()
    table = per.groupby("mode").mean(numeric_only=True).drop(columns="seed").reindex(list(MODES))
    table["paper_time_vs_uncapped"] = [PAPER.get(m, float("nan")) for m in table.index]
    print(table.to_string(float_format=lambda x: f"{x:.3f}"))
    _curves(df, args.out / "real_curves.png")
    return df


def _curves(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, col in zip(axes, ("reward_mean", "loss", "grad_norm")):
        for m in MODES:
            g = df[df["mode"] == m].groupby("step")[col]
            ax.plot(g.mean().index, g.mean().to_numpy(), label=m)
        ax.set_xlabel("step")
        ax.set_title(f"{col} (mean of seeds)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sim(args) -> pd.DataFrame:
    from gyre.hardware import group_train_attention_ctx
    from gyre.presets import get_preset
    from gyre.train_work import selected_work
    from gyre.workload import execution_tree, sample_group

    rows = []
    for preset in ("xlong-swe", "xlong-swe-kv"):
        cfg = get_preset(preset)
        costs, w = cfg.costs(), cfg.workload
        for g in range(args.groups):
            ex = sample_group(w, g, 0, seed=0).executions
            leaves = sum(len(execution_tree(x, w)[1]) for x in ex)
            for m in MODES:
                if MODES[m] is None:  # the simulator's exact cost model, as SimCluster.train books it
                    tok = ex[0].prompt + sum(x.tokens - x.prompt for x in ex)
                    attn, paths = group_train_attention_ctx(ex), leaves
                else:
                    tok, attn, paths = selected_work(ex, w, sampling(m), np.random.default_rng([0, g]))
                rows.append({"preset": preset, "group": g, "mode": m, "tokens": tok, "paths": paths,
                             "leaves": leaves, "train_s_per_gpu": costs.train_time(tok, 1, attn)})
    df = pd.DataFrame(rows)
    _save(df, args.out / "sim_work.csv")
    tot = df.groupby(["preset", "mode"])[["tokens", "train_s_per_gpu", "paths", "leaves"]].sum()
    tot["time_vs_uncapped"] = [tot.loc[(p, m), "train_s_per_gpu"] / tot.loc[(p, "uncapped"), "train_s_per_gpu"]
                               for p, m in tot.index]
    tot["paper_time_vs_uncapped"] = [PAPER.get(m, float("nan")) for _, m in tot.index]
    print(tot.to_string(float_format=lambda x: f"{x:.4g}"))
    return df


class _Blind:
    """The cluster as a policy sees it, but with trained_share pinned to (1.0, 1.0)."""

    trained_share = (1.0, 1.0)

    def __init__(self, cluster) -> None:
        self._cluster = cluster

    def __getattr__(self, name: str):
        return getattr(self._cluster, name)


class BlindElastic:
    """elastic predicting training from exact training's counts (what it did before `trained_share`)."""

    name = "elastic"

    def __init__(self) -> None:
        from gyre.policies.elastic import Elastic

        self.inner = Elastic()

    def run(self, cluster, steps):
        return self.inner.run(_Blind(cluster), steps)


def elastic(args) -> pd.DataFrame:
    from gyre.config import override
    from gyre.policies.elastic import Elastic
    from gyre.presets import get_preset
    from gyre.sim.harness.runner import simulate

    rows = []
    for seed in range(args.seeds):
        cfg = override(get_preset("xlong-swe-small"), **{"steps": args.steps, "seed": seed,
                                                         "workload.subagent_p": 0.05, "workload.retry_p": 0.05})
        cfg = dataclasses.replace(cfg, sampling=sampling("J1"))
        for variant, pol in (("observed", Elastic()), ("blind", BlindElastic())):
            r = simulate(cfg, pol)
            notes = [x for x in r.log if x[0] == "note" and x[2] == "elastic_train"]  # one per step, in order
            ends = [x[1] for x in r.log if x[0] == "step"]
            for k, (n, end) in enumerate(zip(notes, ends), 1):
                rows.append({"seed": seed, "variant": variant, "step": k, "predicted_end_s": n[3]["step_end"],
                             "end_s": end, "error_s": n[3]["step_end"] - end, "gpus": n[3]["gpus"],
                             "makespan_s": ends[-1]})
    df = pd.DataFrame(rows)
    _save(df, args.out / "elastic_prediction.csv")
    later = df[df["step"] > 1]  # step 1 has no finished step to observe: both predict alike
    tab = later.assign(abs_error_s=later["error_s"].abs()).groupby("variant")[["error_s", "abs_error_s"]].median()
    tab["makespan_s"] = df.groupby(["variant", "seed"])["makespan_s"].first().groupby("variant").mean()
    print(tab.to_string(float_format=lambda x: f"{x:.1f}"))
    return df


def _save(df: pd.DataFrame, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["synthetic", "real", "sim", "elastic"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batches", type=int, default=4, help="synthetic: batches per seed")
    ap.add_argument("--repeats", type=int, default=3, help="synthetic: timed forward-backward passes per mode")
    ap.add_argument("--tokens", type=int, default=6000, help="synthetic: tokens per execution")
    ap.add_argument("--groups", type=int, default=64, help="sim: groups per preset")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    {"synthetic": synthetic, "real": real, "sim": sim, "elastic": elastic}[args.part](args)


if __name__ == "__main__":
    main()
