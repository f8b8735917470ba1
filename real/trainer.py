"""The trainer: PyTorch workers, data-parallel replicas or FSDP2 shards, that train on packed trajectory trees.

What it models: one policy-gradient step per call. The driver sends each group's prefix tree (its DFS
preorder) and per-execution advantages; every worker of the step packs the whole batch with
gyre.trajectory.build_packs (deterministic) and takes its shard of the packs (`shard_packs`: largest first
onto the least-loaded rank). Pack loss weights are batch-global, so the batch loss is the sum of the
shards' losses: each rank backpropagates its shard, the gradients (and the loss) are summed over the
step's group (gyre.real.collective), the norm is clipped and AdamW steps, `epochs` times: version v -> v + 1.
Rank 0 is the worker of record (it snapshots the weights it publishes and writes the checkpoint). A worker
that missed steps catches up from the worker of record (`get_state` -> `train(state=...)`) before it trains
again. A run starts from random weights (`reset(seed)`), a model folder's, or a Llama model directory's
(`init_checkpoint`), e.g. the one a vLLM engine serves, so trainer and engines agree at version 0.

`TrainerConfig.sharding`: "dp" keeps the ranks identical replicas (one all-reduce of the gradients). "fsdp"
shards parameters, gradients and AdamW state over the step's ranks (gyre.real.fsdp: reduce-scattered
gradients, summed; on CUDA the shards live in host memory, so the GPUs hold only layers in flight and are
free to serve between steps). A step's ranks change whenever the policy re-places the trainer, so the
worker keeps its shards only while the next step has the same group; at the end of every sharded step
rank 0 gathers the whole state (fp32 weights and AdamW state) to its host, and a step on other ranks
re-shards from it (`_place`: the process's default group re-formed, each rank slicing its rows). Every rank
of a sharded step runs as many micro-batches as the busiest (each pass is a collective).

Weights leave a worker two ways (`RealClusterConfig.weight_sync`): `weights(version)` returns the CPU
snapshot of a published version for the Ray object store, or `send_weights(spec, version)` broadcasts it to
engines over a standalone group. Both run in the "sync" concurrency group and read snapshots, so they never
wait for, nor see half of, a step running meanwhile. `save`/`load` checkpoint model, optimizer and version,
read back as data only (gyre.real.checkpoint).

Simplifications: no tensor or pipeline parallelism; under fsdp bf16 is autocast over all-gathered fp32
parameters (no bf16 all-gather) and rank 0 gathers the optimizer state every step, not only when the
ranks change; `epochs` optimizer steps per batch; gradient norm clipped at 1; the last 2 published
versions are kept.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import ray
import torch
from torch.distributed.device_mesh import init_device_mesh

from gyre.backend import share_of
from gyre.real.nn.hf_causal import build_model, model_identity
from gyre.real.nn.hf_llama import config_mismatch, load_hf_llama
from gyre.real.nn.model import TinyLlamaConfig
from gyre.real import collective as C
from gyre.real.cell_worker import CellWorker
from gyre.real.checkpoint import CheckpointError, read_checkpoint  # noqa: F401 (CheckpointError: re-exported)
from gyre.real.component_config import TrainerConfig
from gyre.real.fsdp import gather_state, local_numel, shard_model, shard_state, whole
from gyre.trajectory import PackConfig, build_packs
from gyre.trajectory.torch_ops import LossConfig, concat_packs, micro_batch_loss, micro_batches

# published versions kept: the latest, and the one before it for a sync the driver asked for just before the
# latest step ended (its request can arrive after the new version is published)
KEEP_PUBLISHED = 2
ModelSource = TinyLlamaConfig | str  # gyre's TinyLlama (random init) or a model folder (gyre.real.nn.hf_folder)


def shard_packs(sizes: list[int], n: int) -> list[list[int]]:
    """Pack indices per rank: largest first onto the least-loaded rank (ties: lower index), each in order."""
    load = [0] * n
    out: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += sizes[i]
    return [sorted(s) for s in out]


class Trainer(CellWorker):
    def __init__(self, model_config: ModelSource, config: TrainerConfig | None = None, seed: int = 0,
                 init_checkpoint: str = "", serve_dtype: str = "float32") -> None:
        self.cfg = config or TrainerConfig()
        self.init_checkpoint = init_checkpoint  # a Llama model directory: every reset starts from its weights
        torch.set_num_threads(self.cfg.threads)
        self.model_config = model_config
        self.serve_dtype = getattr(torch, serve_dtype)  # what engines serve: published snapshots are cast to it
        self.device = torch.device(self.cfg.device)
        self.dp = C.Comm()  # gradient all-reduce groups (the step's thread)
        self.sync = C.Comm()  # weight broadcast groups (the "sync" threads)
        self.reset(seed)

    # --- state ---
    def reset(self, seed: int) -> int:
        """Fresh weights for a new run: a model folder's, or drawn from `seed` (TinyLlama), or `init_checkpoint`'s
        (cast to fp32); returns the version (0)."""
        torch.manual_seed(seed)
        self.seed = seed  # with the version, seeds role-bounded path sampling (the same draw on every rank)
        model = self._new_model(seed)
        if self.init_checkpoint:
            cfg, state = load_hf_llama(self.init_checkpoint)
            bad = config_mismatch(self.model_config, cfg)
            if bad:
                raise ValueError(f"init_checkpoint {self.init_checkpoint}: the trainer's model has {bad}")
            model.load_state_dict(state)
        self.model = model.to(self.device)
        self.opt = self._new_opt(self.model.parameters())
        self._group, self._full = None, None  # fsdp: see _place
        self.version = 0
        self._published: dict[int, dict[str, torch.Tensor]] = {}
        self._publish()
        return self.version

    def _new_model(self, seed: int = 0) -> torch.nn.Module:
        return build_model(self.model_config, seed=seed, attn="flex_attention" if self.cfg.attention == "flex"
                           else "sdpa", grad_checkpointing=self.cfg.grad_checkpointing)

    def _new_opt(self, params) -> torch.optim.Optimizer:
        """AdamW; fused on CUDA, where the default (foreach) step makes a full-size temporary of the parameters
        (+4 bytes per parameter at the step's peak, measured on an H200: docs/calibrate-training.md) and the fused
        kernel does not, so the trainer holds the 16 bytes per parameter the simulator's memory minimum counts."""
        params = list(params)  # (host-offloaded shards keep the default step)
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
        return torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, fused=fused)

    def set_model(self, model: ModelSource, init_checkpoint: str = "", config: TrainerConfig | None = None,
                  serve_dtype: str | None = None) -> int:
        """The model later `reset`s build (and the Llama directory TinyLlama starts from, "": random weights), with
        `config` and `serve_dtype` if given; builds it now (version 0) so its layout is known."""
        self.model_config, self.init_checkpoint = model, init_checkpoint
        if config is not None:
            self.cfg = config
            self.device = torch.device(config.device)
            torch.set_num_threads(config.threads)
        if serve_dtype is not None:
            self.serve_dtype = getattr(torch, serve_dtype)
        return self.reset(0)

    def _publish(self) -> None:
        """Snapshot this version in the serving dtype (a sharded rank without the whole state publishes none)."""
        serving = self.model.serving_state()
        if self._group is not None:
            if self._full is None:
                return
            serving = {k: self._full["model"][k] for k in serving}
        self._published[self.version] = {k: v.detach().to("cpu", self.serve_dtype, copy=True)
                                         for k, v in serving.items()}
        for v in sorted(self._published)[:-KEEP_PUBLISHED]:
            del self._published[v]

    def get_state(self) -> list:
        """[object ref of model + optimizer state and version]: what a worker that missed steps loads."""
        return [ray.put({**self._whole(), "version": self.version})]

    def _whole(self) -> dict:
        """{"model", "opt"}: the whole training state (a replica's own, or the gathered state of a sharded rank 0)."""
        if self._group is None:
            return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}
        if self._full is None:
            raise RuntimeError(f"trainer: this worker holds only its shard of group {self._group}, not the whole "
                               f"state (ask the worker of record)")
        return self._full

    def _set_state(self, state: dict) -> None:
        if self._group is not None:  # sharded: back to a whole model to load into
            self.model, self._group, self._full = self._new_model().to(self.device), None, None
            self.opt = self._new_opt(self.model.parameters())
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.version = int(state["version"])
        self._publish()

    def _place(self, dp: dict | None) -> None:
        """fsdp: make the model the step's layout: sharded over the step's group (`dp`, size > 1), else whole.
        The same group as the last step keeps its shards; any other re-shards from the whole state this worker
        holds (its own, the gathered state it keeps as rank 0, or the state of record it was sent)."""
        name = dp["name"] if dp is not None and dp["size"] > 1 else None
        if name == self._group:  # the same shards, or a whole model again
            return
        state = self._whole()
        model = self._new_model()
        model.load_state_dict(state["model"])
        if name is None:
            self.model = model.to(self.device)
            self.opt = self._new_opt(self.model.parameters())
            self.opt.load_state_dict(state["opt"])
        else:  # built on the host: fully_shard moves one layer at a time to the device and keeps its rows
            self._fsdp_pg = self.dp.default_group(dp)
            mesh = init_device_mesh(self.device.type, (dp["size"],))
            model = shard_model(model, mesh, offload=self.cfg.offload and self.device.type == "cuda", sum_grads=True)
            self.model, self.opt = model, shard_state(model, state["opt"], self._new_opt)
        self._group, self._full = name, None

    def layout(self) -> C.Layout:
        return C.layout_of(self._published[self.version])

    def serve_store(self, timeout_s: float, local: bool) -> tuple[str, int]:
        return C.serve_store(timeout_s, local)

    def ping(self) -> int:
        return self.version

    def gpu_ids(self) -> list[str]:
        """The devices Ray gave this worker (node-local ids)."""
        return [str(i) for i in ray.get_gpu_ids()]

    # --- training ---
    def train(self, batch: list[tuple[object, np.ndarray]], dp: dict | None = None, state: dict | None = None,
              save_to: str | None = None, n_epochs: int | None = None) -> dict:
        """One step on [(preorder of a group's tree, advantages per execution)]; returns stats.

        `dp`: this rank's spec of the step's group (None: the whole batch here); `state`: the state of record
        to load first (this worker missed steps); `save_to`: checkpoint path written after the step; `n_epochs`:
        optimizer steps (None: the config's; 1 replays a streaming step, gyre.real.cell_worker)."""
        t0 = time.perf_counter()
        if state is not None:
            self._set_state(state)
        if self.cfg.sharding == "fsdp":
            self._place(dp)
        packed, packs, pg = self._shard(batch, dp)
        t_pack = time.perf_counter() - t0
        params = list(self.model.parameters())
        mismatch = torch.zeros(2, device=self.device)
        ref, epochs, drift = None, 0, 0.0
        for epoch in range(self.cfg.epochs if n_epochs is None else n_epochs):
            logps: list[torch.Tensor] | None = [] if self.cfg.max_drift > 0 else None
            loss = self._backward(packs, pg, mismatch if epoch == 0 else None, logps,
                                  pad=packed.packs[0] if packed.packs else None)
            if epoch == 0:
                ref = logps
            elif logps is not None:
                drift = self._drift(ref, logps, pg)
                if drift > self.cfg.max_drift:
                    break  # moved far enough: this epoch's gradient is not applied
            gnorm = float(whole(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)))
            if packed.stats.loss_rows == 0:
                break  # nothing to train (every group left training): no optimizer step, the version still moves
            self.opt.step()
            epochs += 1
        self.version += 1
        if self._group is not None:  # sharded: rank 0 (the worker of record) gathers the whole new state
            self._full = gather_state(self.model, self.opt, keep=dp["rank"] == 0)
        self._publish()
        if save_to:
            self.save(save_to)
        return {
            "version": self.version, "loss": float(loss), "grad_norm": gnorm,
            "tokens": packed.stats.packed_tokens, "unique_tokens": packed.stats.unique_tokens,
            "packs": packed.stats.num_packs, "rows": packed.stats.loss_rows, "ranks": dp["size"] if dp else 1,
            "paths": packed.stats.paths, "kept_tokens": packed.stats.kept_tokens,
            # trained over exact (tokens, attention context) of the batch: the cluster's trained_share
            "trained_share": share_of(packed.stats.kept_tokens, packed.stats.kept_attn, packed.stats.exact_tokens,
                                      packed.stats.exact_attn) if self.cfg.sampling.sampled else (1.0, 1.0),
            # mean |log p(version before the step) - log p(sampling engine)| over trained tokens: ~0 on-policy
            "logp_mismatch": float(mismatch[0] / mismatch[1]) if mismatch[1] > 0 else 0.0,
            "epochs": epochs, "drift": drift,  # epochs applied; mean |log p change| at the last check (0: none)
            # fsdp: the group whose shard is all this worker holds (None: it holds the whole state)
            "shard_of": self._group if self._full is None else None, "local_params": local_numel(self.model),
            "pack_s": t_pack, "train_s": time.perf_counter() - t0,
        }

    def gradient(self, batch: list[tuple[object, np.ndarray]], dp: dict | None = None) -> dict[str, torch.Tensor]:
        """The batch's loss gradient at the current weights (summed over the group of `dp`), on CPU; no step."""
        if self.cfg.sharding == "fsdp":
            self._place(dp)
        packed, packs, pg = self._shard(batch, dp)
        self._backward(packs, pg, pad=packed.packs[0] if packed.packs else None)
        return {n: whole(p.grad).detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def _shard(self, batch, dp: dict | None):
        """(the batch's packs, this rank's packs, the step's group or None)."""
        trees = [t for t, _ in batch]
        advs = [a for _, a in batch]
        packed = build_packs(trees, advs, PackConfig(max_tokens=self.cfg.max_pack_tokens,
                                                      normalization=self.cfg.normalization, sampling=self.cfg.sampling),
                             np.random.default_rng([self.seed, self.version]))
        if dp is None or dp["size"] == 1:
            return packed, packed.packs, None
        mine = self._share(packed.packs, dp["rank"], dp["size"])
        return packed, mine, self._fsdp_pg if self._group else self.dp.group(dp)

    @staticmethod
    def _share(packs: list, rank: int, size: int) -> list:
        """The packs rank `rank` of `size` trains (shard_packs)."""
        return [packs[i] for i in shard_packs([p.size for p in packs], size)[rank]]

    def _drift(self, ref: list[torch.Tensor], cur: list[torch.Tensor], pg) -> float:
        """Mean |log p now - log p at the step's start| over the batch's trained tokens (summed over `pg`)."""
        acc = torch.zeros(2, device=self.device)
        if ref:
            diff = torch.cat(ref) - torch.cat(cur)
            acc += torch.stack([diff.abs().sum(), torch.tensor(float(diff.numel()), device=self.device)])
        if pg is not None:
            C.allreduce_sum(pg, [acc])
        return float(acc[0] / acc[1]) if acc[1] > 0 else 0.0

    def _backward(self, packs: list, pg, mismatch: torch.Tensor | None = None, logps: list | None = None,
                  pad=None, accumulate: bool = False, scale: float = 1.0) -> torch.Tensor:
        """Gradient of the packs' loss into .grad, summed over `pg` (the batch's gradient); returns the loss.
        `mismatch` (zeros [2]): set to the batch's (sum |log-ratio to the sampler|, rows) (see pack_rows_loss);
        `logps`: gets this rank's per-pack log-probs of the trained tokens appended. Sharded, every rank runs
        as many micro-batches as the busiest (each pass is a collective): the missing ones are `pad` (any pack)
        with zero weight. `accumulate`: add to .grad instead of replacing it; `scale`: the loss's factor."""
        self.model.train()
        if not accumulate:
            self.opt.zero_grad(set_to_none=True)
        cfg = LossConfig(clip_low=self.cfg.clip, clip_high=self.cfg.clip, logprob_chunk=self.cfg.logprob_chunk)
        loss = torch.zeros(1, device=self.device)
        bf16 = self.cfg.dtype == "bfloat16"
        mbs = [(mb, 1.0) for mb in micro_batches(packs, self.cfg.micro_batch_tokens)]
        if self._group is not None:
            n = torch.tensor([len(mbs)], device=self.device)
            C.allreduce_max(pg, n)
            mbs += [([pad], 0.0)] * (int(n) - len(mbs))
        for mb, weight in mbs:  # gradients accumulate in fp32 .grad
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
                part = micro_batch_loss(self.model, concat_packs(mb), cfg, use_flex=self.cfg.attention == "flex",
                                        device=self.device, mismatch=mismatch if weight else None,
                                        logps=logps if weight else None)
            (part * (weight * scale)).backward()
            loss += weight * scale * part.detach().float()
        for p in self.model.parameters():  # no trained rows here: a zero gradient to sum with the others'
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if pg is not None:  # sum the shards: the batch's gradient (sharded: the reduce-scatter did) and loss
            grads = [] if self._group is not None else [p.grad for p in self.model.parameters()]
            C.allreduce_sum(pg, grads + [loss] + ([mismatch] if mismatch is not None else []))
        return loss

    # --- publishing (the "sync" concurrency group: runs while a step trains) ---
    @ray.method(concurrency_group="sync")
    def weights(self, version: int | None = None) -> dict:
        """The CPU state dict of a published version (default: the latest)."""
        v = self.version if version is None else version
        if v not in self._published:
            raise KeyError(f"weights: version {v} is not among the published {sorted(self._published)}")
        return self._published[v]

    @ray.method(concurrency_group="sync", num_returns=2)
    def publish(self, version: int) -> tuple[dict, int]:
        """(published `version`'s state dict, `version`) as two objects: the driver keeps a reference to the first
        for engines to load (an object it owns, so it outlives this worker) and waits on the second only, so
        the weights never travel into the driver's process."""
        return self.weights(version), version

    @ray.method(concurrency_group="sync")
    def send_weights(self, spec: dict, version: int) -> float:
        """Broadcast published `version` as rank 0 of the group of `spec`; returns seconds."""
        t0 = time.perf_counter()
        with self.sync.turnstile.turn(spec["seq"], spec["timeout_s"]):
            state = self.weights(version)
            pg = self.sync.group(spec)
            C.send(pg, state, spec["layout"], spec["bucket_bytes"], spec["device"])
        return time.perf_counter() - t0

    # --- checkpoints ---
    def save(self, path: str) -> str:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        torch.save({**self._whole(), "version": self.version, "model_config": model_identity(self.model_config)}, tmp)
        os.replace(tmp, p)  # atomic: a crash never leaves a half-written checkpoint
        return str(p)

    def load(self, path: str) -> int:
        """Take model, optimizer and version from a checkpoint `save` wrote (read as data only: read_checkpoint)."""
        self._set_state(read_checkpoint(path, self.model_config, map_location=self.device))
        return self.version
