"""The roofline's communication terms: what the collectives of one engine step cost on the links.

Tensor parallelism runs two ring all-reduces of the step's activations per layer; their bus bandwidth is
`ring_bytes_s` (the GPU-to-GPU link inside a node; across nodes NCCL's one ring per rail on multi-rail
nodes). Expert parallel (vLLM's enable_expert_parallel over the data-parallel replicas' `ep_gpus` GPUs) adds
two collectives per MoE layer, dispatch and combine, moving `ep_comm_bytes` by the chosen backend; `ep_costs`
turns them into the per-step and per-token seconds gyre.roofline.EngineRoofline adds to every step, and
`ep_group_step_time` steps the replicas in lockstep, each with its own batch (the replay of a real run).

Assumptions: bf16 activations, uniform expert routing, every layer an MoE layer; the latencies and link
efficiency are gyre.roofline.Coefficients'. Pure (no simulator imports); the roofline is passed in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyre.roofline import EngineRoofline


def ring_bytes_s(link_bytes_s: float, nic_bytes_s: float, gpus_per_node: int, across_nodes: bool) -> float:
    """Bus bandwidth B (bytes/s) of a ring all-reduce, whose time is 2 (g - 1) / g x bytes / B.

    Inside a node B is the GPU-to-GPU link. Across nodes NCCL runs one ring per rail on multi-rail nodes
    (one NIC per GPU, as DGX H100/H200 nodes have): each of a node's G rings carries 1/G of the data and
    leaves the node through its own NIC, so a GPU sends G - 1 rings' share over its in-node link and one
    ring's share over its NIC: B = min(link x G / (G - 1), G x NIC). 0: no link figure (no bytes charged)."""
    if link_bytes_s <= 0:
        return 0.0
    if not across_nodes:
        return link_bytes_s
    if nic_bytes_s <= 0:
        return 0.0
    g = gpus_per_node
    in_node = link_bytes_s * g / (g - 1) if g > 1 else float("inf")
    return min(in_node, g * nic_bytes_s)


def ep_comm_bytes(tokens: float, hidden: int, ep_gpus: int, top_k: int, backend: str) -> float:
    """Bytes one GPU moves over its link in one MoE layer under expert parallel, for `tokens` tokens of the
    whole EP group (bf16 activations, d = hidden, G = ep_gpus, uniform routing):

    - "allgather_reducescatter" (vLLM's default all2all backend, vLLM docs "Expert Parallel Deployment"):
      every GPU gathers all tokens' activations and reduce-scatters its experts' outputs back, two ring
      collectives: 2 (G - 1) / G x tokens x d x 2 B;
    - "all_to_all" (DeepEP / pplx kernels: a token goes once to each rank holding one of its top-k experts,
      DeepEP's dispatch and combine): a GPU sends its tokens / G tokens to the (G - 1)(1 - (1 - 1/G)^k)
      other ranks expected to hold one of their k experts, and takes the same back:
      2 x tokens / G x (G - 1)(1 - (1 - 1/G)^k) x d x 2 B."""
    g = ep_gpus
    if g <= 1 or tokens <= 0:
        return 0.0
    if backend == "allgather_reducescatter":
        return 2.0 * (g - 1) / g * tokens * hidden * 2.0
    if backend == "all_to_all":
        remote = (g - 1) * (1.0 - (1.0 - 1.0 / g) ** top_k)
        return 2.0 * tokens / g * remote * hidden * 2.0
    raise ValueError(f"ep_backend must be 'allgather_reducescatter' or 'all_to_all', got {backend!r}")


def ep_costs(r: EngineRoofline) -> tuple[float, float]:
    """(seconds per step, seconds per token of the EP group) of expert parallel's per-layer exchanges: two
    collectives per MoE layer (dispatch and combine), each at the all-reduce latency, and ep_comm_bytes over
    the link (a ring's bus bandwidth for the gather / scatter pair, the NIC across nodes for all-to-all).
    Every layer is taken as an MoE layer."""
    c = r.coef
    across = r.ep_gpus > r.gpus_per_node
    if r.ep_backend == "allgather_reducescatter":
        link = ring_bytes_s(r.link_bytes_s, r.internode_bytes_s, r.gpus_per_node, across)
    else:
        link = r.internode_bytes_s if across else r.link_bytes_s
    fixed = 2 * r.layers * (c.allreduce_internode_s if across else c.allreduce_s)
    per_token = ep_comm_bytes(1.0, r.hidden, r.ep_gpus, r.top_k, r.ep_backend)
    return fixed, (r.layers * per_token / (link * c.eff_link) if link > 0 else 0.0)


def ep_group_step_time(r: EngineRoofline, batches: list[tuple[int, float, float, float]]) -> float:
    """Seconds of one lockstep step of the expert-parallel replicas (vLLM runs DP ranks of an MoE together:
    each MoE layer waits for every rank's tokens): the slowest replica's step, each replica reading its
    experts for, computing its share of, and exchanging the tokens of all `batches` (n, ctx, m, p)."""
    group = float(sum(n + m for n, _, m, _ in batches))
    step = r.stepper()
    return max((step(n, ctx, m, p, group)[0] for n, ctx, m, p in batches if n + m > 0), default=0.0)
