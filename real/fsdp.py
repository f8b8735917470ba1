"""FSDP2 sharding of a trained model: `torch.distributed.fsdp.fully_shard` per decoder layer, then the root.

What it models: the sharded trainer's memory layout. Each rank keeps 1/N of every parameter, gradient and
AdamW state (fp32 master copy, dim 0 cut as `torch.chunk` cuts it); a layer's full parameters exist only while
it runs (all-gathered, in `param_dtype`), gradients are reduce-scattered in `reduce_dtype` (summed when
`sum_grads`, else averaged). `offload=True` keeps the shards (and so the optimizer state) in host memory
(`CPUOffloadPolicy`), so a GPU holds only the layers in flight: the state a trainer keeps while its GPUs
serve as engines.

Moving between groups (gyre.real.trainer re-shards whenever a step's ranks change): `gather_state` collects
the whole training state (fp32 weights and AdamW state) onto one rank's host, `shard_state` builds the
sharded model and optimizer of a new group from it, each rank slicing its own rows (no communication).
`full_state(model)` gathers the serving state dict (one host copy, in the serving dtype), what a sync sends.

Assumes: the default process group is the group of the mesh (torch's DeviceMesh and DTensor read it); every
rank runs the same number of forward and backward passes (each pass all-gathers, each backward
reduce-scatters); the model's parameter order is the same sharded and whole (fully_shard swaps each
parameter for a DTensor in place), so AdamW's per-index state carries over.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def shard_model(model: torch.nn.Module, mesh, *, param_dtype: torch.dtype | None = None,
                offload: bool = False, sum_grads: bool = False) -> torch.nn.Module:
    """Shard `model` (a gyre CausalLM or TinyLlama) over `mesh` (a 1-D DeviceMesh), layer by layer, in place.
    `sum_grads`: the reduce-scatter sums the ranks' gradients (a plain SUM, which gloo also has) instead of
    averaging them."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    kw: dict = {"mesh": mesh}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    layers = model.model.layers if hasattr(model, "model") else model.layers
    units = [fully_shard(layer, **kw) for layer in layers] + [fully_shard(model, **kw)]
    if sum_grads:  # divide by 1 after a SUM: not NCCL's PREMUL_SUM, which gloo lacks
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    for name in ("hidden_states", "head_logits"):  # the loss calls these, not forward: they unshard the root too
        register_fsdp_forward_method(model, name)
    return model


def whole(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (a collective: every rank of its mesh calls it), else `t` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) serving state on the host, each tensor gathered then cast to `dtype`."""
    state = model.serving_state() if hasattr(model, "serving_state") else model.state_dict()
    out = {}
    for k, v in state.items():
        t = whole(v)
        out[k] = t.detach().to("cpu", dtype or t.dtype)
    return out


def _host(t: torch.Tensor, gathered: bool) -> torch.Tensor:
    """`t` on the host, copied unless it is a fresh gather (a plain tensor may be the model's own)."""
    return t.detach().to("cpu", copy=not gathered)


def gather_state(model: torch.nn.Module, opt: torch.optim.Optimizer, keep: bool) -> dict | None:
    """{"model": state_dict, "opt": optimizer state_dict}, whole and on the host, on the rank with `keep`;
    None on the others. A collective: every rank of the model's mesh calls it (tensor by tensor, so a rank
    that does not keep holds one gathered tensor at a time)."""
    model_sd = {}
    for k, v in model.state_dict().items():
        t = whole(v)
        if keep:
            model_sd[k] = _host(t, isinstance(v, DTensor))
    osd = opt.state_dict()
    opt_state: dict = {}
    for i, entry in osd["state"].items():
        kept = {}
        for k, v in entry.items():
            t = whole(v) if isinstance(v, torch.Tensor) else v
            if keep:
                kept[k] = _host(t, isinstance(v, DTensor)) if isinstance(t, torch.Tensor) else t
        opt_state[i] = kept
    if not keep:
        return None
    return {"model": model_sd, "opt": {"state": opt_state, "param_groups": osd["param_groups"]}}


def shard_state(model: torch.nn.Module, opt_state: dict, make_opt) -> torch.optim.Optimizer:
    """The optimizer (`make_opt(params)`) of `model` (already sharded, built from the whole weights) holding
    this rank's rows of a whole optimizer state dict (`gather_state`'s "opt"): each state tensor is cut as its
    parameter is, locally (every rank holds the same whole state)."""
    params = list(model.parameters())
    state = {}
    for i, entry in opt_state["state"].items():
        p = params[int(i)]
        state[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.shape == p.shape else v
                    for k, v in entry.items()}
    opt = make_opt(params)
    opt.load_state_dict({"state": state, "param_groups": opt_state["param_groups"]})
    return opt


def local_numel(model: torch.nn.Module) -> int:
    """Parameter elements this rank holds (its shards under FSDP, the whole model otherwise)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
