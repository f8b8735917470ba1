"""Per-tensor-parallel-rank slices (gyre.real.tp_shards): a tensor-parallel forward built from every rank's
slices equals the whole model's (attention with GQA and biases, gated MLP, vocab-parallel embedding and head)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gyre.real.tp_shards import TPSpec, rank_state  # noqa: E402

D, HD, INTER, VOCAB, T = 16, 8, 24, 50, 5  # VOCAB is not a multiple of 64: the last rank's rows are padding


def _layer(heads: int, kv: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": r(VOCAB, D), "lm_head.weight": r(VOCAB, D), "model.norm.weight": r(D),
        p + "self_attn.q_proj.weight": r(heads * HD, D), p + "self_attn.q_proj.bias": r(heads * HD),
        p + "self_attn.k_proj.weight": r(kv * HD, D), p + "self_attn.k_proj.bias": r(kv * HD),
        p + "self_attn.v_proj.weight": r(kv * HD, D), p + "self_attn.v_proj.bias": r(kv * HD),
        p + "self_attn.o_proj.weight": r(D, heads * HD), p + "self_attn.q_norm.weight": r(HD),
        p + "mlp.gate_proj.weight": r(INTER, D), p + "mlp.up_proj.weight": r(INTER, D),
        p + "mlp.down_proj.weight": r(D, INTER), p + "input_layernorm.weight": r(D),
    }


def _attention(q, k, v):
    """Causal softmax attention per head; q [T, h, HD], k and v [T, kvh, HD] shared by h / kvh query heads each."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("thd,uhd->htu", q, k) / HD**0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("htu,uhd->thd", s.softmax(-1), v).reshape(T, -1)


def _full(w, x, ids, heads, kv):
    p = "model.layers.0."
    lin = lambda n, y: y @ w[p + n + ".weight"].T + w.get(p + n + ".bias", 0)  # noqa: E731
    q, k, v = (lin(f"self_attn.{c}_proj", x).view(T, -1, HD) for c in "qkv")
    attn = _attention(q, k, v) @ w[p + "self_attn.o_proj.weight"].T
    gate, up = lin("mlp.gate_proj", x), lin("mlp.up_proj", x)
    mlp = lin("mlp.down_proj", torch.nn.functional.silu(gate) * up)
    return attn, mlp, w["model.embed_tokens.weight"][ids], x @ w["lm_head.weight"].T


def _tensor_parallel(ranks, spec, x, ids):
    """The same blocks as vLLM computes them: each rank on its slices, row-parallel outputs summed (the
    all-reduce), vocab-parallel lookups masked and summed, head logits concatenated then cut to the vocab."""
    p = "model.layers.0."
    attn = mlp = emb = 0
    logits = []
    nq, nkv = spec.heads // spec.tp * HD, spec.kv_per_rank * HD
    for r, w in enumerate(ranks):
        qkv = x @ w[p + "self_attn.qkv_proj.weight"].T + w[p + "self_attn.qkv_proj.bias"]
        q, k, v = qkv.split([nq, nkv, nkv], -1)
        heads = _attention(q.view(T, -1, HD), k.view(T, -1, HD), v.view(T, -1, HD))
        attn = attn + heads @ w[p + "self_attn.o_proj.weight"].T
        gate, up = (x @ w[p + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
        mlp = mlp + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        e = w["model.embed_tokens.weight"]
        local = ids - r * e.shape[0]
        mine = (local >= 0) & (local < e.shape[0])
        emb = emb + e[local.clamp(0, e.shape[0] - 1)] * mine[:, None]
        logits.append(x @ w["lm_head.weight"].T)
    return attn, mlp, emb, torch.cat(logits, -1)[:, :VOCAB]


@pytest.mark.parametrize("heads,kv,tp", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 4, 2), (4, 1, 2)])
def test_tensor_parallel_forward_from_rank_slices_equals_the_whole_model(heads, kv, tp):
    """Every rank's slices, run as a tensor-parallel layer (kv heads replicated when tp > kv heads), give the
    whole layer's attention, MLP, embedding and logits (float64, 1e-12); each rank holds 1/tp of each split."""
    w = _layer(heads, kv, seed=heads * 10 + tp)
    spec = TPSpec(tp=tp, heads=heads, kv_heads=kv, head_dim=HD, vocab=VOCAB)
    ranks = [rank_state(w, spec, r) for r in range(tp)]
    g = torch.Generator().manual_seed(1)
    x, ids = torch.randn(T, D, generator=g, dtype=torch.float64), torch.tensor([0, 17, 31, 32, VOCAB - 1])
    for name, a, b in zip(("attention", "mlp", "embedding", "logits"), _full(w, x, ids, heads, kv),
                          _tensor_parallel(ranks, spec, x, ids)):
        err = float((a - b).abs().max())
        assert err <= 1e-12 * max(1.0, float(a.abs().max())), f"tp={tp} {name}: differs by {err:.3g}"
    p = "model.layers.0."
    for r in ranks:
        assert r[p + "mlp.down_proj.weight"].shape == (D, INTER // tp), "down_proj: a 1/tp column block"
        assert r[p + "self_attn.o_proj.weight"].shape == (D, heads * HD // tp), "o_proj: a 1/tp column block"
        assert r["model.embed_tokens.weight"].shape[0] == 64 // tp, "vocab padded to 64, 1/tp of it per rank"
        assert torch.equal(r[p + "self_attn.q_norm.weight"], w[p + "self_attn.q_norm.weight"]), "norms whole"
        assert not any(k.endswith(("q_proj.weight", "gate_proj.weight")) for k in r), "q/k/v and gate/up fused"


def test_kv_heads_replicated_past_their_count_follow_vllm_shard_rank():
    """4 heads, 2 kv heads, tp 4 (vLLM: num_kv_head_replicas = 2, shard rank = rank // 2): rank 3 holds q head
    3 and kv head 1; rank 0's vocab rows are 0-15 and rank 3's are 48-49 then 14 zero rows."""
    w = _layer(4, 2, seed=0)
    spec = TPSpec(tp=4, heads=4, kv_heads=2, head_dim=HD, vocab=VOCAB)
    r3 = rank_state(w, spec, 3)
    qkv = r3["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[:HD], w["model.layers.0.self_attn.q_proj.weight"][3 * HD:4 * HD]), "q head 3"
    assert torch.equal(qkv[HD:2 * HD], w["model.layers.0.self_attn.k_proj.weight"][HD:2 * HD]), "kv head 1's k"
    assert torch.equal(qkv[2 * HD:], w["model.layers.0.self_attn.v_proj.weight"][HD:2 * HD]), "kv head 1's v"
    e = r3["model.embed_tokens.weight"]
    assert torch.equal(e[:2], w["model.embed_tokens.weight"][48:50]) and not e[2:].any(), "rows 48-49, then zeros"
    assert torch.equal(rank_state(w, spec, 0)["model.embed_tokens.weight"], w["model.embed_tokens.weight"][:16])


def test_impossible_splits_are_refused_with_one_line():
    """Heads that tp does not divide, or a row-parallel bias, name what does not split."""
    with pytest.raises(ValueError, match="6 attention heads"):
        TPSpec(tp=4, heads=6, kv_heads=2, head_dim=HD, vocab=VOCAB)
    w = _layer(4, 2, seed=0) | {"model.layers.0.self_attn.o_proj.bias": torch.zeros(D)}
    with pytest.raises(ValueError, match="o_proj.bias"):
        rank_state(w, TPSpec(tp=2, heads=4, kv_heads=2, head_dim=HD, vocab=VOCAB), 0)
