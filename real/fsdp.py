"""FSDP2 sharding of a trained model: `torch.distributed.fsdp.fully_shard` per decoder layer, then the root.

What it models: the sharded trainer's memory layout. Each rank keeps 1/N of every parameter, gradient and
AdamW state (fp32 master copy); a layer's full parameters exist only while it runs (all-gathered, in
`param_dtype`), gradients are reduce-scattered in `reduce_dtype`. `offload=True` keeps the shards (and so
the optimizer state) in host memory (`CPUOffloadPolicy`), so a GPU holds only the layers in flight: the
state a trainer keeps while its GPUs serve as engines. `full_state(model)` gathers the full state dict
(one host copy, in the serving dtype), what a weight sync sends.

Measured on the CPU build of torch 2.13 with gloo (tests/test_fsdp.py): a 2-process step of a tiny
Qwen3 with the packed loss gives the single-process gradient. Where it is used: benchmarks/bench_gpu.py
runs a bf16 FSDP2 step with offload on CUDA. The Ray trainer (gyre.real.trainer) stays data-parallel:
its ranks change with every step the policy places (elastic moves GPUs between roles), and FSDP2's shards
are tied to one fixed group, so re-sharding per step is not built yet (see docs/real.md).
"""

from __future__ import annotations

import torch


def shard_model(model: torch.nn.Module, mesh, *, param_dtype: torch.dtype | None = None,
                offload: bool = False) -> torch.nn.Module:
    """Shard `model` (a gyre CausalLM or TinyLlama) over `mesh` (a 1-D DeviceMesh), layer by layer, in place."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    kw: dict = {"mesh": mesh}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    layers = model.model.layers if hasattr(model, "model") else model.layers
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    for name in ("hidden_states", "head_logits"):  # the loss calls these, not forward: they unshard the root too
        register_fsdp_forward_method(model, name)
    return model


def full_state(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) serving state on the host, each tensor gathered then cast to `dtype`."""
    state = model.serving_state() if hasattr(model, "serving_state") else model.state_dict()
    out = {}
    for k, v in state.items():
        t = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = t.detach().to("cpu", dtype or t.dtype)
    return out
