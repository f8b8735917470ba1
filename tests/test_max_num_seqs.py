"""vLLM's `max_num_seqs`: an engine runs (prefills or decodes) at most that many executions; the rest
wait in its queue and start, in order, as running ones leave."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.config import ConfigError, override
from gyre.datasheets import GpuConfig
from gyre.hardware import CostConfig, derive_costs, vllm_default_max_num_seqs
from gyre.policies import REGISTRY, make_policy
from gyre.presets import GPUS, MODELS
from gyre.sim.harness.runner import simulate
from gyre.workload import GroupSpec
from tests.simkit import ROUND_COSTS, cluster, spec, tiny_config


def _timeline(cap: int, gens: list[int]) -> list[tuple]:
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(i, 0, gen=[n]) for i, n in enumerate(gens)])
    c = cluster([g], n_gpus=1, groups_per_step=1, costs=replace(ROUND_COSTS, max_num_seqs=cap))
    c.run(make_policy("colocate"), steps=1)
    return [(r[0], round(r[1], 6), r[2]) for r in c.log if r[0] in ("start", "finish")]


def test_third_execution_waits_for_a_slot():
    """Decoding at 100 tokens/s from t = 3 s, max_num_seqs 2, outputs 100 / 400 / 200 tokens: exec 2 waits
    until exec 0 ends at 4 s, then ends at 6 s; exec 1 ends at 7 s."""
    got = _timeline(2, [100, 400, 200])
    assert got == [("start", 3.0, 0), ("start", 3.0, 1), ("finish", 4.0, 0), ("start", 4.0, 2),
                   ("finish", 6.0, 2), ("finish", 7.0, 1)], got


def test_no_limit_runs_everything_at_once():
    """The same three with max_num_seqs 0 (no limit): all start at 3 s and end after their own outputs."""
    got = _timeline(0, [100, 400, 200])
    assert got == [("start", 3.0, 0), ("start", 3.0, 1), ("start", 3.0, 2), ("finish", 4.0, 0),
                   ("finish", 5.0, 2), ("finish", 7.0, 1)], got


def test_one_slot_serializes_in_arrival_order():
    """max_num_seqs 1: each starts when the previous ends (3 s + cumulative outputs / 100 tokens/s)."""
    got = _timeline(1, [100, 400, 200])
    assert got == [("start", 3.0, 0), ("finish", 4.0, 0), ("start", 4.0, 1), ("finish", 8.0, 1),
                   ("start", 8.0, 2), ("finish", 10.0, 2)], got


@pytest.mark.invariants
@settings(deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.integers(1, 4), eta=st.integers(0, 2), name=st.sampled_from(sorted(REGISTRY)))
def test_running_never_exceeds_max_num_seqs(seed, cap, eta, name):
    """Every registered policy on a multi-turn workload of 9 executions per step: after every event each
    engine runs <= max_num_seqs (SimCluster.check_invariants asserts it) and every execution finishes
    exactly once."""
    cfg = override(tiny_config(gpus=8, seed=seed, groups_per_step=3, group_size=3),
                   **{"workload.deadline_s": float("inf"), "cluster.cost.max_num_seqs": cap})
    r = simulate(cfg, name, {} if name == "colocate" else {"eta": eta}, check=True)
    admitted = sorted(rec[2] for rec in r.log if rec[0] == "admit")
    finished = sorted(rec[2] for rec in r.log if rec[0] == "finish")
    assert admitted == finished and len(set(finished)) == len(finished), f"{name}: lost or duplicated"


def test_vllm_default_follows_gpu_memory():
    """vLLM's default: 1024 on >= 70 GiB GPUs other than A100, 256 otherwise, never above the token budget."""
    assert vllm_default_max_num_seqs(GPUS["h100"], 8192) == 1024
    assert vllm_default_max_num_seqs(GPUS["rtx4090"], 8192) == 256
    assert vllm_default_max_num_seqs(replace(GPUS["h100"], name="a100-80gb"), 8192) == 256
    gpu = GpuConfig(name="x", memory_gb=75.1, hbm_tb_s=1, bf16_tflops=1, fp8_tflops=1)  # 70 GiB = 75.16 GB
    assert vllm_default_max_num_seqs(gpu, 8192) == 256
    assert vllm_default_max_num_seqs(replace(gpu, memory_gb=75.2), 8192) == 1024
    assert vllm_default_max_num_seqs(GPUS["h200"], 512) == 512
    costs = derive_costs(MODELS["dense-7b"], GPUS["h200"], CostConfig())
    assert costs.max_num_seqs == 1024
    assert derive_costs(MODELS["dense-7b"], GPUS["h200"], CostConfig(max_num_seqs=7)).max_num_seqs == 7


def test_bad_max_num_seqs_is_a_config_error():
    """max_num_seqs 0 is refused with a message naming the field."""
    import pytest

    with pytest.raises(ConfigError, match="max_num_seqs"):
        override(tiny_config(), **{"cluster.cost.max_num_seqs": 0})
