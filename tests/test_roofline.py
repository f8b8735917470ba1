"""The engine-step roofline against numbers worked out by hand from spec sheets and config files."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.hardware import derive_costs, engine_roofline
from gyre.presets import GPUS, MODELS
from gyre.roofline import Coefficients, distinct_experts, kv_bytes_per_token

IDEAL = Coefficients(eff_bw=1.0, eff_kv=1.0, eff_flops=1.0, step_overhead_s=0.0, allreduce_s=0.0,
                     allreduce_internode_s=0.0, eff_link=1.0)
EMBED = 128_256 * 4096  # Llama-3.1-8B's input embedding table and, untied, its LM head: 525.3M parameters each


def test_kv_bytes_per_token_gqa_and_mla():
    """Llama-3.1-8B: 2 x 32 layers x 8 KV heads x 128 x 2 B = 128 KiB; DeepSeek-V3 MLA: 61 x (512 + 64) x 2 B."""
    assert kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128, bytes_per_elem=2) == 131_072
    assert kv_bytes_per_token(layers=61, kv_heads=128, head_dim=128, bytes_per_elem=2, kv_lora_rank=512,
                              rope_dim=64) == 70_272
    assert MODELS["llama-3.1-8b"].kv_bytes_per_token == 131_072


def test_distinct_experts_by_hand():
    """One token touches k experts; two touch 256 (1 - (248/256)^2) = 15.75; many touch all E."""
    assert distinct_experts(256, 8, 1) == pytest.approx(8.0)
    assert distinct_experts(256, 8, 2) == pytest.approx(15.75)
    assert distinct_experts(256, 8, 10_000) == pytest.approx(256.0)
    assert distinct_experts(256, 8, 0) == 0.0


def test_batch_one_decode_is_weights_over_bandwidth():
    """Llama-3.1-8B bf16 on one H100 at batch 1, empty context: the weights but the input embedding table
    (16.06 GB - 1.05 GB, gathered by row) / 3.35 TB/s = 4.480 ms (ideal efficiency)."""
    r = engine_roofline(MODELS["llama-3.1-8b"], GPUS["h100"], 1, IDEAL)
    w = 16.06e9 - 2 * EMBED
    assert r.step_time(1, 0.0) == pytest.approx(w / 3.35e12, rel=1e-9)
    # with 100K tokens of context attention's KV read adds 100,000 x 131,072 B / 3.35 TB/s = 3.913 ms
    assert r.step_time(1, 100_000) == pytest.approx((w + 100_000 * 131_072) / 3.35e12, rel=1e-9)
    # the default coefficients: weights at 80% of the bandwidth, KV at 65%, plus a 4 ms step overhead
    d = engine_roofline(MODELS["llama-3.1-8b"], GPUS["h100"], 1)
    assert d.step_time(1, 0.0) == pytest.approx(w / (0.8 * 3.35e12) + 0.004, rel=1e-9)
    assert d.step_time(1, 1e5) == pytest.approx(w / (0.8 * 3.35e12) + 1e5 * 131_072 / (0.65 * 3.35e12) + 0.004,
                                                 rel=1e-9)


def test_full_prefill_chunk_is_compute_bound():
    """An 8,192-token chunk at offset 0 on Llama-3.1-8B / H100: 2 x (8.03e9 - embedding - LM head) x 8192, plus
    the LM head for the one token that samples, plus 4 x 32 x 32 x 128 x 8192^2 / 2 = 1.3194e14 FLOPs /
    989 TFLOP/s = 0.1334 s; at offset 100K the attention adds 4 x 32 x 32 x 128 x 8192 x 1e5."""
    r = engine_roofline(MODELS["llama-3.1-8b"], GPUS["h100"], 1, IDEAL)
    flops = 2 * (8.03e9 - 2 * EMBED) * 8192 + 2 * EMBED + 4 * 32 * 32 * 128 * 8192**2 / 2
    assert r.step_time(0, 0.0, 8192, 0.0) == pytest.approx(flops / 989e12, rel=1e-9)
    assert r.step_time(0, 0.0, 8192, 1e5) == pytest.approx((flops + 4 * 32 * 32 * 128 * 8192 * 1e5) / 989e12,
                                                           rel=1e-9)
    # a 100K-token prompt alone: 12 full chunks and one of 1,696, each at its offset
    want = sum(r.step_time(0, 0.0, min(8192, 100_000 - o), o) for o in range(0, 100_000, 8192))
    assert r.prefill_time(100_000) == pytest.approx(want, rel=1e-12)


def test_moe_reads_active_experts_at_batch_one_and_all_at_large_batch():
    """The 2.4T/95B GQA stand-in in FP8: one token reads 95 GB of weights, a large batch all 2.4 TB."""
    r = engine_roofline(MODELS["moe-2.4t-a95b-gqa"], GPUS["h200"], 32, IDEAL)
    assert r.weight_bytes_read(1) == pytest.approx(95e9, rel=1e-9)
    assert r.weight_bytes_read(100_000) == pytest.approx(2400e9, rel=1e-6)
    # 32 GPUs of 4.8 TB/s across 4 nodes: 95 GB / 153.6 TB/s, plus the token's 2 x 96 ring all-reduces of
    # 16,384 bf16 activations, the 8 rails' NICs (8 x 50 GB/s) the bottleneck: 192 x 2 x 31/32 x 32,768 B / 400 GB/s
    assert r.step_time(1, 0.0) == pytest.approx(95e9 / (32 * 4.8e12) + 192 * 2 * 31 / 32 * 32_768 / 400e9, rel=1e-9)


def test_tensor_parallel_divides_and_adds_all_reduces():
    """Two GPUs halve the roofline part and add two ring all-reduces per layer, each a latency plus
    2 (g - 1) / g x tokens x 4,096 x 2 B over the link at eff_link (NVLink 450 GB/s inside a node; across
    nodes the 8 rails' 50 GB/s InfiniBand NICs, with the slower latency)."""
    coef = Coefficients(eff_bw=1.0, eff_kv=1.0, eff_flops=1.0, step_overhead_s=0.0, allreduce_s=1e-5,
                        allreduce_internode_s=3e-5, eff_link=0.5)
    one = engine_roofline(MODELS["llama-3.1-8b"], GPUS["h100"], 1, coef)
    two = engine_roofline(MODELS["llama-3.1-8b"], GPUS["h100"], 2, coef)
    ar2 = 2 * 32 * (1e-5 + 2 * 1 / 2 * 4 * 8192 / (0.5 * 450e9))
    assert two.step_time(4, 1e4) == pytest.approx(one.step_time(4, 1e4) / 2 + ar2, rel=1e-9)
    sixteen = engine_roofline(MODELS["llama-3.1-8b"], GPUS["h100"], 16, coef)
    ar16 = 2 * 32 * (3e-5 + 2 * 15 / 16 * 4 * 8192 / (0.5 * 8 * 50e9))  # 8 rails' NICs, slower than NVLink x 8/7
    assert sixteen.step_time(4, 1e4) == pytest.approx(one.step_time(4, 1e4) / 16 + ar16, rel=1e-9)
    # a GPU without a link figure moves no all-reduce bytes, only pays their latency
    bare = engine_roofline(MODELS["llama-3.1-8b"], replace(GPUS["h100"], link_gb_s=0.0), 2, coef)
    assert bare.step_time(4, 1e4) == pytest.approx(one.step_time(4, 1e4) / 2 + 2 * 32 * 1e-5, rel=1e-9)


def test_kv_capacity_by_hand():
    """Llama-3.1-8B on one H100: 80 GB x 0.9 - 2 GB reserve - 16.06 GB weights = 53.94 GB / 128 KiB = 411,529 tokens;
    on the RTX 4090 with the reserve vLLM measured (1.2376 GB) the 41,408 tokens vLLM reported."""
    assert engine_roofline(MODELS["llama-3.1-8b"], GPUS["h100"], 1).kv_capacity_tokens == int(53.94e9 // 131_072)
    r = engine_roofline(MODELS["llama-3.1-8b"], GPUS["rtx4090"], 1, Coefficients(reserve_gb_per_gpu=1.2376))
    assert abs(r.kv_capacity_tokens - 41_408) < 16, r.kv_capacity_tokens  # vLLM rounds to 16-token blocks
    assert derive_costs(MODELS["llama-3.1-8b"], GPUS["h100"]).kv_capacity_tokens == int(53.94e9 // 131_072)


@given(n=st.integers(0, 512), ctx=st.floats(0, 1e7), m=st.integers(0, 8192), p=st.floats(0, 1e6),
       model=st.sampled_from(sorted(MODELS)), dn=st.integers(0, 64), dctx=st.floats(0, 1e6), dm=st.integers(0, 512))
def test_step_time_grows_with_every_input(n, ctx, m, p, model, dn, dctx, dm):
    """More decodes, more context or a longer chunk never make a step faster (the bound relies on it)."""
    costs = derive_costs(MODELS[model], GPUS["h200"])
    r = costs.roofline
    base = r.step_time(n, ctx, m, p)
    assert r.step_time(n + dn, ctx + dctx, m + dm, p) >= base * (1 - 1e-12)
    assert base >= (r.coef.step_overhead_s if n + m else 0.0)


def test_training_attention_context_by_hand():
    """Prompt 10 (sum 50), 4 tokens at context 10 (40 + 8), 6 tool tokens at 14 (84 + 18), 2 tokens at 20 (40 + 2)."""
    from gyre.hardware import train_attention_ctx

    assert train_attention_ctx(10, [4, 2], [10, 20], [6]) == 242.0


def test_ideal_share_is_one_at_full_efficiency_without_overhead():
    """With 100% efficiencies and no overhead a step runs at its roofline: utilization 1; the defaults give less."""
    r = engine_roofline(MODELS["llama-3.1-8b"], GPUS["h100"], 1, IDEAL)
    assert r.ideal_share(8, 8e4, 512, 1e4) == pytest.approx(1.0)
    d = engine_roofline(MODELS["llama-3.1-8b"], GPUS["h100"], 1)
    w = 16.06e9 - 2 * EMBED
    assert d.ideal_share(1, 0.0) == pytest.approx((w / 3.35e12) / (w / (0.8 * 3.35e12) + 0.004))


@given(n=st.integers(0, 300), ctx=st.floats(0, 1e7), m=st.integers(0, 8192), p=st.floats(0, 1e6),
       model=st.sampled_from(sorted(MODELS)))
def test_step_and_ideal_agrees_with_step_time_and_share(n, ctx, m, p, model):
    """The simulator's one-pass (time, ideal) equals step_time and ideal_share x step_time."""
    r = derive_costs(MODELS[model], GPUS["h200"]).roofline
    t, ideal = r.step_and_ideal(n, ctx, m, p)
    assert t == pytest.approx(r.step_time(n, ctx, m, p), rel=1e-12)
    assert ideal == pytest.approx(r.ideal_share(n, ctx, m, p) * t, rel=1e-9, abs=1e-15)


def test_roofline_pickles_and_copies_after_its_step_function_is_built():
    """A used roofline (its step function cached) still pickles, deep-copies and compares equal, as configs
    sent to worker processes must."""
    import copy
    import pickle

    r = derive_costs(MODELS["moe-30b-a3b"], GPUS["h200"]).roofline
    want = r.step_and_ideal(4, 1e4, 512, 2e3)
    for back in (pickle.loads(pickle.dumps(r)), copy.deepcopy(r)):
        assert back == r, "the copy equals the original"
        assert back.step_and_ideal(4, 1e4, 512, 2e3) == want, "the copy's step is the original's"


@given(turns=st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 1e7), st.floats(0, 1e6)), max_size=12),
       prompt=st.floats(0, 1e6), last_tool=st.booleans())
def test_train_attention_ctx_gives_numpys_bits_on_its_plain_python_path(turns, prompt, last_tool):
    """Short executions skip numpy, yet the sum is bit-for-bit the vectorised one (same order of additions)."""
    import numpy as np

    from gyre.hardware import train_attention_ctx

    gen, kv, out = [t[0] for t in turns], [t[1] for t in turns], [t[2] for t in turns]
    out = out if last_tool else out[:-1]
    g, k = np.asarray(gen, dtype=float), np.asarray(kv, dtype=float)
    o = np.zeros(len(g))
    o[: len(out)] = out
    want = float(0.5 * prompt * prompt + np.sum(g * k + 0.5 * g * g + o * (k + g) + 0.5 * o * o))
    assert train_attention_ctx(prompt, gen, kv, out) == want, "the same float, not merely close"


def _ring_time_by_ports(nodes: int, per_node: int, nbytes: float, link: float, nic: float) -> float:
    """A ring all-reduce of `nbytes` laid out explicitly: one ring per rail r, visiting the nodes in turn and
    inside each node its GPUs starting at local GPU r, so ring r leaves every node from local GPU r - 1.
    Every hop of a ring of n members carries 2 (n - 1) / n of the ring's share; the all-reduce takes as
    long as its busiest send port (a GPU's in-node link, or its NIC)."""
    n = nodes * per_node
    load: dict[tuple[str, int], float] = {}
    for r in range(per_node):
        order = [k * per_node + (r + i) % per_node for k in range(nodes) for i in range(per_node)]
        hop = 2 * (n - 1) / n * nbytes / per_node
        for a, b in zip(order, order[1:] + order[:1]):
            port = ("link", a) if a // per_node == b // per_node else ("nic", a)
            load[port] = load.get(port, 0.0) + hop
    return max(v / (link if kind == "link" else nic) for (kind, _), v in load.items())


@pytest.mark.parametrize("nodes,per_node,link,nic", [(4, 8, 450e9, 50e9), (2, 8, 450e9, 100e9),
                                                     (3, 4, 100e9, 12.5e9), (4, 1, 31.5e9, 25e9)])
def test_multi_node_all_reduce_matches_rings_laid_out_port_by_port(nodes, per_node, link, nic):
    """The engine's per-token all-reduce bytes cross nodes at the bus bandwidth of explicit rail rings."""
    from gyre.roofline_comm import ring_bytes_s

    g, nbytes = nodes * per_node, 32_768.0
    want = _ring_time_by_ports(nodes, per_node, nbytes, link, nic)
    assert 2 * (g - 1) / g * nbytes / ring_bytes_s(link, nic, per_node, True) == pytest.approx(want, rel=1e-12)
