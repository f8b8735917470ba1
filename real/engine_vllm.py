"""The vLLM engine behind the same protocol as gyre.real.engine_torch.TorchEngine (for GPU clusters).

What it models: one vLLM AsyncLLM engine per Ray actor on its GPUs (tensor parallel = the actor's GPU
count), driven only through vLLM's public Python API:
- generate: token ids in (`{"prompt_token_ids": context}`), sampled token ids and their log-probs out
  (`SamplingParams(logprobs=0, seed=..., stop_token_ids=...)`); automatic prefix caching keeps an
  execution's context across turns, and a migrated context is simply prefilled on its new engine;
- sleep/wake for role changes (`enable_sleep_mode`, `sleep(level=1)` / `wake_up()`);
- weight update in place: `collective_rpc` to a worker extension that calls the model's
  `load_weights` with the trainer's state dict (arrives through the Ray object store).

vllm is imported lazily (inside the actor), so importing gyre.real never needs it.

Simplifications: weights travel as a CPU state dict through the object store, not an NCCL broadcast;
the trainer's parameter names must match the served model's (same architecture); version tags are per
request (a weight update mid-request tags the whole segment with the older version).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(kw_only=True, frozen=True)
class VllmEngineConfig:
    model: str  # a local path or hub name of the served model
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    max_model_len: int = 32768
    dtype: str = "bfloat16"
    enable_prefix_caching: bool = True
    extra: dict = field(default_factory=dict)  # more vllm AsyncEngineArgs fields


class GyreWorkerExtension:
    """Mixed into vLLM's GPU worker (worker_extension_cls): receives weights for an in-place update."""

    def gyre_load_weights(self, state: dict) -> int:
        import torch

        dev = next(self.model_runner.model.parameters()).device
        self.model_runner.model.load_weights(weights=((k, torch.as_tensor(v).to(dev)) for k, v in state.items()))
        return len(state)


class VllmEngine:
    def __init__(self, config: VllmEngineConfig) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.cfg = config
        args = AsyncEngineArgs(
            model=config.model, tensor_parallel_size=config.tensor_parallel_size, dtype=config.dtype,
            gpu_memory_utilization=config.gpu_memory_utilization, max_model_len=config.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching, enable_sleep_mode=True,
            worker_extension_cls=f"{__name__}.GyreWorkerExtension", **config.extra,
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.version = -1
        self.asleep = False
        self.profile = {"prefill": [], "decode": [], "load": []}
        self._n = 0

    async def wake(self, weights: dict | None, version: int) -> float:
        t0 = time.perf_counter()
        if self.asleep:
            await self.engine.wake_up()
            self.asleep = False
        if weights is not None:
            await self.engine.collective_rpc("gyre_load_weights", args=(weights,))
        self.version = int(version)
        return time.perf_counter() - t0

    async def sleep(self) -> float:
        t0 = time.perf_counter()
        await self.engine.reset_prefix_cache()
        await self.engine.sleep(level=1)
        self.asleep = True
        return time.perf_counter() - t0

    async def load_weights(self, weights: dict, version: int) -> float:
        t0 = time.perf_counter()
        await self.engine.collective_rpc("gyre_load_weights", args=(weights,))
        self.version = int(version)
        dt = time.perf_counter() - t0
        self.profile["load"].append((dt,))
        return dt

    async def release(self, seq_id: str) -> None:
        return None  # prefix-cache blocks are freed by vLLM's LRU

    async def generate(self, seq_id: str, context: list[int], max_new: int, stop: list[int], seed: int) -> dict:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_new, temperature=1.0, logprobs=0, seed=int(seed) % (2**31),
                                stop_token_ids=list(stop), include_stop_str_in_output=True)
        self._n += 1
        version, t0, out = self.version, time.perf_counter(), None
        async for out in self.engine.generate({"prompt_token_ids": list(context)}, params, f"{seq_id}-{self._n}"):
            pass
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, comp.logprobs)]
        dt = time.perf_counter() - t0
        cached = getattr(out, "num_cached_tokens", 0) or 0
        self.profile["decode"].append((1, len(context), dt / max(len(tokens), 1)))
        return {"tokens": tokens, "logprobs": logprobs, "version": min(version, self.version),
                "prefill_tokens": len(context) - cached, "prefill_s": 0.0}

    def get_profile(self) -> dict:
        out, self.profile = self.profile, {"prefill": [], "decode": [], "load": []}
        return out

    def ping(self) -> int:
        return self.version
