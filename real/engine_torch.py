"""A small PyTorch inference engine: continuous batching with a KV cache, on a model folder's transformers
causal LM (gyre.real.nn.hf_causal.CausalLM) or on gyre.real.nn's TinyLlama.

What it models: the part of vLLM the scheduler depends on. Requests (token-id context in, sampled
token ids and their log-probs out) join and leave one running decode batch between steps; each
sequence keeps its KV cache between turns, keyed by its sequence id, so a follow-up turn only
prefills the new tokens (tool output). A context that does not extend the cached one (a migrated
execution, a retry, a compaction, a restarted engine) is prefilled from scratch. Weights update in
place between decode steps; `sleep` drops weights and caches (a role change), `wake` loads the latest
weights. Weights arrive two ways: a state dict through the Ray object store (`wake(weights, v)`,
`load_weights(weights, v)`), or a broadcast over a standalone group from the trainer worker of record
(`wake(None, v)` then `receive_weights(group, v)`, gyre.real.collective): the buckets arrive in a thread
while decoding goes on, and are loaded between two decode steps.

It runs as an asyncio Ray actor: `generate` awaits its result while one background task runs the
decode loop; weight loads and releases run between steps. Every step's timing is kept as a profile
(prefill seconds per token, decode step seconds vs batch size and KV tokens) for calibration.

Simplifications: prefill is per sequence (not chunked into the batch); sampling at temperature 1 with
a per-request seeded generator; no memory limit here (the backend gates admission on KV tokens).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gyre.real.nn.hf_causal import build_model
from gyre.real.nn.kv_cache import KVCache
from gyre.real.nn.model import TinyLlamaConfig
from gyre.real import collective as C


@dataclass(kw_only=True, frozen=True)
class TorchEngineConfig:
    max_batch: int = 64
    threads: int = 1
    dtype: str = "float32"  # the serving dtype: trainers publish their weights cast to it


def _trim(cache: KVCache) -> KVCache:
    """A batch-1 cache without its invalid (padding) slots."""
    keep = cache.valid[0].nonzero()[:, 0]
    return KVCache(keys=[k[:, :, keep] for k in cache.keys], values=[v[:, :, keep] for v in cache.values],
                   valid=cache.valid[:, keep])


class _Seq:
    __slots__ = ("id", "tokens", "cache", "logits", "out", "logprobs", "max_new", "stop", "gen", "fut", "version")

    def __init__(self, seq_id: str) -> None:
        self.id = seq_id
        self.tokens: list[int] = []  # context held by the cache
        self.cache: KVCache | None = None
        self.logits: torch.Tensor | None = None  # next-token logits after `tokens`
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.max_new = 0
        self.stop: frozenset[int] = frozenset()
        self.gen: torch.Generator | None = None
        self.fut: asyncio.Future | None = None
        self.version = 0


class TorchEngine:
    def __init__(self, model_config: TinyLlamaConfig | str, config: TorchEngineConfig | None = None, seed: int = 0) -> None:
        self.cfg = config or TorchEngineConfig()
        torch.set_num_threads(self.cfg.threads)
        self.model_config = model_config
        self.model: torch.nn.Module | None = None  # TinyLlama or CausalLM (a model folder)
        self.version = -1
        self.seqs: dict[str, _Seq] = {}
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.batch: KVCache | None = None
        self.loop_task: asyncio.Task | None = None
        self.profile = {"prefill": [], "decode": [], "load": []}  # (tokens, s) / (batch, kv, s) / (s,)
        self.comm = C.Comm()  # weight broadcast groups this engine belongs to

    # --- lifecycle and weights ---
    async def wake(self, weights: Mapping | None, version: int) -> float:
        """Build the model; load `weights` if given (None: they follow by `receive_weights`)."""
        t0 = time.perf_counter()
        if self.model is None:
            self.model = build_model(self.model_config, dtype=self.cfg.dtype).eval()
        if weights is not None:
            self._load(weights, version)
        return time.perf_counter() - t0

    def set_model(self, model_config: TinyLlamaConfig | str, config: TorchEngineConfig | None = None) -> None:
        """Serve another model (with `config`, if given) from the next `wake` on (between runs; not EngineActor's)."""
        if self.running or self.waiting:
            raise RuntimeError("set_model: the engine still serves requests")
        self.model_config, self.model, self.seqs, self.batch = model_config, None, {}, None
        if config is not None:
            self.cfg = config
            torch.set_num_threads(config.threads)

    async def sleep(self) -> float:
        t0 = time.perf_counter()
        if self.running or self.waiting:
            raise RuntimeError(f"sleep: engine still serves {len(self.running) + len(self.waiting)} requests")
        self.seqs.clear()
        self.batch = None
        self.model = None
        return time.perf_counter() - t0

    async def load_weights(self, weights: dict, version: int) -> float:
        """In-place weight update; runs between decode steps (the event loop is single-threaded)."""
        if self.model is None:
            raise RuntimeError("load_weights: the engine is asleep")
        t0 = time.perf_counter()
        self._load(weights, version)
        dt = time.perf_counter() - t0
        self.profile["load"].append((dt,))
        return dt

    async def receive_weights(self, group: dict, version: int) -> float:
        """In-place update from a broadcast (rank `group["rank"]` > 0 of the sender's group); returns seconds."""
        t0 = time.perf_counter()
        state = await asyncio.to_thread(self.comm.receive_weights, group)
        if self.model is None:
            raise RuntimeError("receive_weights: the engine is asleep")
        self._load(state, version)
        dt = time.perf_counter() - t0
        self.profile["load"].append((dt,))
        return dt

    def get_weights(self) -> dict:
        """The served weights as a CPU state dict (tests compare them with the trainer's; not EngineActor)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.serving_state().items()}

    def _load(self, weights: Mapping, version: int) -> None:
        self.model.load_serving_state(weights)
        self.version = int(version)

    async def release(self, seq_id: str) -> None:
        s = self.seqs.get(seq_id)
        if s is not None and s.fut is None:
            del self.seqs[seq_id]

    async def cancel(self, seq_id: str) -> bool:
        """Drop the sequence's request in flight (between two decode steps) and its cache; its `generate` returns
        {"cancelled": True, "tokens": [], "logprobs": []} (the request moved to another engine)."""
        s = self.seqs.get(seq_id)
        if s is None or s.fut is None:
            return False
        if s in self.waiting:
            self.waiting.remove(s)
        elif s in self.running:
            i = self.running.index(s)
            keep = [j for j in range(len(self.running)) if j != i]
            self.running = [self.running[j] for j in keep]
            self.batch = self.batch.select(keep) if keep else None
        s.fut.set_result({"cancelled": True, "tokens": [], "logprobs": [], "version": s.version})
        s.fut = None
        del self.seqs[seq_id]
        return True

    def get_profile(self) -> dict:
        """The profile since the last call (then cleared)."""
        out, self.profile = self.profile, {"prefill": [], "decode": [], "load": []}
        return out

    def ping(self) -> int:
        return self.version

    def shutdown(self) -> None:
        """Drop the model and every cache (the engine has no processes of its own)."""
        self.seqs.clear()
        self.waiting, self.running, self.batch, self.model = [], [], None, None

    # --- generation ---
    async def generate(self, seq_id: str, context: list[int], max_new: int, stop: list[int], seed: int) -> dict:
        """Sample up to `max_new` tokens after `context` (stopping after a token in `stop`)."""
        if self.model is None:
            raise RuntimeError("generate: the engine is asleep")
        s = self.seqs.get(seq_id) or _Seq(seq_id)
        if s.fut is not None:
            raise RuntimeError(f"generate: sequence {seq_id} already has a request in flight")
        self.seqs[seq_id] = s
        t0 = time.perf_counter()
        n = len(s.tokens)
        if s.cache is None or n == 0 or context[:n] != s.tokens or len(context) == n:
            s.cache, s.tokens, n = None, [], 0
        new = context[n:]
        ids = torch.tensor([new], dtype=torch.long)
        pos = torch.arange(n, n + len(new))[None]
        if s.cache is None:
            logits, s.cache = self.model.prefill(ids, pos)
        else:
            logits = self.model.extend(ids, pos, s.cache)
        s.tokens = list(context)
        s.logits = logits[0, -1]
        dt_prefill = time.perf_counter() - t0
        self.profile["prefill"].append((len(new), dt_prefill))
        s.out, s.logprobs, s.max_new, s.stop = [], [], max_new, frozenset(stop)
        s.gen = torch.Generator().manual_seed(int(seed))
        s.version = self.version
        s.fut = asyncio.get_running_loop().create_future()
        self.waiting.append(s)
        if self.loop_task is None or self.loop_task.done():
            self.loop_task = asyncio.create_task(self._loop())
        out = await s.fut
        out["prefill_tokens"], out["prefill_s"] = len(new), dt_prefill
        return out

    async def _loop(self) -> None:
        while self.waiting or self.running:
            if self.waiting:
                joins, self.waiting = self.waiting, []
                caches = ([self.batch] if self.batch is not None else []) + [s.cache for s in joins]
                self.batch = KVCache.concat(caches)
                self.running += joins
                for s in joins:
                    s.cache = None
            self._step()
            await asyncio.sleep(0)  # let requests, weight loads and releases in

    def _step(self) -> None:
        t0 = time.perf_counter()
        logits = torch.stack([s.logits for s in self.running]).float()
        logp = torch.log_softmax(logits, dim=-1)
        nxt = []
        for i, s in enumerate(self.running):
            tok = int(torch.multinomial(logp[i].exp(), 1, generator=s.gen))
            s.out.append(tok)
            s.logprobs.append(float(logp[i, tok]))
            s.version = min(s.version, self.version)
            nxt.append(tok)
        lengths = torch.tensor([len(s.tokens) for s in self.running])
        new_logits = self.model.decode_step(torch.tensor(nxt), lengths, self.batch)
        kv = int(self.batch.valid.sum())
        keep = []
        for i, s in enumerate(self.running):
            s.tokens.append(nxt[i])
            s.logits = new_logits[i]
            if nxt[i] in s.stop or len(s.out) >= s.max_new:
                s.cache = _trim(self.batch.select([i]))
                s.fut.set_result({"tokens": s.out, "logprobs": s.logprobs, "version": s.version})
                s.fut = None
            else:
                keep.append(i)
        self.profile["decode"].append((len(self.running), kv, time.perf_counter() - t0))
        if len(keep) < len(self.running):
            self.running = [self.running[i] for i in keep]
            self.batch = self.batch.select(keep) if keep else None
