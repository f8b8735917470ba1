"""benchmarks/bench_gpu.py and the simulator predictions it sets beside its GPU measurements (gpu_predict.py).

CPU: the measured models' config.json fields count to their published sizes through the simulator's own
counter, and their predictions agree with the simulator's presets; the script skips cleanly without CUDA and
refuses an unknown section. GPU (marked `gpu`): the packed tree loss equals the naive per-branch loss on CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_predict as gp  # noqa: E402
from gyre.hardware import CostConfig, derive_costs  # noqa: E402
from gyre.presets import GPUS, MODELS  # noqa: E402

# Hugging Face model cards: total (and non-embedding) parameters, in billions
PUBLISHED = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dense_configs_count_to_the_published_sizes(name):
    """Each dense Qwen3 config transcribed in gpu_predict counts to its model card's total and non-embedding size."""
    m = gp.sim_model(gp.fields(name), name)
    total, non_embedding = PUBLISHED[name]
    assert m.total_params_b == pytest.approx(total, abs=0.05), f"{name}: {m.total_params_b:.3f}B counted"
    emb = m.vocab * m.width * (1 if m.tied_embeddings else 2) / 1e9
    assert m.total_params_b - emb == pytest.approx(non_embedding, abs=0.05), f"{name}: non-embedding"


def test_moe_config_matches_the_simulators_preset():
    """Qwen3-30B-A3B's transcribed config gives the preset's sizes and, on the H200, its training time within 2%."""
    m = gp.sim_model(gp.fields("qwen3-30b-a3b"), "moe")
    p = MODELS["moe-30b-a3b"]
    assert (m.layers, m.kv_heads, m.q_heads, m.experts, m.top_k, m.hidden, m.vocab) == \
        (p.layers, p.kv_heads, p.q_heads, p.experts, p.top_k, p.hidden, p.vocab), "shape differs from the preset"
    assert m.total_params_b == pytest.approx(p.total_params_b, rel=0.01), "total parameters"
    assert m.active_params_b == pytest.approx(p.active_params_b, rel=0.02), "active parameters"
    mine = gp.train_prediction(m, 16384, 64, True)["pred_s"]
    ref = derive_costs(p, GPUS["h200"], CostConfig(train_extra_forwards=1, train_seq_tokens=16384))
    from gyre.hardware import train_attention_ctx

    theirs = ref.train_time(16384, 1, train_attention_ctx(64, [16384 - 64], [64], []))
    assert mine == pytest.approx(theirs, rel=0.02), f"{mine} vs the preset's {theirs}"


def test_a_cut_moe_keeps_its_layer_shape():
    """Cutting the MoE to 4 layers keeps the per-layer parameters: (total - embeddings) scales by 4/48."""
    full, cut = (gp.sim_model(gp.fields("qwen3-30b-a3b", n), "m") for n in (None, 4))
    emb = 2 * full.vocab * full.width / 1e9
    assert cut.layers == 4, "layers"
    assert cut.total_params_b - emb == pytest.approx((full.total_params_b - emb) * 4 / 48, rel=1e-9), "per layer"


def test_training_prediction_grows_with_checkpointing_and_length():
    """Checkpointing adds a forward (longer predicted step, same memory state); activations grow linearly in S."""
    m = gp.sim_model(gp.fields("qwen3-1.7b"), "m")
    on, off = (gp.train_prediction(m, 16384, 64, c) for c in (True, False))
    assert on["pred_s"] > off["pred_s"], "the recomputed forward costs time"
    assert on["model_flops"] == off["model_flops"], "model FLOPs count no recompute"
    a, b = (gp.train_prediction(m, s, 64, True)["pred_act_bytes"] for s in (8192, 16384))
    assert b == pytest.approx(2 * a), "activations are linear in the sequence length"
    assert on["pred_state_bytes"] == pytest.approx(16 * m.total_params_b * 1e9), "16 B a parameter"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "bench_gpu.py"), *args], capture_output=True, text=True,
                          timeout=120, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})


def test_bench_gpu_without_cuda_skips_and_refuses_unknown_sections():
    """Without a GPU the script prints one skip line and exits 0; an unknown --only section exits 2 naming it."""
    ok = _run()
    assert ok.returncode == 0 and "skipped" in ok.stdout, ok.stdout + ok.stderr
    bad = _run("--only", "train,bogus")
    assert bad.returncode == 2 and "bogus" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.mark.gpu
def test_packed_loss_equals_naive_on_cuda(tmp_path):
    """On CUDA the packed tree loss and gradients equal the naive per-branch ones to 1e-5 in fp32; in bf16 each
    packed path is no further from the fp32 reference than max(1.25 x the naive bf16 path's own error, 1e-3)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import bench_gpu

    run = bench_gpu.Run(tmp_path, 600.0, "cuda", smoke=True)
    bench_gpu.section_tree(run, {})
    assert all(r["status"] == "ok" for r in run.rows), [r.get("error") for r in run.rows]
    rows = {(r["dtype"], r["what"].split()[0], r["attn"]): r for r in run.rows}
    naive = rows[("bfloat16", "naive", "sdpa")]
    packed = [r for (_, kind, _), r in rows.items() if kind == "packed"]
    assert len(packed) == 4, "sdpa and flex, fp32 and bf16"
    for r in packed:
        if r["dtype"] == "float32":
            assert r["loss_err_vs_naive_same_dtype"] < 1e-5, f"{r['what']}: loss {r['loss_err_vs_naive_same_dtype']}"
            assert r["grad_rel_err_vs_naive_same_dtype"] < 1e-5, f"{r['what']}: {r['grad_rel_err_vs_naive_same_dtype']}"
            continue
        for q in ("loss_err_vs_fp32_naive", "grad_rel_err_vs_fp32_naive"):
            bound = max(1.25 * naive[q], 1e-3)
            assert r[q] <= bound, f"{r['what']}: {q} {r[q]:.3g} > {bound:.3g} (naive bf16: {naive[q]:.3g})"
