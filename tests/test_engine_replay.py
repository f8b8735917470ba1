"""The vLLM-scheduler replay: exact timelines by hand, KV never over capacity, exact time scaling."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.sim.vllm_check.vllm_scheduler import SchedulerArgs, replay


def unit(*_):
    return 1.0


def test_chunked_prefill_then_decode_timeline():
    """A 5-token prompt with a 4-token budget: chunks of 4 and 1, first token at the end of step 2, then one
    token a step; a second request arriving mid-way joins the running batch at the next step."""
    args = SchedulerArgs(max_num_seqs=8, max_num_batched_tokens=4, block_size=4, kv_blocks=100)
    res = replay(np.array([0.0, 1.5]), np.array([5, 2]), np.array([3, 2]), args, unit)
    # steps: [0,1) A chunk 4; [1,2) A chunk 1 -> A tok1 at 2; [2,3) A decode + B prefill 2 -> A tok2, B tok1 at 3;
    # [3,4) A decode + B decode -> A tok3 (done), B tok2 (done) at 4
    assert res.scheduled.tolist() == [0.0, 2.0], res.scheduled
    assert res.first_token.tolist() == [2.0, 3.0], res.first_token
    assert res.last_token.tolist() == [4.0, 4.0], res.last_token
    assert res.steps == 4 and res.preemptions == 0


def test_budget_shared_by_decodes_and_fcfs_prefills():
    """Decodes take their token first; the rest of the budget goes to waiting prompts in arrival order."""
    args = SchedulerArgs(max_num_seqs=8, max_num_batched_tokens=3, block_size=16, kv_blocks=100)
    res = replay(np.array([0.0, 0.0, 0.0]), np.array([1, 2, 2]), np.array([3, 1, 1]), args, unit)
    # [0,1): A 1 + B 2 -> A tok1, B tok1 (B done); [1,2): A decode + C 2 -> A tok2, C done; [2,3): A tok3
    assert res.first_token.tolist() == [1.0, 1.0, 2.0], res.first_token
    assert res.last_token.tolist() == [3.0, 1.0, 2.0], res.last_token


def test_max_num_seqs_holds_the_queue():
    """With one slot, the second request starts only when the first is done."""
    args = SchedulerArgs(max_num_seqs=1, max_num_batched_tokens=64, block_size=16, kv_blocks=100)
    res = replay(np.array([0.0, 0.0]), np.array([4, 4]), np.array([2, 2]), args, unit)
    assert res.last_token.tolist() == [2.0, 4.0], res.last_token
    assert res.scheduled.tolist() == [0.0, 2.0], res.scheduled


def test_preemption_by_recompute_timeline():
    """Two requests outgrow 3 blocks of 2 tokens: the later one is preempted, re-prefills its prompt and
    generated tokens after the first finishes."""
    args = SchedulerArgs(max_num_seqs=8, max_num_batched_tokens=16, block_size=2, kv_blocks=3)
    res = replay(np.array([0.0, 0.0]), np.array([2, 2]), np.array([3, 2]), args, unit)
    # [0,1): A 2 tok (1 blk), B 2 tok (1 blk) -> both tok1 at 1 (A, B: 3 known tokens each)
    # [1,2): A decode needs blk 2 (free 1 -> 0); B decode needs a block: none -> B preempted (frees 1)
    #        -> A tok2 at 2; B waits with 3 known tokens, needs 2 blocks, 1 free after... A holds 2
    # [2,3): A decode: 4 tokens computed+1 -> needs blk 3 (free 1 -> 0); B needs 2 blocks: waits -> A tok3 done at 3
    # [3,4): B re-prefills 3 tokens -> tok2 at 4, done
    assert res.first_token.tolist() == [1.0, 1.0], res.first_token
    assert res.last_token.tolist() == [3.0, 4.0], res.last_token
    assert res.preemptions == 1


requests = st.lists(st.tuples(st.floats(0, 20), st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=25)


@given(requests, st.integers(1, 6), st.integers(1, 48), st.sampled_from([1, 2, 4]), st.integers(0, 40),
       st.integers(1, 2))
def test_replay_invariants(reqs, seqs, budget, bs, extra_blocks, reps):
    """Every request finishes after it arrives and is scheduled; KV read by a step never exceeds a replica's
    blocks; a step never exceeds the token budget; each request takes at least prefill chunks plus decodes."""
    reqs.sort()
    arr = np.array([r[0] for r in reqs])
    prompt = np.array([r[1] for r in reqs])
    out = np.array([r[2] for r in reqs])
    need = max(-(-(p + o) // bs) for p, o in zip(prompt, out))
    args = SchedulerArgs(max_num_seqs=seqs, max_num_batched_tokens=budget, block_size=bs, kv_blocks=need + extra_blocks)
    seen = []

    def step(n, ctx, m, p):
        seen.append((n + m, ctx + p))
        return 0.5

    res = replay(arr, prompt, out, args, step, replicas=reps)
    assert all(0 < t <= budget and kv <= args.kv_blocks * bs + 1e-6 for t, kv in seen), "a step over budget/KV"
    assert (res.scheduled >= arr - 1e-12).all() and (res.first_token > res.scheduled).all()
    assert (res.last_token >= res.first_token).all()
    floor = 0.5 * (np.ceil(prompt / budget) + out - 1)
    assert (res.last_token - arr >= floor - 1e-9).all(), "faster than its own prefill chunks and decodes"


@given(requests, st.floats(0.05, 20.0))
def test_time_scales_exactly(reqs, k):
    """Scaling arrivals and step time by k scales every timestamp by k (no hidden clock constant)."""
    reqs.sort()
    arr = np.array([r[0] for r in reqs])
    prompt = np.array([r[1] for r in reqs])
    out = np.array([r[2] for r in reqs])
    args = SchedulerArgs(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, kv_blocks=64)

    def step(n, ctx, m, p):
        return 0.01 + 0.001 * (n + m) + 1e-5 * (ctx + p)

    a = replay(arr, prompt, out, args, step)
    b = replay(arr * k, prompt, out, args, lambda *x: k * step(*x))
    np.testing.assert_allclose(b.last_token, k * a.last_token, rtol=1e-9)
    np.testing.assert_allclose(b.first_token, k * a.first_token, rtol=1e-9)


def test_several_chunks_keep_kv_read_and_attention_exact():
    """Two prompts chunked in one step enter the roofline as one chunk whose KV read (ctx + p) and attention
    term (ctx + m p + m^2 / 2) equal the two chunks' sums: 0 + 0 and 4^2/2 + 4^2/2 = 16 in step 1; in step 2 a
    decode at context 5 and the third prompt whole (6 tokens at offset 0)."""
    args = SchedulerArgs(max_num_seqs=8, max_num_batched_tokens=8, block_size=4, kv_blocks=100)
    calls = []

    def step(n, ctx, m, p):
        calls.append((n, ctx + p, ctx + m * p + 0.5 * m * m, n + m))
        return 1.0

    replay(np.array([0.0, 0.0, 0.0]), np.array([4, 4, 6]), np.array([2, 1, 1]), args, step)
    n, kv, attn, tokens = calls[0]
    assert (n, tokens) == (0, 8) and kv == pytest.approx(0.0) and attn == pytest.approx(16.0), calls[0]
    # step 2: A decodes at context 5 (n = 1, reads 5), C's chunk 6 at offset 0 -> budget 8 - 1 = 7 >= 6
    n, kv, attn, tokens = calls[1]
    assert (n, tokens) == (1, 7) and kv == pytest.approx(5.0) and attn == pytest.approx(5.0 + 18.0), calls[1]
