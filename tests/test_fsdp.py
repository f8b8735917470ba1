"""FSDP2 (fully_shard) runs on the CPU build of torch with gloo: a 2-process sharded step equals one process's."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch():
    sys.path.insert(0, str(Path(__file__).parent))
    from test_hf_loss import batch

    from gyre.trajectory import PackConfig, build_packs

    trees, advs = batch(5, 4)
    return build_packs(trees, advs, PackConfig(max_tokens=256)).packs


def _rank(rank: int, world: int, port: int, folder: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gyre.real.nn.hf_causal import build_model
    from gyre.real.fsdp import full_state, shard_model
    from gyre.trajectory.torch_ops import LossConfig, concat_packs, micro_batch_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = shard_model(build_model(folder), init_device_mesh("cpu", (world,)))
    packs = _batch()
    # this rank's half of the packs, one micro-batch, as the trainer runs it
    micro_batch_loss(model, concat_packs(packs[rank::world]), LossConfig()).backward()
    local = {n: p.grad.to_local().shape for n, p in model.named_parameters()}
    grads = {n: p.grad.full_tensor() * world for n, p in model.named_parameters()}  # reduce-scatter averages
    state = full_state(model, torch.bfloat16)
    if rank == 0:
        torch.save({"grads": grads, "local": local, "state": state}, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_fsdp2_step_equals_one_process(tmp_path):
    """Two gloo ranks, each with half the packs and half of every parameter: the gathered gradient equals the
    single-process gradient of all packs (fp32, 1e-5); each rank holds half the rows; full_state gathers all."""
    import torch.multiprocessing as mp

    from gyre.real.nn.hf_causal import build_model
    from gyre.real.nn.hf_folder import write_tiny_model
    from gyre.trajectory.torch_ops import packed_loss

    folder = str(write_tiny_model(tmp_path / "q3", "qwen3", vocab_size=24, seed=4))
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_rank, args=(2, _free_port(), folder, out), nprocs=2, start_method="spawn")
    got = torch.load(out)
    ref = build_model(folder)
    packed_loss(ref, _batch()).backward()
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    for n, p in ref.named_parameters():
        err = float((got["grads"][n] - p.grad).abs().max())
        assert err <= 1e-5 * scale, f"{n}: sharded gradient differs by {err:.3g} (largest {scale:.3g})"
        assert got["local"][n][0] == (p.shape[0] + 1) // 2, f"{n}: rank 0 holds {got['local'][n]} of {p.shape}"
    assert set(got["state"]) == set(ref.serving_state()), "full_state gathers every serving tensor"
    assert all(t.dtype == torch.bfloat16 for t in got["state"].values()), "in the serving dtype"
