"""GPU checks and timings for the torch side: the packed loss on CUDA, tree packing vs naive training
steps on a ~150M-parameter model, and the decode step-time model the simulator assumes.

1. Exactness on CUDA: packed loss and every gradient equal the naive per-branch reference (fp64, dense
   ancestor-or-self mask); FlexAttention's block mask (fp32, forward and backward) matches the dense mask.
2. Training step (bf16, forward + backward): naive per-branch packs vs tree packs with the dense mask vs
   tree packs with FlexAttention, on GRPO groups with a long shared prompt and multi-turn branches.
3. Decode: time per decode step of gyre.real.nn's KV-cache path over a grid of batch sizes and contexts, and a
   least-squares fit of the simulator's form t = a + b * batch + c * kv_tokens (R^2, worst relative error).
4. A transformers model (a random Qwen3 folder written here, ~0.3B parameters): the packed loss through
   transformers' FlexAttention with the tree BlockMask vs SDPA with the boolean mask (fp32 loss and
   gradients); then a bf16 FSDP2 step (gyre.real.fsdp: one rank, NCCL, parameters and AdamW state offloaded
   to host, checkpointed layers, micro-batches, chunked log-probs) with its time and peak GPU memory, and
   the serving-dtype gather (full_state) a weight sync sends.
5. vLLM (if importable): an engine on the same folder (gyre.real.engine_vllm.VllmEngine), sleep/wake
   timings and free GPU memory around them, and an in-place weight update into its workers from the
   trainer's bf16 state (seconds).

Run: `python benchmarks/bench_gpu.py [--smoke] [--only hf,vllm]` (with PYTHONPATH=. on a machine without the
install). Without CUDA it prints a skip line and exits 0 (`--smoke` runs tiny sizes on CPU instead, vLLM
and Flex backward aside). Writes gpu_results.json to $OUT (or the current folder).
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

from gyre.real.nn.model import TinyLlamaConfig, TinyLlama
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


def _hf_packs(smoke: bool, vocab: int):
    rng = np.random.default_rng(5)
    prompt, turns, tok = (16, 2, 8) if smoke else (1024, 6, 256)
    recs = sharing_groups(rng, 2 if smoke else 8, vocab, prompt, turns, tok, tok // 2)
    trees = [r.tree for r in recs]
    advs = [rng.normal(size=len(r.executions)) for r in recs]
    return build_packs(trees, advs, PackConfig(max_tokens=512 if smoke else 16384)).packs


def bench_hf(dev: str, smoke: bool) -> dict:
    """Section 4 (see the module docstring)."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gyre.real.nn.hf_causal import build_model
    from gyre.real.nn.hf_folder import write_tiny_model
    from gyre.real.fsdp import full_state, shard_model
    from gyre.trajectory.torch_ops import LossConfig, concat_packs, micro_batch_loss, micro_batches

    shape = dict(hidden_size=64, num_layers=2, vocab_size=512) if smoke else \
        dict(hidden_size=1024, num_layers=16, vocab_size=32000, head_dim=128)
    folder = str(write_tiny_model(f"{tempfile.mkdtemp()}/q3", "qwen3", **shape))
    packs = _hf_packs(smoke, shape["vocab_size"])
    res = {"params": None, "packs": len(packs), "pack_tokens": [p.size for p in packs][:8]}
    loss_cfg = LossConfig(logprob_chunk=1024)
    if dev == "cuda":  # Flex (BlockMask) vs SDPA (boolean mask), fp32, forward + backward
        grads = {}
        for attn in ("sdpa", "flex_attention"):
            m = build_model(folder, device=dev, attn=attn)
            m.train()
            sync()
            t = time.perf_counter()
            loss = sum(micro_batch_loss(m, p, loss_cfg, use_flex=attn != "sdpa", device=dev) for p in packs[:2])
            loss.backward()
            sync()
            grads[attn] = (float(loss), {n: q.grad.float() for n, q in m.named_parameters()},
                           time.perf_counter() - t)
            del m
        (la, ga, ta), (lb, gb, tb) = grads["sdpa"], grads["flex_attention"]
        scale = max(float(g.abs().max()) for g in ga.values())
        res |= {"flex_vs_sdpa_loss_err": abs(la - lb), "flex_vs_sdpa_grad_err_rel": max(
            float((ga[k] - gb[k]).abs().max()) for k in ga) / scale, "sdpa_fwd_bwd_s": ta, "flex_fwd_bwd_s": tb}
    backend = "nccl" if dev == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        model = build_model(folder, device=dev, grad_checkpointing=True)
        res["params"] = sum(p.numel() for p in model.parameters())
        model.train()
        shard_model(model, init_device_mesh(dev, (1,)), param_dtype=torch.bfloat16, offload=dev == "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        for mb in micro_batches(packs, 512 if smoke else 32768):
            micro_batch_loss(model, concat_packs(mb), loss_cfg, use_flex=dev == "cuda", device=dev).backward()
        opt.step()
        sync()
        res["fsdp_bf16_step_s"] = time.perf_counter() - t
        res["fsdp_tokens"] = sum(p.size for p in packs)
        if dev == "cuda":
            res["fsdp_peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        t = time.perf_counter()
        state = full_state(model, torch.bfloat16)
        res["full_state_s"] = time.perf_counter() - t
        res["full_state_gib"] = sum(v.numel() * v.element_size() for v in state.values()) / 2**30
    finally:
        dist.destroy_process_group()
    res["folder"] = folder
    return res


def bench_vllm(dev: str, smoke: bool, folder: str | None) -> dict:
    """Section 5 (see the module docstring)."""
    import asyncio

    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vllm is not importable"}
    if dev != "cuda" or folder is None:
        return {"skipped": "needs CUDA and the hf section's folder"}
    from gyre.real.nn.hf_causal import build_model
    from gyre.real.engine_vllm import VllmEngine, VllmEngineConfig

    state = {k: v.to(torch.bfloat16) for k, v in build_model(folder).serving_state().items()}
    eng = VllmEngine(VllmEngineConfig(model=folder, gpu_memory_utilization=0.3, max_model_len=4096,
                                      enforce_eager=True))

    async def go() -> dict:
        out = {"wake_s": await eng.wake(None, 0)}
        free = lambda: torch.cuda.mem_get_info()[0] / 2**30  # noqa: E731
        out["free_awake_gib"] = free()
        out["generate"] = len((await eng.generate("s", [1, 2, 3], 16, [], 0))["tokens"])
        out["sleep_s"] = await eng.sleep()
        out["free_asleep_gib"] = free()
        out["wake_again_s"] = await eng.wake(None, 0)
        out["load_weights_s"] = await eng.load_weights(state, 1)
        out["generate_after_update"] = len((await eng.generate("s2", [1, 2, 3], 16, [], 0))["tokens"])
        return out

    try:
        return asyncio.run(go())
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--only", default="exactness,training,decode,hf,vllm", help="comma-separated sections")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.smoke:
        print("bench_gpu: no CUDA device here: skipped (--smoke runs tiny sizes on CPU)")
        return
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__}
    sections = (("exactness", check_exactness), ("training", bench_training), ("decode", bench_decode),
                ("hf", bench_hf), ("vllm", lambda d, s: bench_vllm(d, s, res.get("hf", {}).get("folder"))))
    for name, fn in sections:
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
