"""GPU checks and timings for the torch side: the packed loss on CUDA, tree packing vs naive training
steps on a ~150M-parameter model, and the decode step-time model the simulator assumes.

1. Exactness on CUDA: packed loss and every gradient equal the naive per-branch reference (fp64, dense
   ancestor-or-self mask); FlexAttention's block mask (fp32, forward and backward) matches the dense mask.
2. Training step (bf16, forward + backward): naive per-branch packs vs tree packs with the dense mask vs
   tree packs with FlexAttention, on GRPO groups with a long shared prompt and multi-turn branches.
3. Decode: time per decode step of gyre.nn's KV-cache path over a grid of batch sizes and contexts, and a
   least-squares fit of the simulator's form t = a + b * batch + c * kv_tokens (R^2, worst relative error).

Run: `python benchmarks/bench_gpu.py [--smoke]` (with PYTHONPATH=. on a machine without the install).
Writes gpu_results.json to $OUT (or the current folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import numpy as np
import torch

from gyre.nn.model import TinyLlamaConfig, TinyLlama
from gyre.trajectory import PackConfig, TaskRecorder, build_packs
from gyre.trajectory.torch_ops import branches_of, naive_loss, packed_loss


def sharing_groups(rng, tasks: int, vocab: int, prompt: int, turns: int, model_tok: int, env_tok: int):
    recs = []
    for i in range(tasks):
        rec = TaskRecorder(f"t{i}", rng.integers(0, vocab, prompt))
        for _ in range(8):
            ex = rec.start()
            mark = None
            for k in range(turns):
                m = ex.append_model(rng.integers(0, vocab, model_tok), -rng.exponential(0.5, model_tok), 0)
                mark = mark if k else m
                ex.append_env(rng.integers(0, vocab, env_tok))
            ex.retry(mark)
            ex.append_model(rng.integers(0, vocab, model_tok), -rng.exponential(0.5, model_tok), 0)
            ex.finish(float(rng.random()))
        recs.append(rec)
    return recs


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def check_exactness(dev: str, smoke: bool) -> dict:
    rng = np.random.default_rng(0)
    mcfg = TinyLlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    recs = sharing_groups(rng, 2, mcfg.vocab_size, 64, 3, 12, 8)
    advs = [rng.normal(size=8) for _ in recs]
    out = {}
    for norm in ("token", "sequence"):
        model = TinyLlama(mcfg, np.random.default_rng(1), dtype=torch.float64).to(dev)
        batch = build_packs([r.tree for r in recs], advs, PackConfig(max_tokens=256, normalization=norm))
        branches = [b for r, a in zip(recs, advs) for b in branches_of(r.tree, a)]
        model.zero_grad()
        lp = packed_loss(model, batch.packs, device=dev)
        lp.backward()
        gp = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        ln = naive_loss(model, branches, norm, device=dev)
        ln.backward()
        gn = [p.grad.clone() for p in model.parameters()]
        out[f"fp64_{norm}_loss_abs_diff"] = abs(float((lp - ln).detach()))
        out[f"fp64_{norm}_grad_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(gp, gn))
    try:
        model = TinyLlama(mcfg, np.random.default_rng(1), dtype=torch.float32).to(dev)
        batch = build_packs([r.tree for r in recs], advs, PackConfig(max_tokens=256))
        model.zero_grad()
        ld = packed_loss(model, batch.packs, device=dev)
        ld.backward()
        gd = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        lf = packed_loss(model, batch.packs, device=dev, use_flex=True)
        lf.backward()
        gf = [p.grad.clone() for p in model.parameters()]
        out["flex_fp32_loss_abs_diff"] = abs(float(ld - lf))
        out["flex_fp32_grad_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(gd, gf))
    except Exception as exc:  # flex backward is missing on some builds (CPU)
        out["flex_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def bench_training(dev: str, smoke: bool) -> dict:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_trajectory import naive_packs

    rng = np.random.default_rng(2)
    if smoke:
        mcfg = TinyLlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
        shape, bound, reps, dtype = dict(tasks=1, prompt=256, turns=2, model_tok=32, env_tok=32), 2048, 1, torch.float32
    else:
        mcfg = TinyLlamaConfig(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_dim=2816,
                           tie_embeddings=False)
        shape, bound, reps, dtype = dict(tasks=2, prompt=4096, turns=4, model_tok=256, env_tok=512), 8192, 5, torch.bfloat16
    model = TinyLlama(mcfg, rng, dtype=dtype).to(dev)
    params = sum(p.numel() for p in model.parameters())
    recs = sharing_groups(rng, vocab=mcfg.vocab_size, **shape)
    advs = [rng.normal(size=8) for _ in recs]
    tree = build_packs([r.tree for r in recs], advs, PackConfig(max_tokens=bound))
    branches = [b for r, a in zip(recs, advs) for b in branches_of(r.tree, a)]
    naive = naive_packs(branches, bound)
    naive_tokens = sum(p.size for p in naive)

    def step(packs, flex=False):
        model.zero_grad(set_to_none=True)
        packed_loss(model, packs, device=dev, use_flex=flex).backward()

    res = {"params_m": params / 1e6, "naive_tokens": naive_tokens, "packed_tokens": tree.stats.packed_tokens,
           "unique_tokens": tree.stats.unique_tokens, "token_reduction": naive_tokens / tree.stats.packed_tokens}
    res["naive_dense_s"] = timed(lambda: step(naive), reps)
    res["tree_dense_s"] = timed(lambda: step(tree.packs), reps)
    try:
        res["naive_flex_s"] = timed(lambda: step(naive, True), reps)
        res["tree_flex_s"] = timed(lambda: step(tree.packs, True), reps)
        res["speedup_flex"] = res["naive_flex_s"] / res["tree_flex_s"]
    except Exception as exc:
        res["flex_error"] = f"{type(exc).__name__}: {exc}"[:300]
    res["speedup_dense"] = res["naive_dense_s"] / res["tree_dense_s"]
    return res


def bench_decode(dev: str, smoke: bool) -> dict:
    if smoke:
        mcfg = TinyLlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
        batches, contexts, dtype = [1, 4], [64, 256], torch.float32
    else:
        mcfg = TinyLlamaConfig(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_dim=2816)
        batches, contexts, dtype = [1, 8, 32, 64], [512, 2048, 8192], torch.bfloat16
    model = TinyLlama(mcfg, np.random.default_rng(3), dtype=dtype).to(dev)
    rows = []
    for n in batches:
        for ctx in contexts:
            ids = torch.randint(0, mcfg.vocab_size, (n, ctx), device=dev)
            pos = torch.arange(ctx, device=dev).expand(n, ctx)
            _, cache = model.prefill(ids, pos)
            nxt = torch.zeros(n, dtype=torch.long, device=dev)
            p = torch.full((n,), ctx, dtype=torch.long, device=dev)
            steps = 8
            sync()
            t = time.perf_counter()
            for s in range(steps):
                model.decode_step(nxt, p + s, cache)
            sync()
            rows.append({"batch": n, "context": ctx, "kv_tokens": n * ctx, "step_s": (time.perf_counter() - t) / steps})
            del cache
    x = np.array([[1.0, r["batch"], r["kv_tokens"]] for r in rows])
    y = np.array([r["step_s"] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    r2 = 1 - float(((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    return {"grid": rows, "a_s": coef[0], "b_s_per_seq": coef[1], "c_s_per_kv_token": coef[2], "r2": r2,
            "worst_rel_err": float(np.max(np.abs(pred - y) / y))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--only", default="exactness,training,decode", help="comma-separated sections")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__}
    for name, fn in (("exactness", check_exactness), ("training", bench_training), ("decode", bench_decode)):
        if name not in args.only.split(","):
            continue
        t = time.perf_counter()
        try:
            res[name] = fn(dev, args.smoke)
        except Exception:
            res[name] = {"error": traceback.format_exc()[-1500:]}
        res[name]["wall_s"] = time.perf_counter() - t
        print(name, json.dumps(res[name], default=float, indent=1), flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gpu_results.json"), "w") as f:
        json.dump(res, f, default=float, indent=1)


if __name__ == "__main__":
    main()
