"""GPU checks and timings for the torch side, each beside the simulator's prediction for the same shape.

Sections of issue 49 (the default; `gpu_predict.py` gives the predictions, the H200 preset):
- env: the machine (nvidia-smi name, driver, torch, CUDA, transformers), and the two ceilings measured here
  (a bf16 8192^3 matrix product, a device-to-device copy).
- copies: a Qwen3-4B's bf16 weights host -> device from pageable and pinned memory (engine wake; trainer
  onload), device -> host (offload), and device -> device (standing for a weight-snapshot pull: streaming
  training has not landed, so no such pull exists in the code yet), against bytes / `host_gb_s`.
- tree: the packed tree loss (FlexAttention block mask and the SDPA boolean mask) against the naive per-branch
  loss on branching GRPO trees, on a Qwen3-0.6B, fp32 and bf16 autocast (loss and gradient errors, times).
- decode: the torch engine's decode step (`CausalLM.decode_step` on a `KVCache`, what TorchEngine._step runs;
  the engine itself keeps its tensors on the CPU) at batch 1-64, against the engine roofline's step time.
- train: a bf16 training step through the trainer's path (FSDP2 `gyre.real.fsdp.shard_model` on one rank,
  fp32 master weights under bf16 autocast, `micro_batch_loss`, gradient clipping, AdamW) on random-init
  Qwen3-0.6B / 1.7B / 4B and a Qwen3-30B-A3B cut to its first layers, activation checkpointing on and off,
  4K-64K tokens, its peak GPU memory, against `Costs.train_time` at `train_mfu` and the memory minimum
  (`gyre.hardware.train_memory_bytes`); one row with the shards offloaded to host (the trainer's CUDA default).
  An out-of-memory row is recorded, not fatal. Each train and memory row also times the mask's build
  (`mask_build_s`, `mask_build_peak_gib`).
- mask: building the FlexAttention block mask (`torch_ops.block_mask`, from the pack's `leave` ranges) of tree
  packs of 11K-68K tokens and of one 64K-token sequence: its time and peak GPU memory, its partial and full blocks.
Each row is written to $OUT as it finishes (gpu_rows.csv, gpu_results.json); `--budget-s` bounds the run:
a row whose estimated time no longer fits is recorded as skipped.

Older sections (`--only exactness,training,decode_tiny,hf,vllm`): the packed loss's exactness on CUDA (fp64), tree
packing vs naive steps on a ~150M TinyLlama, its decode grid, a transformers Qwen3 folder through Flex vs SDPA
and an FSDP2 step with offload, and vLLM sleep/wake (if importable).

Run: `python benchmarks/bench_gpu.py [--smoke] [--only env,mask,copies,tree,decode,train] [--budget-s 360]`. gyre
need not be installed: the checkout's packages are mapped as pyproject.toml's package-dir says. Without
CUDA it prints a skip line and exits 0 (`--smoke` runs tiny sizes on the CPU instead).
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


class _PackageDirs(importlib.abc.MetaPathFinder):
    """Finds gyre's packages in this checkout as pyproject.toml's package-dir maps them (gyre.real is real/, ...)."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    def find_spec(self, name, path=None, target=None):
        d = self.dirs.get(name)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])


def use_source_tree() -> None:
    """Make `gyre.*` importable from this checkout when it is not installed (a device machine runs a copy)."""
    try:
        import gyre.real  # noqa: F401
        return
    except ImportError:
        pass
    import tomllib

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name in [m for m in sys.modules if m == "gyre" or m.startswith("gyre.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _PackageDirs({k: ROOT / v for k, v in dirs.items()}))


use_source_tree()
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gyre.real.nn.model import TinyLlamaConfig, TinyLlama  # noqa: E402
from gyre.trajectory import PackConfig, TaskRecorder, build_packs  # noqa: E402
from gyre.trajectory.torch_ops import branches_of, naive_loss, packed_loss  # noqa: E402


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


# ---------------------------------------------------------------------------------------------------------------
# issue 49: measured beside the simulator's prediction
# ---------------------------------------------------------------------------------------------------------------

GIB = 2**30


class Run:
    """The run's clock, its rows and where they go: every `add` rewrites gpu_rows.csv and gpu_results.json under
    `out`, so a run stopped at any point leaves what it measured."""

    def __init__(self, out: Path, budget_s: float, dev: str, smoke: bool) -> None:
        self.out, self.dev, self.smoke = out, dev, smoke
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.rows: list[dict] = []
        self.info: dict = {}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def add(self, row: dict) -> None:
        row = {"t_s": round(time.perf_counter() - self.t0, 2), **row}
        self.rows.append(row)
        short = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()
                 if k in ("section", "model", "what", "seq", "ckpt", "attn", "batch", "context", "status",
                          "measured_s", "pred_s", "ratio", "peak_gib", "pred_mem_gib", "mem_ratio", "mfu",
                          "gb_s", "rel_err", "mask_build_s", "mask_build_peak_gib", "t_s")}
        print("row", json.dumps(short), flush=True)
        self.save()

    def save(self) -> None:
        import pandas as pd

        self.out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(self.rows).to_csv(self.out / "gpu_rows.csv", index=False)
        with open(self.out / "gpu_results.json", "w") as f:
            json.dump({"machine": self.info, "rows": self.rows}, f, default=float, indent=1)


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(fn, warmup: int, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `fn` after `warmup` (CUDA events on a GPU, the wall clock on a CPU)."""
    for _ in range(warmup):
        fn()
    cuda_sync()
    out = []
    for _ in range(reps):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_causal(cfg_fields: dict, dev: str, dtype: torch.dtype, attn: str):
    """A random-init transformers model of config.json fields `cfg_fields`, built on `dev` in `dtype` (no folder,
    no download), behind gyre's CausalLM (the interface the trainer and the torch engine use)."""
    import transformers

    from gyre.real.nn.hf_causal import CausalLM

    cls = transformers.Qwen3MoeConfig if cfg_fields["model_type"] == "qwen3_moe" else transformers.Qwen3Config
    kw = {k: v for k, v in cfg_fields.items() if k not in ("architectures", "model_type")}
    cfg = cls(**kw, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(dev):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    return CausalLM(hf), hf


def set_attention(hf, attn: str) -> None:
    """Switch a built transformers model's attention implementation (sdpa / flex_attention)."""
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation(attn)
    else:
        hf.config._attn_implementation = attn


def section_env(run: Run, models: dict) -> None:
    """The machine, and two ceilings: a bf16 matrix product and a device-to-device copy."""
    import transformers

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "device": run.dev}
    if run.dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": torch.cuda.get_device_name(), "sms": p.multi_processor_count,
                 "gpu_mem_gib": p.total_memory / GIB}
        try:
            q = "name,driver_version,memory.total,clocks.max.sm,clocks.sm,power.limit,pstate"
            info["nvidia_smi"] = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"],
                                                capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as exc:  # noqa: BLE001 (a description, never fatal)
            info["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    run.info = info
    n = 512 if run.smoke else 8192
    a, b = (torch.randn(n, n, device=run.dev, dtype=torch.bfloat16) for _ in range(2))
    ts = timed_steps(lambda: a @ b, 3, 3 if run.smoke else 10)
    run.add({"section": "env", "what": f"bf16 matmul {n}^3 (random data)", "measured_s": statistics.median(ts),
             "tflops": 2 * n**3 / statistics.median(ts) / 1e12, "pred_tflops": 989.0,
             "note": "H200 preset bf16_tflops (data sheet, dense)"})
    nbytes = (64 << 20) if run.smoke else (4 << 30)
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=run.dev).normal_()
    y = torch.empty_like(x)
    ts = timed_steps(lambda: y.copy_(x), 2, 3 if run.smoke else 10)
    run.add({"section": "env", "what": "device-to-device copy (read + write)", "bytes": nbytes,
             "measured_s": statistics.median(ts), "gb_s": 2 * nbytes / statistics.median(ts) / 1e9,
             "pred_gb_s": 4800.0, "note": "H200 preset hbm_tb_s"})
    del a, b, x, y
    free_memory()


def section_copies(run: Run, models: dict) -> None:
    """The weights of a Qwen3-4B (bf16, one tensor per parameter) between host and device."""
    import gpu_predict as gp

    name = "tiny-dense" if run.smoke else "qwen3-4b"
    cfg = gp.fields(name)
    m = gp.sim_model(cfg, name)
    with torch.device("meta"):
        net, _ = hf_causal(cfg, "meta", torch.bfloat16, "sdpa")
    shapes = [t.shape for t in net.serving_state().values()]
    del net
    dev = [torch.empty(s, dtype=torch.bfloat16, device=run.dev).normal_() for s in shapes]
    nbytes = sum(t.numel() * t.element_size() for t in dev)
    pred = gp.copy_prediction(m, nbytes)
    pin = run.dev == "cuda"
    pinned = [torch.empty(s, dtype=torch.bfloat16, pin_memory=pin) for s in shapes]
    pageable = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    for t in pageable:  # touch every page once: the first copy into fresh pages would time the page faults
        t.zero_()

    def copy(dst, src, non_blocking=False):
        for d, s_ in zip(dst, src):
            d.copy_(s_, non_blocking=non_blocking)

    cases = [("device->host pinned (trainer offload, engine sleep)", lambda: copy(pinned, dev, True)),
             ("device->host pageable", lambda: copy(pageable, dev)),
             ("host pageable->device (engine wake: a model .to(cuda))", lambda: copy(dev, pageable)),
             ("host pinned->device (FSDP offload onload, pinned)", lambda: copy(dev, pinned, True)),
             ("device->device (stands for a weight snapshot pull; streaming training has not landed)",
              lambda: [t.clone() for t in dev])]
    for what, fn in cases:
        ts = timed_steps(fn, 1, 3)
        t = statistics.median(ts)
        d2d = what.startswith("device->device")
        row = {"section": "copies", "model": name, "what": what, "bytes": nbytes, "measured_s": t,
               "gb_s": nbytes / t / 1e9}
        if d2d:  # no simulator figure: the HBM roofline (read + write) for scale
            row |= {"pred_s": 2 * nbytes / 4.8e12, "note": "HBM roofline 2 x bytes / 4.8 TB/s (no simulator figure)"}
        else:
            row |= {"pred_s": pred["pred_s"], "note": f"bytes / host_gb_s {pred['host_gb_s']} GB/s"}
        row["ratio"] = row["measured_s"] / row["pred_s"]
        run.add(row)
    run.add({"section": "copies", "model": name, "what": "simulator: engine wake, trainer onload (whole model)",
             "pred_s": pred["engine_wake_s"], "engine_wake_fixed_s": pred["engine_wake_fixed_s"],
             "trainer_onload_pred_s": pred["trainer_onload_s"],
             "note": "derive_costs: weights / host_gb_s + engine_wake_fixed_s; trainer state 16 B/param / host_gb_s"})
    del dev, pinned, pageable
    free_memory()


def _tree_group(rng, vocab: int, smoke: bool):
    recs = sharing_groups(rng, 1, vocab, *((32, 2, 8, 8) if smoke else (1024, 2, 256, 256)))
    advs = [rng.normal(size=len(r.executions)) for r in recs]
    return recs, advs


def _near_policy(model, recs, dev: str, rng, spread: float = 0.1) -> None:
    """Give every trained token of the trees the model's own fp32 log-prob plus N(0, `spread`) noise as its old
    log-prob, so policy ratios sit near 1, inside the clip range, and the loss depends on the model (random old
    log-probs clip nearly every term to a constant)."""
    with torch.no_grad():
        for r in recs:
            tree = r.tree
            noise = rng.normal(0.0, spread, tree.size)
            for leaf in tree.branch_leaf:
                idx, q = [], int(leaf)
                while q >= 0:
                    idx.append(q)
                    q = int(tree.parent[q])
                idx = np.asarray(idx[::-1], np.int64)
                ids = torch.as_tensor(tree.tokens[idx], device=dev)[None]
                pos = torch.arange(len(idx), device=dev)[None]
                logp = torch.log_softmax(model(ids, pos)[0].double(), dim=-1)
                lp = logp[:-1].gather(1, ids[0, 1:, None])[:, 0].cpu().numpy()
                trained = tree.trained[idx[1:]]
                tree.logprob[idx[1:][trained]] = lp[trained] + noise[idx[1:][trained]]


def section_tree(run: Run, models: dict) -> None:
    """Packed tree loss vs the naive per-branch loss on a Qwen3-0.6B: fp32 (exactness) and bf16 autocast, each path
    also against the fp32 naive loss (the bf16 rounding the reference itself carries)."""
    import gpu_predict as gp
    from gyre.trajectory.torch_ops import LossConfig

    name = "tiny-dense" if run.smoke else "qwen3-0.6b"
    cfg = gp.fields(name)
    model, hf = hf_causal(cfg, run.dev, torch.float32, "sdpa")
    model.train()
    rng = np.random.default_rng(7)
    recs, advs = _tree_group(rng, cfg["vocab_size"], run.smoke)
    _near_policy(model, recs, run.dev, rng)
    batch = build_packs([r.tree for r in recs], advs, PackConfig(max_tokens=1 << 15, normalization="sequence"))
    branches = [b for r, a in zip(recs, advs) for b in branches_of(r.tree, a)]
    naive_tokens = sum(len(b.tokens) for b in branches)
    # sum over trained rows of weight x |advantage|: the size of the loss's terms (their ratios are near 1)
    scale = float(sum(np.sum(p.rows.weight * np.abs(p.rows.advantage)) for p in batch.packs))
    loss_cfg = LossConfig()
    params = list(model.parameters())
    paths = [("naive", "sdpa"), ("packed", "sdpa")] + ([("packed", "flex_attention")] if run.dev == "cuda" else [])
    ref: dict = {}
    for dtype in ("float32", "bfloat16"):
        for kind, attn in paths:
            set_attention(hf, attn)

            def step():
                model.zero_grad(set_to_none=True)
                with torch.autocast(run.dev, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                    if kind == "naive":
                        loss = naive_loss(model, branches, "sequence", loss_cfg, device=run.dev)
                    else:
                        loss = packed_loss(model, batch.packs, loss_cfg, use_flex=attn != "sdpa", device=run.dev)
                loss.backward()
                return loss

            row = {"section": "tree", "model": name, "what": f"{kind} loss, {attn}, {dtype}", "dtype": dtype,
                   "attn": attn, "tokens": naive_tokens if kind == "naive" else batch.stats.packed_tokens,
                   "branches": len(branches)}
            try:
                ts = timed_steps(step, 1, 2 if dtype == "bfloat16" else 1)
                loss = float(step().detach())
                grad = torch.cat([p.grad.detach().float().reshape(-1) for p in params])
                key = (dtype, kind, attn)
                ref[key] = (loss, grad)
                base = ref.get(("float32", "naive", "sdpa"))
                same = ref.get((dtype, "naive", "sdpa"))
                row |= {"measured_s": statistics.median(ts), "loss": loss, "status": "ok"}
                row["loss_scale"] = scale
                for tag, r in (("vs_fp32_naive", base), ("vs_naive_same_dtype", same)):
                    if r is not None and r is not ref[key]:
                        # the loss sums terms of both signs: its error is measured against the terms' size
                        row[f"loss_err_{tag}"] = abs(loss - r[0]) / scale
                        row[f"grad_rel_err_{tag}"] = float((grad - r[1]).norm() / r[1].norm())
                row["rel_err"] = row.get("grad_rel_err_vs_naive_same_dtype")
            except Exception as exc:  # noqa: BLE001 (a row records its failure)
                row |= {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
                traceback.print_exc()
            run.add(row)
    del model, hf, ref
    free_memory()


def section_decode(run: Run, models: dict) -> None:
    """The torch engine's decode step (CausalLM.decode_step on a KVCache) at batch 1-64, bf16 weights."""
    import gpu_predict as gp
    from gyre.real.nn.kv_cache import KVCache

    grid = ({"tiny-dense": ([1, 4], [64])} if run.smoke else
            {"qwen3-0.6b": ([1, 8, 32, 64], [1024, 4096]), "qwen3-4b": ([1, 8, 32, 64], [2048])})
    for name, (batches, contexts) in grid.items():
        cfg = gp.fields(name)
        m = gp.sim_model(cfg, name)
        model, _ = hf_causal(cfg, run.dev, torch.bfloat16, "sdpa")
        model.eval()
        kvh, hd, layers = cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]
        for n in batches:
            for ctx in contexts:
                if run.left() < 20:
                    run.add({"section": "decode", "model": name, "batch": n, "context": ctx, "status": "skipped: time"})
                    continue
                row = {"section": "decode", "model": name, "batch": n, "context": ctx, "kv_tokens": n * ctx}
                try:
                    cache = KVCache(
                        keys=[torch.randn(n, kvh, ctx, hd, dtype=torch.bfloat16, device=run.dev) for _ in range(layers)],
                        values=[torch.randn(n, kvh, ctx, hd, dtype=torch.bfloat16, device=run.dev) for _ in range(layers)],
                        valid=torch.ones(n, ctx, dtype=torch.bool, device=run.dev))
                    nxt = torch.randint(0, cfg["vocab_size"], (n,), device=run.dev)
                    pos = [ctx]

                    def step():
                        model.decode_step(nxt, torch.full((n,), pos[0], device=run.dev), cache)
                        pos[0] += 1

                    ts = timed_steps(step, 2, 3 if run.smoke else 6)
                    pred = gp.decode_prediction(m, n, n * ctx)
                    t = statistics.median(ts)
                    row |= {"measured_s": t, "pred_s": pred["pred_s"], "ratio": t / pred["pred_s"],
                            "engine_gpus": pred["engine_gpus"], "status": "ok",
                            "note": "engine roofline, default coefficients (vLLM-shaped engine)"}
                    del cache
                except torch.OutOfMemoryError as exc:
                    row |= {"status": "oom", "error": str(exc).splitlines()[0][:300]}
                except Exception as exc:  # noqa: BLE001 (a row records its failure)
                    row |= {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
                    traceback.print_exc()
                free_memory()
                run.add(row)
        del model
        free_memory()


def mask_build(run: Run, pack, use_flex: bool) -> tuple[object, dict]:
    """Build the trainer's attention mask of `pack` (`block_mask` under flex, else the [S, S] `dense_mask`) once
    more after a warm-up: its time and, on CUDA, its peak memory above what was allocated before."""
    from gyre.trajectory.torch_ops import block_mask, dense_mask

    def build():
        return block_mask(pack, run.dev) if use_flex else dense_mask(pack, run.dev)[None]

    build()  # warm-up (allocator, kernels); dropped at once
    free_memory()
    base = torch.cuda.memory_allocated() if run.dev == "cuda" else 0
    if run.dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cuda_sync()
    t = time.perf_counter()
    mask = build()
    cuda_sync()
    out = {"mask_build_s": time.perf_counter() - t}
    if run.dev == "cuda":
        out["mask_build_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
    return mask, out


# (GRPO groups concatenated into one pack) for the mask section: 11,264 packed tokens a group, so 11K-68K tokens
MASK_GROUPS = [1, 2, 3, 6]


def section_mask(run: Run, models: dict) -> None:
    """Building the FlexAttention block mask of a tree pack (`torch_ops.block_mask`, from the pack's `leave`
    ranges) at 11K-68K tokens and of one 64K-token sequence: time, peak GPU memory, its blocks; beside it what
    the [S, S] predicate would have held at 10 B a pair (the old `create_block_mask` build, run 2's 40 GiB at 64K)."""
    from gyre.trajectory.torch_ops import concat_packs, tree_blocks

    vocab = 1000
    cases = []
    for groups in ([1, 2] if run.smoke else MASK_GROUPS):
        recs = sharing_groups(np.random.default_rng(groups), groups, vocab,
                              *((32, 2, 8, 8) if run.smoke else (1024, 2, 256, 256)))
        advs = [np.random.default_rng(0).normal(size=len(r.executions)) for r in recs]
        batch = build_packs([r.tree for r in recs], advs, PackConfig(max_tokens=1 << 30))
        cases.append((f"{groups} GRPO group(s), one pack", concat_packs(batch.packs)))
    seq = 256 if run.smoke else MAX_SEQ
    cases.append(("one sequence", single_sequence_pack(np.random.default_rng(0), vocab, seq, PROMPT)))
    for what, pack in cases:
        if run.left() < 5:
            run.add({"section": "mask", "what": what, "seq": pack.size, "status": "skipped: time"})
            continue
        row = {"section": "mask", "what": what, "seq": pack.size, "attn": "flex_attention",
               "dense_predicate_gib": 10 * pack.size**2 / GIB}
        try:
            mask, built = mask_build(run, pack, True)
            partial, full = tree_blocks(torch.as_tensor(pack.leave, device=run.dev), 128)
            row |= built | {"status": "ok", "partial_blocks": int(partial.sum()), "full_blocks": int(full.sum()),
                        "block_pairs": int(partial.numel()), "sparsity_pct": float(mask.sparsity())}
            del mask
        except Exception as exc:  # noqa: BLE001 (a row records its failure)
            row |= {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
            traceback.print_exc()
        run.add(row)
        free_memory()


def single_sequence_pack(rng, vocab: int, seq: int, prompt: int):
    """One pack of one sequence: a prompt of `prompt` tokens, then `seq - prompt` trained model tokens."""
    rec = TaskRecorder("t0", rng.integers(0, vocab, prompt))
    ex = rec.start()
    ex.append_model(rng.integers(0, vocab, seq - prompt), -rng.exponential(0.5, seq - prompt), 0)
    ex.finish(1.0)
    batch = build_packs([rec.tree], [np.array([1.0])], PackConfig(max_tokens=seq, normalization="sequence"))
    assert len(batch.packs) == 1 and batch.packs[0].size == seq, "one sequence must make one pack of its length"
    return batch.packs[0]


# (model, layers cut to or None, [(sequence length, checkpointing)]) in the order run: a first pass of every model
# at 4K and 16K tokens, then a second at 32K and 64K (a model is rebuilt for its second pass)
TRAIN_PLAN = [
    ("qwen3-0.6b", None, [(4096, True), (4096, False), (16384, True), (16384, False)]),
    ("qwen3-1.7b", None, [(4096, True), (4096, False), (16384, True), (16384, False)]),
    ("qwen3-4b", None, [(4096, True), (4096, False), (16384, True), (16384, False)]),
    ("qwen3-30b-a3b", 4, [(4096, True), (4096, False), (16384, True), (16384, False)]),
    ("qwen3-0.6b", None, [(32768, True), (32768, False), (65536, True), (65536, False)]),
    ("qwen3-1.7b", None, [(32768, True), (65536, True), (32768, False), (65536, False)]),
    ("qwen3-4b", None, [(32768, True), (65536, True), (32768, False)]),
    ("qwen3-30b-a3b", 4, [(32768, True), (65536, True)]),
]
SMOKE_PLAN = [("tiny-dense", None, [(128, True), (128, False)]), ("tiny-moe", None, [(128, True), (128, False)]),
              ("tiny-dense", None, [(256, True)])]
# the model whose first pass also runs the trainer's defaults: sdpa (boolean mask) and offload (FSDP2 CPUOffloadPolicy)
DEFAULTS_MODEL, DEFAULTS_SEQ = "qwen3-1.7b", 16384
PROMPT = 64  # untrained prompt tokens of each training sequence
MAX_SEQ = 65536
RESERVE_S = 12.0  # seconds held back per model of the first pass still to come (its build and first row)


class _Trainee:
    """A model as the trainer holds it under sharding = "fsdp": FSDP2 over a one-rank mesh, fp32 master weights."""

    def __init__(self, cfg: dict, dev: str, attn: str, offload: bool) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from gyre.real.fsdp import shard_model

        self.model, self.hf = hf_causal(cfg, dev, torch.float32, attn)
        self.model.train()
        shard_model(self.model, init_device_mesh(dev, (1,)), offload=offload, sum_grads=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, weight_decay=0.0)
        self.params = list(self.model.parameters())
        self.ckpt = None

    def checkpointing(self, on: bool) -> None:
        """Each decoder layer recomputed in the backward, as build_model(grad_checkpointing=True) sets it."""
        if on != self.ckpt:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24 renames these (same behaviour)
                if on:
                    self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                else:
                    self.hf.gradient_checkpointing_disable()
            self.ckpt = on
            self.model.train()

    def step(self, pack, dev: str, use_flex: bool) -> None:
        """Trainer._backward's body for one micro-batch, then clip and AdamW (Trainer.train)."""
        from gyre.real.fsdp import whole
        from gyre.trajectory.torch_ops import LossConfig, micro_batch_loss

        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16):
            part = micro_batch_loss(self.model, pack, LossConfig(), use_flex=use_flex, device=dev)
        part.backward()
        whole(torch.nn.utils.clip_grad_norm_(self.params, 1.0))
        self.opt.step()


def _train_row(run: Run, t: _Trainee, name: str, cfg: dict, m, seq: int, ckpt: bool, attn: str, offload: bool,
               est_rate: float, reserve: float = 0.0) -> dict:
    """One training-step row: the step's median time and peak memory beside the simulator's figures."""
    import gpu_predict as gp

    pred = gp.train_prediction(m, seq, PROMPT, ckpt)
    row = {"section": "train", "model": name, "layers": cfg["num_hidden_layers"], "seq": seq, "ckpt": ckpt,
           "attn": attn, "offload": offload, "params": sum(p.numel() for p in t.params),
           "pred_s": pred["pred_s"], "pred_mem_gib": pred["pred_mem_bytes"] / GIB if ckpt else None,
           "pred_state_gib": pred["pred_state_bytes"] / GIB, "pred_act_gib": pred["pred_act_bytes"] / GIB,
           "model_flops": pred["model_flops"]}
    step_est = pred["model_flops"] * (4 / 3 if ckpt else 1) / est_rate + (8.0 if offload else 0.0)
    reps = 1 if step_est > 3 else 2 if step_est > 0.5 else 3
    if step_est * (1 + reps) + 5 > run.left() - reserve:
        return row | {"status": "skipped: time", "est_step_s": step_est}
    rng = np.random.default_rng(seq)
    pack = single_sequence_pack(rng, cfg["vocab_size"], seq, PROMPT)
    t.checkpointing(ckpt)
    use_flex = attn == "flex_attention"
    if run.dev == "cuda":
        mk, built = mask_build(run, pack, use_flex)
        row |= built
        del mk
    try:
        ts = timed_steps(lambda: t.step(pack, run.dev, use_flex), 1, 0)  # warm-up: compiles, AdamW state
        if run.dev == "cuda":
            free_memory()
            row["resident_gib"] = torch.cuda.memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
        ts = timed_steps(lambda: t.step(pack, run.dev, use_flex), 0, reps)
        meas = statistics.median(ts)
        row |= {"status": "ok", "measured_s": meas, "steps_s": ts, "ratio": meas / pred["pred_s"],
                "mfu": pred["model_flops"] / meas / pred["peak_flops"],
                "mfu_sim_convention": pred["train_mfu"] * pred["pred_s"] / meas}
        if run.dev == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
            if ckpt and not offload:
                row["mem_ratio"] = row["peak_gib"] / row["pred_mem_gib"]
    except torch.OutOfMemoryError as exc:
        row |= {"status": "oom", "error": str(exc).splitlines()[0][:300]}
    except Exception as exc:  # noqa: BLE001 (a row records its failure)
        row |= {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
        traceback.print_exc()
    return row


def section_train(run: Run, models: dict) -> None:
    """bf16 training steps through the trainer's FSDP2 path, checkpointing on and off, beside the simulator."""
    import torch.distributed as dist

    import gpu_predict as gp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29563")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if run.dev == "cuda" else "gloo", rank=0, world_size=1)
    flex = run.dev == "cuda"  # the trainer's GPU path (attention = "flex"); no flex backward on a CPU
    plan = SMOKE_PLAN if run.smoke else TRAIN_PLAN
    defaults = ("tiny-dense", 128) if run.smoke else (DEFAULTS_MODEL, DEFAULTS_SEQ)
    rate = 300e12 if run.dev == "cuda" else 2e9  # FLOP/s for the time guard, replaced by each measurement
    first_pass = len({n for n, _, _ in plan})
    oom_off: set[str] = set()  # models whose run without checkpointing ran out of memory at a shorter length
    done_defaults = False
    for mi, (name, layers, rows) in enumerate(plan):
        cfg = gp.fields(name, layers, max_positions=MAX_SEQ)
        label = name if layers is None else f"{name}-{layers}l"
        m = gp.sim_model(cfg, label)
        reserve = RESERVE_S * max(0, first_pass - 1 - mi)
        trainee = None
        try:
            for seq, ckpt in rows:
                if not ckpt and label in oom_off:
                    run.add({"section": "train", "model": label, "seq": seq, "ckpt": False,
                             "status": "skipped: a shorter sequence ran out of memory"})
                    continue
                if run.left() - reserve < 10:
                    run.add({"section": "train", "model": label, "seq": seq, "ckpt": ckpt, "status": "skipped: time"})
                    continue
                attn = "flex_attention" if flex else "sdpa"
                if trainee is None:
                    trainee = _Trainee(cfg, run.dev, attn, offload=False)
                set_attention(trainee.hf, attn)
                row = _train_row(run, trainee, label, cfg, m, seq, ckpt, attn, False, rate, reserve)
                run.add(row)
                if row.get("status") == "ok":
                    rate = row["model_flops"] * (4 / 3 if ckpt else 1) / row["measured_s"]
                elif row.get("status") == "oom":
                    if not ckpt:
                        oom_off.add(label)
                    trainee = None  # a sharded model after an out-of-memory mid-step: rebuilt for the next row
                    free_memory()
                elif row.get("status") == "error":
                    flex = False  # FlexAttention failed here: the rows after it use sdpa (each row names its path)
                    trainee = None
                    free_memory()
            if name == defaults[0] and not done_defaults:
                done_defaults = True
                if trainee is None:
                    trainee = _Trainee(cfg, run.dev, "sdpa", offload=False)
                set_attention(trainee.hf, "sdpa")
                run.add(_train_row(run, trainee, label, cfg, m, defaults[1], True, "sdpa", False, rate, reserve)
                        | {"note": "the trainer's default attention: SDPA with the boolean ancestor mask"})
                trainee = None
                free_memory()
                attn = "flex_attention" if flex else "sdpa"
                trainee = _Trainee(cfg, run.dev, attn, offload=run.dev == "cuda")
                run.add(_train_row(run, trainee, label, cfg, m, defaults[1], True, attn, run.dev == "cuda", rate,
                                   reserve) | {"note": "FSDP2 CPUOffloadPolicy (the trainer's CUDA default): "
                                                       "shards, gradients and AdamW on the host"})
        except Exception as exc:  # noqa: BLE001 (a model that fails is recorded; the next one runs)
            run.add({"section": "train", "model": label, "status": "error",
                     "error": f"{type(exc).__name__}: {exc}"[:400]})
            traceback.print_exc()
        trainee = None
        free_memory()


# (model, layers or None, sequence lengths): checkpointed steps split into their memory phases
MEMORY_PLAN = [("qwen3-0.6b", None, [4096, 16384, 32768, 65536]), ("qwen3-1.7b", None, [4096, 16384, 32768, 65536]),
               ("qwen3-4b", None, [4096, 16384, 32768]), ("qwen3-30b-a3b", 4, [16384, 65536])]
SMOKE_MEMORY = [("tiny-dense", None, [128, 256])]


def _phase_step(t: _Trainee, pack, dev: str, use_flex: bool, mask) -> dict:
    """The trainer's step (micro_batch_loss's body with its mask built beforehand, clip, AdamW) with the peak
    memory and time of each phase: forward + backward, then the optimizer."""
    from gyre.real.fsdp import whole
    from gyre.trajectory.torch_ops import LossConfig, row_logprobs, rows_loss

    cfg = LossConfig()
    out = {}
    cuda = dev == "cuda"
    t.opt.zero_grad(set_to_none=True)
    if cuda:
        free_memory()
        out["start_gib"] = torch.cuda.memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.autocast(dev, dtype=torch.bfloat16):
        ids = torch.as_tensor(pack.input_ids, device=dev)[None]
        pos = torch.as_tensor(pack.position_ids, device=dev)[None]
        h = t.model.hidden_states(ids, pos, mask)[0]
        pred = torch.as_tensor(pack.rows.pred, device=dev)
        target = torch.as_tensor(pack.rows.target, device=dev)
        loss = rows_loss(row_logprobs(t.model.head_logits, h[pred], target, cfg.logprob_chunk), pack.rows, cfg)
    loss.backward()
    cuda_sync()
    out["fwd_bwd_s"] = time.perf_counter() - t0
    if cuda:
        out["fwd_bwd_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["after_bwd_gib"] = torch.cuda.memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    whole(torch.nn.utils.clip_grad_norm_(t.params, 1.0))
    t.opt.step()
    cuda_sync()
    out["optimizer_s"] = time.perf_counter() - t0
    if cuda:
        out["optimizer_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    return out


def section_memory(run: Run, models: dict) -> None:
    """Where a checkpointed step's peak memory comes from: the attention mask's construction, the forward and
    backward (activations), the optimizer step; beside the simulator's state and activation terms."""
    import torch.distributed as dist

    import gpu_predict as gp
    from gyre.trajectory.torch_ops import block_mask

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29564")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if run.dev == "cuda" else "gloo", rank=0, world_size=1)
    use_flex = run.dev == "cuda"
    attn = "flex_attention" if use_flex else "sdpa"
    for name, layers, seqs in (SMOKE_MEMORY if run.smoke else MEMORY_PLAN):
        cfg = gp.fields(name, layers, max_positions=MAX_SEQ)
        label = name if layers is None else f"{name}-{layers}l"
        m = gp.sim_model(cfg, label)
        t = None
        try:
            for seq in seqs:
                pred = gp.train_prediction(m, seq, PROMPT, True)
                step_est = pred["model_flops"] * 4 / 3 / 250e12
                row = {"section": "memory", "model": label, "seq": seq, "ckpt": True, "attn": attn,
                       "pred_s": pred["pred_s"], "pred_state_gib": pred["pred_state_bytes"] / GIB,
                       "pred_act_gib": pred["pred_act_bytes"] / GIB, "pred_mem_gib": pred["pred_mem_bytes"] / GIB}
                if 2 * step_est + 8 > run.left():
                    run.add(row | {"status": "skipped: time"})
                    continue
                if t is None:
                    t = _Trainee(cfg, run.dev, attn, offload=False)
                    t.checkpointing(True)
                    if run.dev == "cuda":
                        row["experts_implementation"] = getattr(t.hf.config, "_experts_implementation", None)
                pack = single_sequence_pack(np.random.default_rng(seq), cfg["vocab_size"], seq, PROMPT)
                try:
                    mask, built = mask_build(run, pack, use_flex)
                    row |= built
                    _phase_step(t, pack, run.dev, use_flex, mask)  # warm-up: compiles this length; AdamW's state
                    ph = _phase_step(t, pack, run.dev, use_flex, mask)
                    row |= ph | {"status": "ok", "measured_s": ph["fwd_bwd_s"] + ph["optimizer_s"]}
                    row["ratio"] = row["measured_s"] / pred["pred_s"]
                    if run.dev == "cuda":
                        n = sum(p.numel() for p in t.params)
                        row["params"] = n
                        row["state_16b_gib"] = 16 * n / GIB
                        # above the weights and AdamW moments (12 B/param, all that is held when the step starts)
                        row["fwd_bwd_above_12b_gib"] = ph["fwd_bwd_peak_gib"] - 12 * n / GIB
                        row["act_ratio"] = row["fwd_bwd_above_12b_gib"] / row["pred_act_gib"]
                        row["optimizer_above_16b_gib"] = ph["optimizer_peak_gib"] - 16 * n / GIB
                        row["peak_gib"] = max(ph["fwd_bwd_peak_gib"], ph["optimizer_peak_gib"])
                        row["mem_ratio"] = row["peak_gib"] / row["pred_mem_gib"]
                    del mask
                except torch.OutOfMemoryError as exc:
                    row |= {"status": "oom", "error": str(exc).splitlines()[0][:300]}
                    t = None
                run.add(row)
            if run.dev == "cuda" and name == "qwen3-1.7b" and run.left() > 20:
                # AdamW fused (one kernel per step, no full-size temporary) beside the trainer's default (foreach)
                t = None
                free_memory()
                t = _Trainee(cfg, run.dev, attn, offload=False)
                t.checkpointing(True)
                t.opt = torch.optim.AdamW(t.params, lr=1e-6, weight_decay=0.0, fused=True)
                pack = single_sequence_pack(np.random.default_rng(1), cfg["vocab_size"], 4096, PROMPT)
                mask = block_mask(pack, run.dev)
                _phase_step(t, pack, run.dev, use_flex, mask)
                ph = _phase_step(t, pack, run.dev, use_flex, mask)
                n = sum(p.numel() for p in t.params)
                run.add({"section": "memory", "model": label, "seq": 4096, "ckpt": True, "attn": attn,
                         "what": "AdamW(fused=True), not the trainer's default", "status": "ok", **ph,
                         "measured_s": ph["fwd_bwd_s"] + ph["optimizer_s"],
                         "optimizer_above_16b_gib": ph["optimizer_peak_gib"] - 16 * n / GIB})
        except Exception as exc:  # noqa: BLE001
            run.add({"section": "memory", "model": label, "status": "error",
                     "error": f"{type(exc).__name__}: {exc}"[:400]})
            traceback.print_exc()
        t = None
        free_memory()


SECTIONS = {"env": section_env, "copies": section_copies, "tree": section_tree, "decode": section_decode,
            "train": section_train, "memory": section_memory, "mask": section_mask}
OLD = {"exactness": check_exactness, "training": bench_training, "decode_tiny": bench_decode, "hf": bench_hf}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--only", default="env,mask,copies,tree,decode,train", help="comma-separated sections")
    ap.add_argument("--budget-s", type=float, default=360.0, help="wall budget: rows that no longer fit are skipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_rows.csv and gpu_results.json")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    bad = [s for s in only if s not in SECTIONS and s not in OLD and s != "vllm"]
    if bad:
        print(f"bench_gpu: --only: unknown section(s) {', '.join(bad)}; known: "
              f"{', '.join([*SECTIONS, *OLD, 'vllm'])}", file=sys.stderr)
        sys.exit(2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.smoke:
        print("bench_gpu: no CUDA device here: skipped (--smoke runs tiny sizes on CPU)")
        return
    run = Run(Path(args.out), args.budget_s, dev, args.smoke)
    if dev == "cuda":  # FlexAttention compiles per sequence length and head layout: never fall back to eager
        import torch._dynamo as dynamo

        for k in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                  "accumulated_recompile_limit"):
            if hasattr(dynamo.config, k):
                setattr(dynamo.config, k, 256)
    if "env" not in only:
        run.info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    models: dict = {}
    for name in only:
        t = time.perf_counter()
        if name in SECTIONS:
            try:
                SECTIONS[name](run, models)
            except Exception as exc:  # noqa: BLE001 (a section that fails is recorded; the next one runs)
                traceback.print_exc()
                run.add({"section": name, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]})
            print(f"section {name}: {time.perf_counter() - t:.1f} s, {run.left():.0f} s of the budget left", flush=True)
            continue
        fn = OLD.get(name) or (lambda d, s: bench_vllm(d, s, run.info.get("hf", {}).get("folder")))
        try:
            res = fn(dev, args.smoke)
        except Exception:  # noqa: BLE001
            res = {"error": traceback.format_exc()[-1500:]}
        res["wall_s"] = time.perf_counter() - t
        run.info[name] = res
        run.save()
        print(name, json.dumps(res, default=float, indent=1), flush=True)
    run.save()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
