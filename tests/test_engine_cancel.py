"""Cancelling an engine request in flight (a request that moves to another engine) on the torch engine."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from gyre.real import task as T  # noqa: E402
from gyre.real.engine_torch import TorchEngine  # noqa: E402
from gyre.real.nn.model import TinyLlamaConfig  # noqa: E402
from gyre.real.trainer import Trainer, TrainerConfig  # noqa: E402


def test_a_cancelled_request_returns_cancelled_and_its_batch_mates_are_unchanged():
    """Cancel one of two decoding sequences mid-way: it returns {"cancelled": True} with nothing generated, the other
    gets exactly the tokens it gets alone, and the engine then serves the cancelled sequence afresh."""
    cfg = TinyLlamaConfig(vocab_size=T.VOCAB_SIZE)
    weights = Trainer(cfg, TrainerConfig(), seed=0).weights()
    ctx = [[T.BOS, T.digit(1), T.SEP], [T.BOS, T.digit(2), T.SEP, T.DIGIT0]]

    async def run(cancel: bool):
        eng = TorchEngine(cfg)
        await eng.wake(weights, 0)
        a = asyncio.create_task(eng.generate("a", ctx[0], 40, [], 7))
        b = asyncio.create_task(eng.generate("b", ctx[1], 40, [], 8))
        for _ in range(5):
            await asyncio.sleep(0)  # a few decode steps
        ok = await eng.cancel("a") if cancel else None
        ra, rb = await a, await b
        again = await eng.generate("a", ctx[0], 4, [], 9) if cancel else None
        return ok, ra, rb, again, await eng.cancel("zzz")

    ok, ra, rb, again, none = asyncio.run(run(True))
    _, _, alone, _, _ = asyncio.run(run(False))
    assert ok is True and ra["cancelled"] and ra["tokens"] == [], f"not cancelled: {ok} {ra}"
    assert rb["tokens"] == alone["tokens"], "the batch mate's tokens changed"
    assert max(abs(x - y) for x, y in zip(rb["logprobs"], alone["logprobs"])) < 1e-4, "its log-probs changed"
    assert len(again["tokens"]) == 4 and not again.get("cancelled"), f"the sequence is not served again: {again}"
    assert none is False, "cancelling an unknown sequence must say False"
