"""FSDP2 sharding of a trained model: `torch.distributed.fsdp.fully_shard` per decoder layer, then the root.

What it models: the sharded trainer's memory layout. Each rank keeps 1/N of every parameter, gradient and
AdamW state (fp32 master copy, dim 0 cut as `torch.chunk` cuts it); a layer's full parameters exist only while
it runs (all-gathered, in `param_dtype`), gradients are reduce-scattered in `reduce_dtype` (summed when
`sum_grads`, else averaged). `offload=True` keeps the shards (and so the optimizer state) in host memory
(`CPUOffloadPolicy`), so a GPU holds only the layers in flight: the state a trainer keeps while its GPUs
serve as engines.

Moving between groups (gyre.real.trainer re-shards whenever a step's ranks change): `gather_state` collects
the whole training state (fp32 weights and AdamW state) onto one rank's host; a new group's ranks each
build the whole model from it and `shard_model` keeps their rows, and `shard_state` gives the optimizer its
rows of the whole AdamW state (no communication: every rank holds the same whole state).
`full_state(model)` gathers the serving state dict (one host copy, in the serving dtype), what a sync sends.

Assumes: the default process group is the group of the mesh (torch's DeviceMesh and DTensor read it); every
rank runs the same number of forward and backward passes (each pass all-gathers, each backward
reduce-scatters); the model's parameter order is the same sharded and whole (fully_shard swaps each
parameter for a DTensor in place), so AdamW's per-index state carries over.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


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
        state[i] = {k: _rows_of(v, p) if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.shape == p.shape
                    else v for k, v in entry.items()}
    opt = make_opt(params)
    opt.load_state_dict({"state": state, "param_groups": opt_state["param_groups"]})
    return opt


def _rows_of(full: torch.Tensor, p: DTensor) -> DTensor:
    """This rank's rows of `full` as a DTensor laid out as parameter `p` (dim-0 chunks, as FSDP2 cuts), on the
    device `p`'s shard lives on (the host under CPU offload)."""
    local = p.to_local()
    mine = full.chunk(p.device_mesh.size(), dim=0)
    rank = p.device_mesh.get_local_rank()
    rows = mine[rank] if rank < len(mine) else full[:0]
    if rows.shape != local.shape:
        raise ValueError(f"shard_state: rows {tuple(rows.shape)} of {tuple(full.shape)}, the shard holds "
                         f"{tuple(local.shape)}")
    # a copy: a view would keep the whole tensor alive
    return DTensor.from_local(rows.to(local.device, local.dtype, copy=True), p.device_mesh, p.placements,
                              run_check=False, shape=p.shape, stride=p.stride())


def local_numel(model: torch.nn.Module) -> int:
    """Parameter elements this rank holds (its shards under FSDP, the whole model otherwise)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
