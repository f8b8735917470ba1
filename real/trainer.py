"""The trainer: a PyTorch actor that trains TinyLlama on packed trajectory trees and publishes weights.

What it models: one policy-gradient step per call. The driver sends each group's prefix tree (its
DFS preorder) and per-execution advantages; the trainer packs them with gyre.trajectory.build_packs,
takes the clipped GRPO loss of gyre.trajectory.torch_ops.packed_loss over the packs, and makes
`epochs` AdamW steps: version v -> v + 1. `weights()` returns a CPU state dict; the driver passes its Ray object
reference to every engine, so one copy travels through the object store (on a GPU cluster this is
where a collective broadcast goes). `save`/`load` checkpoint model, optimizer and version.

Simplifications: a single process (data parallel training over the step's GPUs is not modelled on
CPU; the driver accounts the GPUs); `epochs` optimizer steps per batch; gradient norm clipped at 1.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from gyre.nn.model import ModelConfig, TinyLlama
from gyre.trajectory import PackConfig, build_packs
from gyre.trajectory.torch_ops import LossConfig, packed_loss


@dataclass(kw_only=True, frozen=True)
class TrainerConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    max_pack_tokens: int = 512
    normalization: str = "sequence"
    clip: float = 0.2
    grad_clip: float = 1.0
    epochs: int = 2  # optimizer steps per batch (PPO-style; the clipped ratio bounds each move)
    threads: int = 1


class Trainer:
    def __init__(self, model_config: ModelConfig, config: TrainerConfig | None = None, seed: int = 0) -> None:
        self.cfg = config or TrainerConfig()
        torch.set_num_threads(self.cfg.threads)
        self.model_config = model_config
        self.reset(seed)

    def reset(self, seed: int) -> int:
        """Fresh random weights from `seed` (a new run); returns the version (0)."""
        torch.manual_seed(seed)
        self.model = TinyLlama(self.model_config, np.random.default_rng(seed))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.version = 0
        return self.version

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def train(self, batch: list[tuple[object, np.ndarray]]) -> dict:
        """One step on [(preorder of a group's tree, advantages per execution)]; returns stats."""
        t0 = time.perf_counter()
        trees = [t for t, _ in batch]
        advs = [a for _, a in batch]
        packed = build_packs(trees, advs, PackConfig(max_tokens=self.cfg.max_pack_tokens,
                                                      normalization=self.cfg.normalization))
        t_pack = time.perf_counter() - t0
        self.model.train()
        for _ in range(self.cfg.epochs):
            self.opt.zero_grad(set_to_none=True)
            loss = packed_loss(self.model, packed.packs, LossConfig(clip_low=self.cfg.clip, clip_high=self.cfg.clip))
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
            self.opt.step()
        self.version += 1
        return {
            "version": self.version, "loss": float(loss.detach()), "grad_norm": gnorm,
            "tokens": packed.stats.packed_tokens, "unique_tokens": packed.stats.unique_tokens,
            "packs": packed.stats.num_packs, "rows": packed.stats.loss_rows,
            "pack_s": t_pack, "train_s": time.perf_counter() - t0,
        }

    def save(self, path: str) -> str:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "version": self.version,
                    "model_config": asdict(self.model_config)}, tmp)
        os.replace(tmp, p)  # atomic: a crash never leaves a half-written checkpoint
        return str(p)

    def load(self, path: str) -> int:
        state = torch.load(path, weights_only=False)
        if state["model_config"] != asdict(self.model_config):
            raise ValueError(f"checkpoint {path} is for model {state['model_config']}, not {asdict(self.model_config)}")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.version = int(state["version"])
        return self.version

    def ping(self) -> int:
        return self.version
