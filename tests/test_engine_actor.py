"""Both inference engines implement the EngineActor contract, method by method."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("torch")

from gyre.real.engine_actor import EngineActor  # noqa: E402

METHODS = ["wake", "sleep", "load_weights", "receive_weights", "release", "cancel", "generate", "get_profile", "ping",
           "shutdown"]


def check_against_contract(cls: type) -> None:
    for name in METHODS:
        want = getattr(EngineActor, name)
        have = getattr(cls, name, None)
        assert have is not None, f"{cls.__name__} lacks {name}"
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(want), \
            f"{cls.__name__}.{name}: async-ness differs from EngineActor"
        assert list(inspect.signature(have).parameters) == list(inspect.signature(want).parameters), \
            f"{cls.__name__}.{name}{inspect.signature(have)} != EngineActor.{name}{inspect.signature(want)}"


def test_contract_lists_every_method():
    """The test's method list is the Protocol's whole surface (a new method cannot go unchecked)."""
    declared = {n for n, v in vars(EngineActor).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert declared == set(METHODS), f"EngineActor declares {sorted(declared)}"


def test_torch_engine_satisfies_engine_actor():
    """TorchEngine has every EngineActor method with the same parameters and async-ness."""
    from gyre.real.nn.model import TinyLlamaConfig
    from gyre.real.engine_torch import TorchEngine

    check_against_contract(TorchEngine)
    eng = TorchEngine(TinyLlamaConfig(vocab_size=16, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1))
    assert isinstance(eng, EngineActor), "a TorchEngine instance is not an EngineActor"


def test_torch_engine_refuses_a_load_while_asleep_and_wakes_with_the_weights_it_is_given():
    """A load that reaches a sleeping engine (stopped while the load was in flight) is refused in words, as
    vLLM's is, and leaves its version; the next wake with weights serves them (the driver counts the load moot)."""
    import asyncio

    from gyre.real.engine_torch import TorchEngine
    from gyre.real.nn.model import TinyLlamaConfig

    eng = TorchEngine(TinyLlamaConfig(vocab_size=16, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1))
    asyncio.run(eng.wake(None, 0))
    weights = {k: v.clone() + 1.0 for k, v in eng.get_weights().items()}
    asyncio.run(eng.sleep())
    with pytest.raises(RuntimeError, match="load_weights: the engine is asleep"):
        asyncio.run(eng.load_weights(weights, 3))
    assert eng.version != 3, "a refused load must not move the served version"
    asyncio.run(eng.wake(weights, 3))
    assert eng.version == 3 and all((eng.get_weights()[k] == w.to(eng.get_weights()[k].dtype)).all()
                                    for k, w in weights.items())


@pytest.mark.vllm
def test_vllm_engine_satisfies_engine_actor():
    """VllmEngine has every EngineActor method with the same parameters and async-ness."""
    pytest.importorskip("vllm")
    from gyre.real.engine_vllm import VllmEngine

    check_against_contract(VllmEngine)


def test_a_wrong_signature_is_caught():
    """The check fails on an engine whose generate takes other parameters."""
    from gyre.real.engine_torch import TorchEngine

    class Bad(TorchEngine):
        async def generate(self, seq_id, context, max_new):  # noqa: D102
            return {}

    with pytest.raises(AssertionError, match="generate"):
        check_against_contract(Bad)
