"""A trainer worker's part in a streaming step (gyre.real.streaming): a rank of a cell that accumulates gradients.

What it models: a cell is a set of trainer workers (one per GPU, data-parallel replicas of the weights being
trained). `cell_begin` readies a worker for the step on version v: gradients zeroed, and, unless it holds v
already, the core's weight snapshot loaded (`snapshot`, fp32, read once per step by the driver: every joiner
reads the same one; the weights stay fixed while gradients accumulate). `micro` trains one micro-step, one
execution's tree (gyre.trajectory.Preorder.of_execution) with its group-relative advantage: each rank of the
cell takes its share of the tree's packs (`shard_packs`) and adds its gradient to `.grad`, no collective. A
leaving satellite hands its accumulated gradient over (`cell_grads`, kept in the object store for the core).
`cell_end` ends the step: the core's first rank adds the gradients of the satellites that left, the ranks of
the core and of the satellites still in the step sum their gradients (one all-reduce over the collective
backend: gloo on CPU, NCCL on GPU), and each core rank divides by the batch's normalization, clips and steps
AdamW: version v + 1, published.

A reduction that fails. The all-reduce sums one flat copy of each rank's accumulated gradient (the left
satellites' are added to the first rank's copy), so a reduction that fails on a worker (a member lost: gloo's
peer closed, or the group's timeout) leaves that worker's `.grad` exactly as the micro-steps left it: the driver
can void the reduction and run it again among the survivors (gyre.real.streaming). A rank whose all-reduce
returned holds every member's contribution, so a core rank that steps has the whole batch's gradient whoever
was lost after. A satellite's gradient stays until its next `cell_begin` (or `train`) zeroes it. The copy is
the flat buffer an all-reduce of the gradients takes anyway (gyre.real.collective.allreduce_sum).

Loss weights. The whole-batch loss weights rows batch-globally (gyre.trajectory.pack: "token": 1 / rows of the
batch; "sequence": 1 / (active executions * rows of the execution)), which a micro-step cannot know before the
batch has finished. A micro-step's pack, alone in its batch, weighs its rows 1 / (its rows); `micro` scales
that to the batch-free part (token: 1 per row; sequence: 1 / rows of the execution) and the core divides the
summed gradient by the batch's remaining factor (token: rows of the batch; sequence: active executions), which
the driver counts from the micro-steps' row counts. The loss is linear in the weights, so the result is the
whole batch's gradient to float summation order.

Simplifications: a streaming step is one optimizer step (gradient accumulation at fixed weights, as the paper
describes it): `TrainerConfig.epochs` and `max_drift` apply to `train` only; replicas only (sharding "dp").
"""

from __future__ import annotations

import ray
import torch

from gyre.real import collective as C
from gyre.trajectory import PackConfig, build_packs


class CellWorker:
    """Mixin of gyre.real.trainer.Trainer (uses its model, opt, cfg, device, dp, version, _backward, _share,
    _publish, _set_state, save)."""

    @ray.method(concurrency_group="sync", num_returns=2)
    def snapshot(self) -> tuple[dict[str, torch.Tensor], int]:
        """(the weights as they are now, fp32 on the host: what a joining cell loads, the core's weight buffer; its
        entries) as two objects: the driver waits on the second only."""
        out = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in self.model.state_dict().items()}
        return out, len(out)

    def cell_begin(self, version: int, weights: dict | None = None) -> int:
        """Join a streaming step training version `version`: load `weights` (the snapshot; None: this worker holds
        them) and zero the gradients. Its optimizer state is left as it is (only the core's counts)."""
        if self.cfg.sharding != "dp":
            raise RuntimeError(f"cell_begin: streaming steps train replicas (sharding 'dp'), not {self.cfg.sharding!r}")
        if weights is not None:
            self.model.load_state_dict(weights)
        self.opt.zero_grad(set_to_none=True)
        self._cell_version = version
        return version

    def micro(self, tree, advantage: float, rank: int = 0, size: int = 1) -> dict:
        """Add this rank's share of one micro-step's gradient (see the module docstring for its scale); returns
        {rows, tokens, loss, mismatch: [sum |log-ratio|, rows]} of this rank's share (rows, tokens: the whole
        micro-step's)."""
        mismatch = torch.zeros(2, device=self.device)
        if tree.size == 0:  # an execution without a branch: nothing to train
            return {"rows": 0, "tokens": 0, "loss": 0.0, "mismatch": [0.0, 0.0]}
        packed = build_packs([tree], [[advantage]], PackConfig(max_tokens=self.cfg.max_pack_tokens,
                                                                normalization=self.cfg.normalization))
        rows = packed.stats.loss_rows
        scale = float(rows) if self.cfg.normalization == "token" else 1.0
        mine = self._share(packed.packs, rank, size)
        loss = self._backward(mine, None, mismatch, accumulate=True, scale=scale) if mine else torch.zeros(1)
        return {"rows": rows, "tokens": packed.stats.packed_tokens, "loss": float(loss),
                "mismatch": [float(mismatch[0]), float(mismatch[1])]}

    @ray.method(num_returns=2)
    def cell_grads(self) -> tuple[dict[str, torch.Tensor], int]:
        """(this worker's accumulated gradient on the host, its entries) as two objects: the driver waits on the
        second only, the first stays in the object store until the core adds it. Gradients are then zeroed."""
        out = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().to("cpu", copy=True)
               for n, p in self.model.named_parameters()}
        self.opt.zero_grad(set_to_none=True)
        return out, len(out)

    def cell_end(self, spec: dict | None, core: bool, divisor: float, save_to: str | None, state: dict | None,
                 *left: dict) -> dict:
        """End the step on this worker (see the module docstring): `spec` the group of the reducing ranks (None:
        a lone worker), `state` the state of record of version v for a core rank that does not hold it (its
        weights are the snapshot's; its optimizer state is loaded), `left` the gradients of the satellites that
        left (given to the core's first rank only)."""
        if state is not None:
            self._set_state(state)
        params = list(self.model.named_parameters())
        # one flat copy is reduced: `.grad` stays the micro-steps' until the reduction has succeeded here
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in params])
        for grads in left:
            flat.add_(torch.cat([grads[n].reshape(-1) for n, _ in params]).to(flat.device))
        if spec is not None:
            C.allreduce_flat(self.dp.group(spec), flat)
        if not core:
            return {}
        flat.div_(divisor)
        for (_, p), part in zip(params, flat.split([p.numel() for _, p in params])):
            p.grad = part.view_as(p)
        gnorm = float(torch.nn.utils.clip_grad_norm_([p for _, p in params], self.cfg.grad_clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.version = self._cell_version + 1
        self._publish()
        if save_to:
            self.save(save_to)
        return {"version": self.version, "grad_norm": gnorm}
