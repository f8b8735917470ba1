"""The vLLM engine behind the engine protocol (needs vllm and a CUDA GPU; skipped otherwise)."""

from __future__ import annotations

import asyncio
import os

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]
vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not os.environ.get("GYRE_VLLM_MODEL"), reason="set GYRE_VLLM_MODEL to a small local model")
def test_vllm_engine_generates_token_ids_with_logprobs_and_sleeps():
    """Token ids in, token ids and log-probs out; a follow-up turn hits the prefix cache; sleep/wake work."""
    from gyre.real.engine_vllm import VllmEngine, VllmEngineConfig

    eng = VllmEngine(VllmEngineConfig(model=os.environ["GYRE_VLLM_MODEL"], max_model_len=2048,
                                      gpu_memory_utilization=0.5))

    async def go():
        await eng.wake(None, 0)
        ctx = list(range(100, 140))
        r1 = await eng.generate("a", ctx, 8, [], 1)
        r2 = await eng.generate("a", ctx + r1["tokens"] + [200, 201], 8, [], 2)
        await eng.sleep()
        await eng.wake(None, 1)
        r3 = await eng.generate("b", ctx, 8, [], 1)
        return r1, r2, r3

    r1, r2, r3 = asyncio.run(go())
    assert len(r1["tokens"]) == 8 and len(r1["logprobs"]) == 8, f"generated {r1}"
    assert all(lp <= 0 for lp in r1["logprobs"]), "log-probs must be <= 0"
    assert r2["prefill_tokens"] < 40, f"follow-up turn re-prefilled {r2['prefill_tokens']} tokens"
    assert r3["version"] == 1, "wake sets the served version"
