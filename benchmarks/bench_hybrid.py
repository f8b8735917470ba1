"""Hybrid linear attention beside full attention, on one 700K-token rollout: what an engine holds, what a
decode step and a prefill cost, and what training the rollout costs, for the 2.4T-A95B stand-ins (hybrid on
the Qwen3.5 layout, full GQA, MLA) and Qwen3-Next-80B-A3B, all from gyre.hardware's cost model with its
default coefficients (no simulation).

Per model: engine GPUs (H200), KV bytes per token, state bytes per sequence, KV tokens an engine holds, how
many 700K-token rollouts fit one engine (context plus state), a decode step with that many sequences at 700K
each (and at batch 8), the decode token time of one sequence alone at 700K, the prefill of a 700K-token
context alone, and the training of one 700K-token sequence (attention context sum 700K^2 / 2) on the
trainer's minimum GPUs, with xlong-swe-kv's training settings (activation and log-prob recompute, a
1M-token sequence's activations held) for all four.

Run: `python benchmarks/bench_hybrid.py`
"""

from __future__ import annotations

from gyre.hardware import CostConfig, derive_costs
from gyre.presets import GPUS, KV_WINDOW, MODELS

ROLLOUT = 700_000
NAMES = ("moe-2.4t-a95b", "moe-2.4t-a95b-gqa", "moe-2.4t-a95b-mla", "qwen3-next-80b-a3b")


def figures(name: str) -> dict:
    m = MODELS[name]
    c = derive_costs(m, GPUS["h200"], CostConfig(train_extra_forwards=2, train_seq_tokens=KV_WINDOW))
    r = c.roofline
    fit = int(c.kv_capacity_tokens // (ROLLOUT + c.state_tokens))
    n = max(1, min(fit, c.max_num_seqs))
    attn = ROLLOUT * ROLLOUT / 2 * c.train_attn_flops_per_ctx_token  # training attention FLOPs
    return {
        "model": name,
        "engine GPUs": c.engine_gpus,
        "KV B/token": f"{m.kv_bytes_per_token:,.0f}",
        "state MB/seq": f"{m.state_bytes_per_seq / 1e6:,.1f}",
        "KV tokens/engine": f"{c.kv_capacity_tokens / 1e6:,.1f}M",
        "700K rollouts/engine": fit,
        f"decode step at that batch (ms)": f"{1e3 * r.step_time(n, n * ROLLOUT):,.1f} (B={n})",
        "decode step, B=8 (ms)": f"{1e3 * r.step_time(8, 8 * ROLLOUT):,.1f}",
        "decode alone (ms/token)": f"{1e3 * r.decode_time(ROLLOUT):,.2f}",
        "prefill 700K alone (s)": f"{r.prefill_time(ROLLOUT):,.1f}",
        "trainer min GPUs": c.min_train_gpus,
        "train 700K seq (s)": f"{c.train_time(ROLLOUT, c.min_train_gpus, ROLLOUT * ROLLOUT / 2):,.1f}",
        "of which attention (s)": f"{attn / c.train_flops_per_s_gpu / c.min_train_gpus:,.1f}",
    }


def main() -> None:
    rows = [figures(n) for n in NAMES]
    keys = list(rows[0])
    width = max(map(len, keys))
    cols = [max(len(str(r[k])) for k in keys) for r in rows]
    for k in keys:
        print(f"{k:<{width}}  " + "  ".join(f"{str(r[k]):>{w}}" for r, w in zip(rows, cols)))


if __name__ == "__main__":
    main()
