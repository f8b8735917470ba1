"""The packed tree loss on a transformers model: the SDPA boolean-mask path, micro-batches, bf16 and checkpointing.

(transformers' FlexAttention path compiles flex_attention with inductor even on CPU, minutes here and a C++
compile error for some shapes in torch 2.13; it is checked against SDPA on a GPU by benchmarks/bench_gpu.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from test_trajectory_pack import random_group  # noqa: E402

from gyre.real.nn.hf_causal import build_model  # noqa: E402
from gyre.real.nn.hf_folder import write_tiny_model  # noqa: E402
from gyre.real.trainer import Trainer, TrainerConfig  # noqa: E402
from gyre.trajectory import PackConfig, build_packs, group_advantages, score_group  # noqa: E402
from gyre.trajectory.torch_ops import (  # noqa: E402
    LossConfig, branches_of, micro_batches, naive_loss, packed_loss,
)

VOCAB = 24
LOSS = LossConfig(clip_low=0.2, clip_high=0.28, logprob_chunk=7)  # small chunks: many chunk boundaries


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    torch.set_num_threads(1)  # as the trainer runs (TrainerConfig.threads); more only contend on a shared CPU
    return str(write_tiny_model(tmp_path_factory.mktemp("q3"), "qwen3", vocab_size=VOCAB, seed=4))


def batch(seed: int, groups: int):
    rng = np.random.default_rng(seed)
    trees, advs = [], []
    for _ in range(groups):
        rec, _ = random_group(rng, 8, 12, vocab=VOCAB)
        trees.append(rec.tree)
        advs.append(group_advantages(score_group(rec, lambda s: 0.1 * s.generated_tokens)))
    return trees, advs


def loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(a, b, tol, what):
    (la, ga), (lb, gb) = a, b
    assert set(ga) == set(gb), f"{what}: gradients of different parameters"
    assert abs(la - lb) <= tol * max(1.0, abs(lb)), f"{what}: loss {la} vs {lb}"
    scale = max(float(g.abs().max()) for g in gb.values())
    err = max(float((ga[k] - gb[k]).abs().max()) for k in gb)
    assert err <= tol * scale, f"{what}: gradients differ by {err:.3g} (largest {scale:.3g})"


def test_packed_loss_on_qwen3_equals_naive_reference(qwen3):
    """Packs of > 512 tokens, run as micro-batches (several packs per forward, tree position ids, boolean ancestor
    mask through SDPA, chunked row log-probs): loss and gradients equal the per-branch full-logit reference (fp32,
    1e-5 of the largest gradient)."""
    model = build_model(qwen3)
    model.train()
    trees, advs = batch(0, 12)
    branches = [b for i, t in enumerate(trees) for b in branches_of(t, advs[i], sum(len(a) for a in advs[:i]))]
    ref = loss_and_grads(model, lambda: naive_loss(model, branches, "sequence", LOSS))
    packed = build_packs(trees, advs, PackConfig(max_tokens=1024, normalization="sequence"))
    sizes = [p.size for p in packed.packs]
    assert max(sizes) > 512, f"the batch should make packs longer than 512 tokens: {sizes}"
    assert len(micro_batches(packed.packs, 2048)) < len(packed.packs), "some micro-batch should hold two packs"
    for micro in (0, 2048):
        got = loss_and_grads(model, lambda: packed_loss(model, packed.packs, LOSS, micro_tokens=micro))
        assert_close(got, ref, 1e-5, f"micro_tokens={micro}")


def test_checkpointed_layers_give_the_same_gradient(qwen3):
    """Gradient checkpointing recomputes each layer in the backward: the same gradients (fp32, 1e-6)."""
    trees, advs = batch(2, 6)
    packs = build_packs(trees, advs, PackConfig(max_tokens=1024)).packs
    plain, ckpt = build_model(qwen3), build_model(qwen3, grad_checkpointing=True)
    plain.train()
    ckpt.train()
    assert_close(loss_and_grads(ckpt, lambda: packed_loss(ckpt, packs, LOSS)),
                 loss_and_grads(plain, lambda: packed_loss(plain, packs, LOSS)), 1e-6, "checkpointed")


def _trainer(qwen3, **cfg) -> Trainer:
    return Trainer(qwen3, TrainerConfig(lr=1e-3, epochs=1, max_pack_tokens=1024, **cfg), seed=0)


def _flat(d: dict, keys) -> torch.Tensor:
    return torch.cat([d[k].float().flatten() for k in keys])


def _update(t: Trainer, batch_) -> dict:
    before = {k: v.clone() for k, v in t.weights(0).items()}
    t.train(batch_)
    return {k: t.weights(1)[k] - before[k] for k in before}


def test_bf16_micro_batched_step_matches_one_fp32_step(qwen3):
    """Against one fp32 forward over the whole batch: fp32 micro-batches of 64 tokens give its gradient to
    summation order (1e-5, relative L2) and its AdamW update to 1e-3 of the largest entry; bf16 autocast (fp32
    master weights, gradients and AdamW state) + micro-batches + checkpointing give its gradient within 3e-2
    (relative L2: bf16 keeps 8 mantissa bits, 2^-8 = 3.9e-3 per rounding; measured 6.8e-3) and an update of
    cosine >= 0.98 (AdamW's first step divides by |g|: entries with tiny gradients move by up to lr either way)."""
    trees, advs = batch(3, 8)
    b = [(t.preorder(), a) for t, a in zip(trees, advs)]
    runs = {"one": dict(micro_batch_tokens=100_000), "micro": dict(micro_batch_tokens=64),
            "bf16": dict(micro_batch_tokens=64, dtype="bfloat16", grad_checkpointing=True)}
    grads = {n: _trainer(qwen3, **c).gradient(b) for n, c in runs.items()}
    keys = sorted(grads["one"])
    ref = _flat(grads["one"], keys)
    rel = {n: float((_flat(g, keys) - ref).norm() / ref.norm()) for n, g in grads.items()}
    assert rel["micro"] <= 1e-5, f"fp32 micro-batched gradient off by {rel['micro']:.3g} (relative L2)"
    assert 0 < rel["bf16"] <= 3e-2, f"bf16 gradient off by {rel['bf16']:.3g} (relative L2)"
    ups = {n: _update(_trainer(qwen3, **c), b) for n, c in runs.items()}
    scale = max(float(u.abs().max()) for u in ups["one"].values())
    err = max(float((ups["micro"][k] - ups["one"][k]).abs().max()) for k in keys)
    assert err <= 1e-3 * scale, f"fp32 micro-batched update differs by {err:.3g} (largest {scale:.3g})"
    cos = float(torch.nn.functional.cosine_similarity(_flat(ups["one"], keys), _flat(ups["bf16"], keys), dim=0))
    assert cos >= 0.98, f"bf16 update: cosine {cos:.4f} to the fp32 one"
