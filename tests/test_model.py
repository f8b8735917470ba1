"""Tests for the tiny Llama-style decoder: determinism, masks, and the KV-cache decode path."""

import numpy as np
import pytest
import torch

from gyre.real.nn.kv_cache import KVCache
from gyre.real.nn.model import TinyLlamaConfig, TinyLlama

CFG = TinyLlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


def make_model(seed: int = 0, cfg: TinyLlamaConfig = CFG) -> TinyLlama:
    return TinyLlama(cfg, np.random.default_rng(seed), dtype=torch.float64)


def test_same_seed_same_weights():
    """Two models built from the same seed have identical parameters; another seed differs."""
    a, b, c = make_model(1), make_model(1), make_model(2)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), f"{n} differs for the same seed"
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), f"{n} equal for different seeds"


def test_untied_head_has_its_own_weight():
    """An untied config owns a separate output projection."""
    m = TinyLlama(TinyLlamaConfig(vocab_size=20, dim=16, n_heads=2, n_kv_heads=1, ffn_dim=16, tie_embeddings=False),
                  np.random.default_rng(0))
    assert m.head is not None and m.head.weight.shape == (20, 16), "untied head missing"


def test_bad_config_is_one_clear_error():
    """A head count that is not a multiple of the KV heads is rejected naming the field."""
    with pytest.raises(ValueError, match="n_kv_heads"):
        TinyLlamaConfig(n_heads=4, n_kv_heads=3)


def test_default_mask_is_causal():
    """forward without a mask equals forward with an explicit lower-triangular mask."""
    m = make_model()
    ids = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    mask = torch.ones(9, 9, dtype=torch.bool).tril().expand(2, 9, 9)
    assert torch.allclose(m(ids, pos), m(ids, pos, mask), atol=0, rtol=0), "default mask is not causal"


def test_future_tokens_do_not_leak():
    """Changing a later token leaves earlier logits unchanged under the causal mask."""
    m = make_model()
    ids = torch.randint(0, CFG.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(8)[None]
    ids2 = ids.clone()
    ids2[0, 6] = (ids2[0, 6] + 1) % CFG.vocab_size
    a, b = m(ids, pos), m(ids2, pos)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-12), "earlier logits changed"
    assert not torch.allclose(a[:, 6:], b[:, 6:]), "later logits did not change"


def test_incremental_decode_equals_full_forward():
    """Prefill of ragged prompts then several decode steps reproduces each sequence's full-forward logits."""
    m = make_model(3)
    gen = torch.Generator().manual_seed(3)
    lens = [5, 2, 7]
    total = 6  # decode steps
    seqs = [torch.randint(0, CFG.vocab_size, (n + total,), generator=gen) for n in lens]
    width = max(lens)
    ids = torch.zeros(3, width, dtype=torch.long)
    pos = torch.zeros(3, width, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = seqs[b][:n]
        pos[b, :n] = torch.arange(n)
    lengths = torch.tensor(lens)
    logits, cache = m.prefill(ids, pos, lengths)
    got = [[logits[b, n - 1]] for b, n in enumerate(lens)]
    for step in range(total):
        nxt = torch.stack([seqs[b][n + step] for b, n in enumerate(lens)])
        p = torch.tensor([n + step for n in lens])
        out = m.decode_step(nxt, p, cache)
        for b in range(3):
            got[b].append(out[b])
    assert cache.lengths().tolist() == [n + total for n in lens], "cache valid-slot counts are wrong"
    for b, n in enumerate(lens):
        full = m(seqs[b][None], torch.arange(n + total)[None])[0]
        want = full[n - 1 :]
        assert torch.allclose(torch.stack(got[b]), want, atol=1e-10), f"sequence {b} decode != forward"


def test_paused_row_and_cache_select_concat():
    """An inactive row's slot is not attended; select/concat of caches preserves per-sequence logits."""
    m = make_model(4)
    gen = torch.Generator().manual_seed(4)
    s0 = torch.randint(0, CFG.vocab_size, (6,), generator=gen)
    s1 = torch.randint(0, CFG.vocab_size, (4,), generator=gen)
    ids = torch.stack([s0[:3], s1[:3]])
    pos = torch.arange(3).expand(2, 3)
    _, cache = m.prefill(ids, pos)
    # Row 1 is paused for one step: it receives a junk token that must never be attended.
    m.decode_step(torch.stack([s0[3], torch.tensor(7)]), torch.tensor([3, 99]), cache,
                  active=torch.tensor([True, False]))
    c1 = cache.select([1])
    c0 = cache.select([0])
    joined = KVCache.concat([c1, c0])
    out = m.decode_step(torch.stack([s1[3], s0[4]]), torch.tensor([3, 4]), joined)
    want1 = m(s1[None], torch.arange(4)[None])[0, 3]
    want0 = m(s0[:5][None], torch.arange(5)[None])[0, 4]
    assert torch.allclose(out[0], want1, atol=1e-10), "paused row attended its junk slot"
    assert torch.allclose(out[1], want0, atol=1e-10), "concat/select broke a sequence"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_matches_dense_mask():
    """A FlexAttention BlockMask from the same predicate gives the dense-mask logits (when available)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    m = make_model(5)
    t = 12
    ids = torch.randint(0, CFG.vocab_size, (1, t), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(t)[None]

    def causal(b, h, q, k):
        return q >= k

    bm = flex.create_block_mask(causal, B=None, H=None, Q_LEN=t, KV_LEN=t, device="cpu")
    with torch.no_grad():  # FlexAttention has no CPU backward
        dense = m(ids, pos)
        got = m(ids, pos, bm)
    assert torch.allclose(got, dense, atol=1e-10), "flex path disagrees with dense mask"
