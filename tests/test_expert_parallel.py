"""Expert parallel across data-parallel replicas: the all-to-all term by hand, memory, lockstep, vLLM's routing."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from gyre.config import override
from gyre.hardware import CostConfig, derive_costs, engine_roofline
from gyre.presets import GPUS, MODELS, get_preset
from gyre.roofline import Coefficients
from gyre.roofline_comm import ep_comm_bytes, ep_group_step_time
from gyre.sim.vllm_check.engine_fit import fit_report, simulate
from gyre.sim.vllm_check.vllm_scheduler import DPBalancer, SchedulerArgs, replay
from gyre.sim.vllm_check.serving_run import read_run
from tests.test_calibrate_engine import TRUE, write_run

IDEAL = Coefficients(eff_bw=1.0, eff_kv=1.0, eff_flops=1.0, step_overhead_s=0.0, allreduce_s=0.0,
                     allreduce_internode_s=0.0, eff_link=1.0)
QWEN_MOE, PRO = MODELS["moe-30b-a3b"], GPUS["rtxpro6000"]


def test_exchange_bytes_by_hand():
    """Qwen3-30B-A3B (d 2,048, top-8) on 2 GPUs, 2 tokens in the group: the gather / scatter pair moves
    2 x 1/2 x 2 x 2,048 x 2 B = 8,192 B per layer; DeepEP-style all-to-all sends each GPU's one token to the
    other GPU when one of its 8 experts is there (1 - 0.5^8) and takes it back: 2 x 1 x 0.99609 x 4,096 B."""
    assert ep_comm_bytes(2, 2048, 2, 8, "allgather_reducescatter") == pytest.approx(8192.0)
    assert ep_comm_bytes(2, 2048, 2, 8, "all_to_all") == pytest.approx(2 * 1 * (1 - 0.5 ** 8) * 4096)
    assert ep_comm_bytes(2, 2048, 1, 8, "all_to_all") == 0.0, "one GPU exchanges nothing"
    with pytest.raises(ValueError, match="ep_backend"):
        ep_comm_bytes(2, 2048, 2, 8, "nccl")


def test_lockstep_step_by_hand():
    """Two one-GPU replicas of Qwen3-30B-A3B, experts split between them, one decode each at context 1,000,
    ideal efficiencies, 10 us per collective: each GPU reads the dense part and its half of the routed
    experts the two tokens touch, computes its half of their expert FLOPs, reads its KV, and pays two
    collectives of 2,048 x 2 B over PCIe Gen5 (63 GB/s) per layer, 48 layers."""
    coef = replace(IDEAL, allreduce_s=10e-6)
    r = engine_roofline(QWEN_MOE, PRO, 1, coef, 2048, ep_gpus=2)
    assert r.expert_parallel
    routed = QWEN_MOE.routed_params_b * 1e9 * 2  # bytes
    embed = 151936 * 2048 * 2
    dense = QWEN_MOE.total_params_b * 1e9 * 2 - routed - embed
    weights = dense + routed / 2 * (1 - (1 - 8 / 128) ** 2)
    linear = max(weights / 1.792e12, 2 * (3.3e9 - 2 * 151936 * 2048) / 503.8e12)  # bandwidth-bound
    kv = 1000 * 2 * 48 * 4 * 128 * 2 / 1.792e12
    exchange = 48 * (2 * 10e-6 + 2 * 0.5 * 2 * 2048 * 2 / 63e9)
    got = ep_group_step_time(r, [(1, 1000.0, 0.0, 0.0), (1, 1000.0, 0.0, 0.0)])
    assert got == pytest.approx(linear + kv + exchange, rel=1e-9), (got, linear + kv + exchange)
    balanced = r.step_time(1, 1000.0)  # the simulator's engine: the other replica runs the same load
    assert balanced == pytest.approx(got, rel=1e-12), "lockstep of equal batches = the balanced (simulator) step"


def test_expert_parallel_frees_memory_and_reads_fewer_experts():
    """With the experts over 2 replicas each replica holds half of them: more KV room; a lone decode reads
    fewer expert bytes per GPU than holding all experts (8 of 64 local vs 8 of 128), and pays the exchange."""
    alone = engine_roofline(QWEN_MOE, PRO, 1, IDEAL, 2048)
    ep = engine_roofline(QWEN_MOE, PRO, 1, IDEAL, 2048, ep_gpus=2)
    half = QWEN_MOE.routed_params_b * 1e9 * 2 / 2
    assert (ep.kv_capacity_tokens - alone.kv_capacity_tokens) * ep.kv_bytes_per_token == pytest.approx(half, rel=1e-3)
    assert ep.weight_bytes_read(1) < alone.weight_bytes_read(1)
    dense = engine_roofline(MODELS["llama-3.1-8b"], PRO, 1, IDEAL, 2048, ep_gpus=2)
    assert not dense.expert_parallel, "a dense model has no experts to spread"


def test_dp_balancer_routes_as_vllm():
    """vLLM's score is 4 x waiting + running: one waiting request (4) loses to three running (3); between the
    coordinator's 100 ms updates the client counts its own routings as waiting; ties go to the lowest rank."""
    b = DPBalancer(2)
    assert b.route(0.0, [(0, 0), (0, 0)]) == 0, "tie: rank 0"
    assert b.route(0.01, [(9, 9), (9, 9)]) == 1, "stale counts: rank 0 has one routed (4) vs 0"
    assert b.route(0.2, [(1, 0), (0, 3)]) == 1, "refreshed: 4 x 1 + 0 > 4 x 0 + 3"
    assert b.route(0.25, [(0, 0), (0, 0)]) == 0, "rank 1 now counts 4 + 3 = 7 > 4"


def test_lockstep_replay_waits_for_the_slowest_replica():
    """A long prefill on one replica holds the other replica's decodes in the same steps (lockstep): the short
    request takes longer than on independent replicas, and each step lasts the slowest replica's time."""
    r = engine_roofline(QWEN_MOE, PRO, 1, Coefficients(), 512, ep_gpus=2)
    args = SchedulerArgs(max_num_seqs=8, max_num_batched_tokens=512, block_size=16, kv_blocks=4096)
    arrival, prompt, out = np.array([0.0, 0.0]), np.array([4000, 10]), np.array([2, 40])
    free = replay(arrival, prompt, out, args, r.step_time, 2)
    lock = replay(arrival, prompt, out, args, r.step_time, 2, lambda b: ep_group_step_time(r, b))
    assert lock.last_token[1] > 1.3 * free.last_token[1], (lock.last_token, free.last_token)
    first_step = ep_group_step_time(r, [(0, 0.0, 512.0, 0.0), (0, 0.0, 10.0, 0.0)])
    assert lock.first_token[1] == pytest.approx(first_step), "the short prompt's first token waits for the chunk"


def test_calibrate_engine_reproduces_an_ep_run(tmp_path):
    """A DP 2 + expert-parallel MoE run written by the lockstep replay under known coefficients: applying them
    reproduces it exactly, the simulator's engine (balanced expert parallel) follows it (median e2e within
    8%, makespan 5%), and the same run read without expert parallel misses."""
    meta = {"model": "Qwen/Qwen3-30B-A3B-Instruct-2507",
            "hardware": {"device_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition"},
            "engine_kwargs": {"tensor_parallel_size": 1, "data_parallel_size": 2, "enable_expert_parallel": True,
                              "max_num_seqs": 16, "max_num_batched_tokens": 512}}
    run = read_run(write_run(tmp_path / "ep", n=30, coef=TRUE, meta=meta))
    assert run.engine.expert_parallel
    rep = fit_report(run, None, TRUE)
    assert rep["calibrated"]["e2e_p90_rel_err"] < 1e-9 and rep["calibrated"]["makespan_rel_err"] < 1e-9, rep
    sim = rep["simulator"]
    assert sim["e2e_median_rel_err"] < 0.08 and sim["makespan_rel_err"] < 0.05, sim
    plain = replace(run, engine=replace(run.engine, expert_parallel=False))
    e2e = simulate(plain, TRUE).last_token - run.requests.queued
    assert np.median(np.abs(e2e / run.requests.e2e - 1)) > 0.01, "expert parallel changes the timeline"


def test_simulator_runs_an_expert_parallel_engine():
    """CostConfig.ep_engines spreads the preset MoE's experts over 2 engines: every engine holds more KV, the
    cluster config still validates and a one-step run completes; a bad knob is a config error."""
    cfg = get_preset("xlong-swe-small")
    base = derive_costs(cfg.cluster.model, cfg.cluster.gpu, cfg.cluster.cost)
    ep = override(cfg, steps=1, **{"cluster.cost.ep_engines": 2})
    costs = derive_costs(ep.cluster.model, ep.cluster.gpu, ep.cluster.cost)
    assert costs.roofline.expert_parallel and costs.kv_capacity_tokens > base.kv_capacity_tokens
    from gyre.sim.harness.runner import simulate as sim_run

    res = sim_run(ep, "async")
    assert np.isfinite(res.makespan_s) and res.makespan_s > 0, res.makespan_s
    from gyre.config import ConfigError

    with pytest.raises(ConfigError, match="ep_engines"):
        override(cfg, **{"cluster.cost.ep_engines": 0})
    with pytest.raises(ValueError, match="ep_backend"):
        CostConfig(ep_backend="nccl")
    assert json.dumps(costs.roofline.ep_backend) == '"allgather_reducescatter"'


def test_fit_recovers_an_ep_run(tmp_path):
    """Fitting a lockstep expert-parallel run made by known coefficients (the collectives' latency among them)
    recovers it: held-out errors near zero, and the latency is fitted though the run has no tensor parallel."""
    meta = {"model": "Qwen/Qwen3-30B-A3B", "hardware": {"device_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition"},
            "engine_kwargs": {"tensor_parallel_size": 1, "data_parallel_size": 2, "enable_expert_parallel": True,
                              "max_num_seqs": 16, "max_num_batched_tokens": 512}}
    coef = replace(TRUE, allreduce_s=3e-5)
    run = read_run(write_run(tmp_path / "ep", n=40, coef=coef, meta=meta))
    rep = fit_report(run, 0.7)
    assert "allreduce_s" in rep["fitted"], rep["fitted"]
    assert rep["calibrated"]["e2e_median_rel_err"] < 0.01 and rep["calibrated"]["makespan_rel_err"] < 0.01, rep
