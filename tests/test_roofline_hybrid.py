"""Hybrid linear attention (Gated DeltaNet beside full attention) against numbers worked out by hand from the
config files cited in gyre.presets: Qwen3-Next-80B-A3B and the 2.4T-A95B stand-in on the Qwen3.5 layout.

Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (12 full, 36 linear); full layers 16 query heads,
2 KV heads x 256; linear layers 16 key heads, 32 value heads, d_k = d_v = 128, conv kernel 4; hidden 2048,
512 experts top-10, vocabulary 151,936 untied; 79.7B / 3.87B parameters; bf16.
2.4T stand-in: 92 layers (23 full, 69 linear); 64 query heads, 2 KV heads x 256; 32 key heads, 128 value
heads x 128, conv 4; hidden 8,192, 512 experts top-10, vocabulary 248,320 untied; 2,400B / 95B; FP8
weights and KV, bf16 state.
Chunked gated delta rule at C = 64: per token and value head 6 d_k d_v + C (6 d_k + 4 d_v) FLOPs (C = 1 when
decoding), plus 2 x kernel per conv channel (2 H_k d_k + H_v d_v channels).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gyre.config import ConfigError, override
from gyre.datasheets import ModelConfig
from gyre.hardware import derive_costs, engine_roofline
from gyre.presets import GPUS, MODELS, get_preset
from gyre.roofline import Coefficients

IDEAL = Coefficients(eff_bw=1.0, eff_kv=1.0, eff_flops=1.0, step_overhead_s=0.0, allreduce_s=0.0,
                     allreduce_internode_s=0.0, eff_link=1.0)
H200 = GPUS["h200"]
NOLINK = replace(H200, link_gb_s=0.0)  # tensor parallel without all-reduce bytes: the step divides evenly

NEXT = MODELS["qwen3-next-80b-a3b"]
BIG = MODELS["moe-2.4t-a95b"]


def test_kv_bytes_per_token_full_layers_only():
    """Qwen3-Next: 2 x 12 full layers x 2 KV heads x 256 x 2 B = 24,576 B (the 36 linear layers keep no KV);
    the 2.4T stand-in: 2 x 23 x 2 x 256 x 1 B (FP8) = 23,552 B, against the GQA stand-in's 2 x 96 x 8 x 128."""
    assert NEXT.kv_bytes_per_token == 24_576
    assert BIG.kv_bytes_per_token == 23_552
    assert MODELS["moe-2.4t-a95b-gqa"].kv_bytes_per_token == 196_608
    assert (NEXT.full_layers, NEXT.linear_layers, BIG.full_layers, BIG.linear_layers) == (12, 36, 23, 69)
    assert NEXT.layout[:4] == ("linear_attention",) * 3 + ("full_attention",), "layer 3 is the first full one"


def test_state_bytes_per_sequence():
    """Qwen3-Next: 36 x (32 x 128 x 128 recurrent + 3 x (2 x 16 x 128 + 32 x 128) conv) x 2 B = 39,518,208 B
    = 1,608 KV tokens; the 2.4T stand-in: 69 x (128 x 128^2 + 3 x (2 x 32 x 128 + 128 x 128)) x 2 B."""
    assert NEXT.state_bytes_per_seq == 36 * (32 * 128 * 128 + 3 * 8192) * 2 == 39_518_208
    assert BIG.state_bytes_per_seq == 69 * (128 * 128 * 128 + 3 * 24_576) * 2 == 299_581_440
    assert derive_costs(NEXT, H200).state_tokens == 39_518_208 / 24_576 == 1608.0
    assert derive_costs(MODELS["moe-2.4t-a95b-gqa"], H200).state_tokens == 0.0


def _next_weights_read(tokens: int) -> float:
    """Qwen3-Next weight bytes a step of `tokens` tokens reads: routed (79.7 - 3.87)e9 / (1 - 10/512) params,
    of which 1 - (502/512)^tokens are touched, plus the rest less the input embedding table, at 2 B."""
    routed = (79.7e9 - 3.87e9) / (1 - 10 / 512)
    return ((79.7e9 - routed - 151_936 * 2048) + routed * (1 - (502 / 512) ** tokens)) * 2


def test_qwen3_next_decode_step_by_hand():
    """8 decodes at 100K tokens of context each on 2 H200s (ideal efficiency, no all-reduce bytes): linear class
    max(weights / BW, 2 (P - embedding - head) x 8 + 2 x head x 8 / peak), attention class max(800K x 24,576 B
    + 8 sequences x 2 x 39.5 MB of state read and written / BW, 4 x 12 x 16 x 256 x 800K + 8 x 36 recurrent
    steps of 32 x (6 x 128^2 + 10 x 128) + 2 x 4 x 8,192 FLOPs / peak)."""
    r = engine_roofline(NEXT, NOLINK, 2, IDEAL)
    bw, pk = 2 * 4.8e12, 2 * 989e12
    head = 151_936 * 2048
    lin = max(_next_weights_read(8) / bw, (2 * (3.87e9 - 2 * head) * 8 + 2 * head * 8) / pk)
    att_bytes = 800_000 * 24_576 + 8 * 2 * 39_518_208
    att_flops = 4 * 12 * 16 * 256 * 800_000 + 8 * 36 * (32 * (6 * 128 * 128 + 10 * 128) + 2 * 4 * 8192)
    want = lin + max(att_bytes / bw, att_flops / pk)
    assert r.step_time(8, 800_000.0) == pytest.approx(want, rel=1e-12)
    # the state read is 632 MB of the step's 20.3 GB: bandwidth-bound, as decode is
    assert att_bytes / bw > att_flops / pk


def test_qwen3_next_prefill_chunk_by_hand():
    """One 8,192-token chunk at offset 100K: the linear class compute-bound on 2 (P - embedding - head) x 8,192
    + the LM head once; attention 4 x 12 x 16 x 256 x (8,192 x 100K + 8,192^2 / 2) plus 8,192 x 36 chunked
    layers of 32 x (6 x 128^2 + 64 x 10 x 128) + 2 x 4 x 8,192 FLOPs, reading the 100K prefix's KV and the
    sequence's state once in and out."""
    r = engine_roofline(NEXT, NOLINK, 2, IDEAL)
    bw, pk = 2 * 4.8e12, 2 * 989e12
    head = 151_936 * 2048
    m, p = 8192, 100_000
    lin = max(_next_weights_read(m) / bw, (2 * (3.87e9 - 2 * head) * m + 2 * head) / pk)
    att_flops = 4 * 12 * 16 * 256 * (m * p + m * m / 2) + m * 36 * (32 * (6 * 128**2 + 64 * 10 * 128) + 2 * 4 * 8192)
    att_bytes = p * 24_576 + 2 * 39_518_208
    assert r.step_time(0, 0.0, m, p) == pytest.approx(lin + max(att_bytes / bw, att_flops / pk), rel=1e-12)


def test_qwen3_next_training_step_by_hand():
    """One 700K-token sequence on 64 H200s at MFU 0.35: 6 x 3.87e9 per token, 3 x the 36 chunked layers'
    forward FLOPs per token, and 12 x 12 full layers x 16 x 256 per token per context token (sum 700K^2 / 2)."""
    c = derive_costs(NEXT, H200)
    s = 700_000
    lin = 36 * (32 * (6 * 128**2 + 64 * 10 * 128) + 2 * 4 * 8192)
    flops = 6 * 3.87e9 * s + 3 * lin * s + 12 * 12 * 16 * 256 * s * s / 2
    assert c.train_time(s, 64, s * s / 2) == pytest.approx(flops / (64 * 989e12 * 0.35), rel=1e-12)
    # against all 48 layers as full attention the context term is 4x smaller
    assert c.train_attn_flops_per_ctx_token == 12 * 12 * 16 * 256


def _big_weights_read(tokens: float) -> float:
    """The 2.4T stand-in's FP8 weight bytes for `tokens` tokens: routed (2,400 - 95)e9 / (1 - 10/512), touched
    1 - (502/512)^tokens of them, plus the rest less the input embedding (248,320 x 8,192), 1 B each."""
    routed = (2400e9 - 95e9) / (1 - 10 / 512)
    return (2400e9 - routed - 248_320 * 8192) + routed * (1 - (502 / 512) ** tokens)


def test_big_hybrid_decode_step_by_hand():
    """16 decodes at 700K each on 32 H200s (FP8 peak 1,979 TFLOP/s each): attention reads 16 x 700K x 23,552 B
    of KV and 16 x 2 x 299.6 MB of state; FLOPs 4 x 23 x 64 x 256 per context token + 16 x 69 recurrent steps of
    128 x (6 x 128^2 + 10 x 128) + 2 x 4 x 24,576."""
    r = engine_roofline(BIG, NOLINK, 32, IDEAL)
    bw, pk = 32 * 4.8e12, 32 * 1979e12
    head = 248_320 * 8192
    ctx = 16 * 700_000
    lin = max(_big_weights_read(16) / bw, (2 * (95e9 - 2 * head) * 16 + 2 * head * 16) / pk)
    att_bytes = ctx * 23_552 + 16 * 2 * 299_581_440
    att_flops = 4 * 23 * 64 * 256 * ctx + 16 * 69 * (128 * (6 * 128**2 + 10 * 128) + 2 * 4 * 24_576)
    assert r.step_time(16, float(ctx)) == pytest.approx(lin + max(att_bytes / bw, att_flops / pk), rel=1e-12)


def test_big_hybrid_prefill_chunk_by_hand():
    """An 8,192-token chunk at offset 500K: attention 4 x 23 x 64 x 256 x (8,192 x 500K + 8,192^2 / 2) plus
    8,192 x 69 chunked layers of 128 x (6 x 128^2 + 64 x 10 x 128) + 2 x 4 x 24,576 FLOPs."""
    r = engine_roofline(BIG, NOLINK, 32, IDEAL)
    bw, pk = 32 * 4.8e12, 32 * 1979e12
    head = 248_320 * 8192
    m, p = 8192, 500_000
    lin = max(_big_weights_read(m) / bw, (2 * (95e9 - 2 * head) * m + 2 * head) / pk)
    att_flops = 4 * 23 * 64 * 256 * (m * p + m * m / 2) \
        + m * 69 * (128 * (6 * 128**2 + 64 * 10 * 128) + 2 * 4 * 24_576)
    att_bytes = p * 23_552 + 2 * 299_581_440
    assert r.step_time(0, 0.0, m, p) == pytest.approx(lin + max(att_bytes / bw, att_flops / pk), rel=1e-12)


def test_big_hybrid_training_step_by_hand():
    """xlong-swe-kv (two extra forwards) trains a 700K-token sequence on 344 H200s: 10 x 95e9 per token,
    5 x the 69 chunked layers' forward FLOPs, 20 x 23 x 64 x 256 per context token, at 989 TFLOP/s x 0.35."""
    c = get_preset("xlong-swe-kv").costs()
    s = 700_000
    lin = 69 * (128 * (6 * 128**2 + 64 * 10 * 128) + 2 * 4 * 24_576)
    flops = 10 * 95e9 * s + 5 * lin * s + 20 * 23 * 64 * 256 * s * s / 2
    assert c.train_time(s, 344, s * s / 2) == pytest.approx(flops / (344 * 989e12 * 0.35), rel=1e-12)


def test_minima_hold_for_the_hybrid_roofline():
    """The bound's per-token minima stay below what one step charges: a decode alone, a prefill token."""
    r = engine_roofline(BIG, H200, 32)
    for ctx in (0.0, 1e5, 7e5):
        assert r.decode_time(ctx) == pytest.approx(r.step_time(1, ctx), rel=1e-12)
        assert r.min_prefill_time_per_token(ctx) * 8192 <= r.step_time(0, 0.0, 8192, ctx) * (1 + 1e-12)


@pytest.mark.parametrize("fields, named", [
    ({"layer_types": ("full_attention",) * 3}, "layer_types lists 3 layers, but layers is 92"),
    ({"full_attention_interval": 0}, "full_attention_interval must be an integer >= 1, got 0"),
    ({"linear_value_heads": 0}, "linear_value_heads must be an integer >= 1"),
    ({"linear_key_head_dim": 0}, "linear_key_head_dim must be an integer >= 1"),
    ({"layer_types": ("full_attention",) * 91 + ("mamba",)}, "layer_types[91] is 'mamba'"),
])
def test_bad_layer_layout_is_one_line_naming_the_field(fields, named):
    """A layout that does not add up, a linear layer without state dims, an interval of 0: a ConfigError
    (what the CLI turns into exit 2) whose one line names the field."""
    with pytest.raises(ConfigError) as e:
        override(get_preset("xlong-swe-kv"), **{f"cluster.model.{k}": v for k, v in fields.items()})
    msg = str(e.value)
    assert named in msg and "\n" not in msg, msg
    with pytest.raises(ValueError, match="linear_conv_kernel"):
        ModelConfig(name="x", total_params_b=1, active_params_b=1, layers=4, kv_heads=1, head_dim=8,
                    full_attention_interval=2, linear_key_heads=1, linear_value_heads=1, linear_key_head_dim=8,
                    linear_value_head_dim=8)
