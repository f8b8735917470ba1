"""The lower bound is a bound: no registered policy and no randomized policy finishes faster, on the
hand-built traces that broke earlier versions of it and on random small traces (tight KV included); and each of
its terms is the number computed by hand from the costs' definitions (so a term inflated 2x or 3x fails here, not
only one large enough to exceed a run), with the rollout work at least the log's tokens at peak FLOP/s."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gyre.config import ClusterConfig, RunConfig
from gyre.gpu_time import decompose
from gyre.handles import all_of
from gyre.hardware import CostConfig, Costs, derive_costs
from gyre.policies import REGISTRY
from gyre.sim.cluster.bound import lower_bound
from gyre.policies.common import Batcher, engine_slots
from gyre.presets import GPUS, MODELS
from gyre.roofline import Coefficients
from gyre.sim.harness.runner import simulate
from gyre.traces.schema import read_trace
from gyre.trajectory import SamplingConfig
from gyre.workload import ExecutionSpec, GroupSpec, ReplaySource
from tests.simkit import tiny_config, workload

DATA = Path(__file__).parent / "data"


class RandomPolicy:
    """A legal but arbitrary policy: a random fixed split, random admission delays and engines, random
    migrations; staleness kept within eta by the Batcher."""

    name = "random"

    def __init__(self, seed: int, eta: int) -> None:
        self.rng = random.Random(seed)
        self.eta = eta

    def run(self, cluster, steps):
        rng = self.rng
        n, per, need = cluster.n_gpus, cluster.gpus_per_engine, cluster.min_train_gpus
        r = rng.choice(list(range(per, n - need + 1, per)))
        engines = yield all_of([cluster.start_engine(s) for s in engine_slots(range(r), per)])
        trainer = list(range(r, n))
        batcher = Batcher(cluster, steps, self.eta)
        state = {"done": False}

        def produce():
            while batcher.n_admitted < steps * batcher.gps:
                version = min(e.version for e in engines)
                if not batcher.can_admit(version):
                    yield batcher.changed.wait()
                    continue
                if rng.random() < 0.3:
                    yield cluster.timeout(rng.uniform(0.0, 20.0))
                    continue  # re-check admission after the delay
                g = batcher.admit_group(version)
                batcher.watch(g, [cluster.admit(x, rng.choice(engines)) for x in g.executions])

        def shuffle():
            moving: set[int] = set()  # a decoding execution's migration waits for its tool-call boundary
            while not state["done"]:
                yield cluster.timeout(rng.uniform(0.5, 30.0))
                live = [x for x in cluster.live() if x.engine_id is not None and x.id not in moving]
                if live and len(engines) > 1:
                    x = rng.choice(live)
                    moving.add(x.id)
                    cluster.migrate(x, rng.choice(engines)).on_done(lambda _h, i=x.id: moving.discard(i))

        producer = cluster.spawn(produce(), "random-producer")
        mover = cluster.spawn(shuffle(), "random-mover")
        while cluster.version < steps:
            batch = batcher.next_batch()
            if batch is None:
                yield batcher.changed.wait()
                continue
            batcher.trained(batch)
            yield cluster.train(trainer, batch)
            yield cluster.sync(engines)
            batcher.changed.fire()
        state["done"] = True
        yield all_of([producer, mover])


def _policies(eta: int, seed: int):
    yield "colocate", {}
    for name in REGISTRY:
        if name != "colocate":
            yield name, {"eta": eta}
    yield RandomPolicy(seed, eta), None


def _assert_bounded(cfg, groups, eta: int, seed: int) -> None:
    for pol, params in _policies(eta, seed):
        src = ReplaySource(groups, cfg.workload)
        r = simulate(cfg, pol, params, source=src, check=True)
        b = r.bound
        assert r.makespan_s >= b.makespan_s * (1 - 1e-9), f"{r.policy}: {r.makespan_s:.3f} s beats the bound {b}"
        assert r.metrics.summary()["kv_peak_frac"] <= 1.0
        assert r.metrics.summary()["trained_other_groups"] == 0


# ---------------------------------------------------------------- the hand-built traces


def test_hand_built_traces_replay_above_the_bound(tmp_path):
    """`gyre-sim replay` of both traces: every policy that can run there stays at or above bound_s and eta_bound_s."""
    import json

    from gyre.sim.cli.app import app

    for name, gpus, policies in (("bound_prefill_heavy", 8, ["colocate"]),
                                 ("bound_long_tool", 4, ["colocate", "async", "elastic"])):
        for p in policies:
            out = tmp_path / f"{name}_{p}"
            res = CliRunner().invoke(app, ["replay", str(DATA / f"{name}.jsonl"), "--gpus", str(gpus), "--policy", p,
                                           "--out", str(out)])
            assert res.exit_code == 0, res.output
            for row in json.loads((out / "summary.json").read_text())["results"]:
                assert row["makespan_s"] >= row["bound_s"] * (1 - 1e-9), (name, row)
                assert row["makespan_s"] >= row["eta_bound_s"] * (1 - 1e-9), (name, row)


def test_replay_leaves_out_the_policies_a_cluster_cannot_run(tmp_path):
    """On 8 GPUs whose trainer needs all 8, async and elastic are left out with one line each, colocate runs;
    asking only for one that cannot run is a one-line error, exit 2."""
    import json

    from gyre.sim.cli.app import app

    trace = str(DATA / "bound_prefill_heavy.jsonl")
    res = CliRunner().invoke(app, ["replay", trace, "--gpus", "8", "--out", str(tmp_path / "all")])
    assert res.exit_code == 0, res.output
    assert "skipped async: no setting fits 8 GPUs" in res.output and "skipped elastic:" in res.output, res.output
    rows = json.loads((tmp_path / "all" / "summary.json").read_text())["results"]
    # waterlevel runs too: its one cell is the whole cluster, on rollout or training in turn
    assert [r["policy"] for r in rows if not r["policy"].startswith("waterlevel")] == ["colocate"], rows
    res = CliRunner().invoke(app, ["replay", trace, "--gpus", "8", "--policy", "elastic", "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "no policy can run on this cluster (elastic)" in res.output, res.output
    assert "Traceback" not in res.output


def test_hand_built_traces_with_random_policies():
    """The same traces under random splits, delays and migrations (eta 0..2)."""
    for name, model, gpus in (("bound_long_tool", "dense-7b", 4), ("bound_long_tool", "dense-7b", 6)):
        tr = read_trace(DATA / f"{name}.jsonl")
        cfg = RunConfig(name=name, cluster=ClusterConfig(gpus=gpus, gpu=GPUS["h200"], model=MODELS[model]),
                        workload=tr.workload, steps=len(tr.groups) // tr.workload.groups_per_step)
        for seed in range(4):
            _assert_bounded(cfg, tr.groups, eta=seed % 3, seed=seed)


# ---------------------------------------------------------------- random small traces


@st.composite
def _groups(draw):
    n_groups, size = draw(st.integers(2, 4)), draw(st.integers(1, 4))
    deadline = draw(st.sampled_from([math.inf, math.inf, 200.0]))
    groups, eid = [], 0
    for g in range(n_groups):
        prompt = draw(st.integers(50, 40_000))
        execs = []
        for _ in range(size):
            turns = draw(st.integers(1, 4))
            gen = draw(st.lists(st.integers(1, 400), min_size=turns, max_size=turns))
            tool_s = draw(st.lists(st.floats(0.0, 60.0), min_size=turns - 1, max_size=turns - 1))
            tool_out = draw(st.lists(st.integers(0, 30_000), min_size=turns - 1, max_size=turns - 1))
            kv, ctx = [], prompt
            for i in range(turns):
                kv.append(ctx)
                ctx += gen[i] + (tool_out[i] if i < turns - 1 else 0)
            execs.append(ExecutionSpec(exec_id=eid, group_id=g, task_id=g, step=g, prompt=prompt, gen=gen,
                                       tool_s=tool_s, tool_out=tool_out, kv=kv, branches=[], capped=False,
                                       deadline_s=deadline))
            eid += 1
        groups.append(GroupSpec(group_id=g, task_id=g, step=g, executions=execs))
    return groups


@pytest.mark.invariants
@settings(deadline=None)
@given(groups=_groups(), gpus=st.sampled_from([4, 6]), eta=st.integers(0, 2), seed=st.integers(0, 1000),
       tight=st.booleans(), request_s=st.sampled_from([0.0, 0.0, 3.0]), hybrid=st.booleans())
def test_no_policy_beats_the_bound_on_random_traces(groups, gpus, eta, seed, tight, request_s, hybrid):
    """Every registered policy and a randomized one, on random 2-4 group traces (KV tight or roomy, with or
    without a per-turn request latency outside the engine, full attention or hybrid linear attention)."""
    util = 0.3 if tight else 0.9  # 0.3 x 141 GB - 2 GB - 15.2 GB of weights: ~420K KV tokens
    cost = CostConfig(engine=Coefficients(gpu_memory_utilization=util), request_s=request_s)
    # a 128K window: engines are handed ~3 (tight KV) or ~12 executions at once (policies.admit_queue)
    w = replace(workload(1, len(groups[0].executions)), context_window=1 << 17, summary_tokens=1024)
    model = MODELS["dense-7b"]
    if hybrid:  # every 4th layer full attention, Qwen3-Next's linear layers on the rest: a 1,608-token state
        model = replace(model, full_attention_interval=4, linear_key_heads=16, linear_value_heads=32,
                        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4)
    cfg = RunConfig(name="random", cluster=ClusterConfig(gpus=gpus, gpu=GPUS["h200"], model=model,
                                                         cost=cost), workload=w, steps=len(groups))
    _assert_bounded(cfg, groups, eta, seed)


# ---------------------------------------------------------------- each term by hand

LINEAR = Costs(engine_gpus=1, kv_capacity_tokens=1000, step_a=0.01, step_b=0.001, step_c=1e-6,
               prefill_s_per_token=0.0005, train_s_per_token_gpu=0.01, min_train_gpus=1, sync_s=0.0,
               engine_wake_s=0.0, engine_sleep_s=0.0, trainer_onload_s=0.0, trainer_offload_s=0.0,
               kv_transfer_s_per_token=0.0, migration="reprefill", max_batched_tokens=50)


def _ex(eid: int, g: int, gen: list[int], tool_s=(), tool_out=(), prompt: int = 100) -> ExecutionSpec:
    kv, ctx = [], prompt
    for i, n in enumerate(gen):
        kv.append(ctx)
        ctx += n + (tool_out[i] if i < len(tool_out) else 0)
    return ExecutionSpec(exec_id=eid, group_id=g, task_id=g, step=g, prompt=prompt, gen=list(gen), tool_s=list(tool_s),
                         tool_out=list(tool_out), kv=kv, branches=[], capped=False, deadline_s=math.inf)


# group 0: A (two turns of 20 and 30 tokens, a 5 s tool call returning 50 tokens) and B (40 tokens); group 1: C (10)
HAND = [GroupSpec(group_id=0, task_id=0, step=0, executions=[_ex(0, 0, [20, 30], [5.0], [50]), _ex(1, 0, [40])]),
        GroupSpec(group_id=1, task_id=1, step=1, executions=[_ex(2, 1, [10])])]


def test_rollout_gpu_work_by_hand():
    """Linear costs: 100 decoded + 350 prefilled tokens (3 prompts of 100, one 50-token tool output) in steps of
    at most 50 tokens (the budget; 1,000 KV tokens / 100 hold 10): >= 9 steps x 0.01 s + 100 x 0.001 s + 1e-6 x
    the contexts read (20 x 100 + 30 x 170 + 40 x 100 + 10 x 100 = 12,100) + 350 x 0.0005 s = 0.3771 GPU-s."""
    b = lower_bound(HAND, LINEAR, n_gpus=2, groups_per_step=1)
    assert b.rollout_gpu_s == pytest.approx(0.09 + 0.1 + 0.0121 + 0.175, rel=1e-12), b


def test_training_gpu_work_by_hand():
    """0.01 GPU-s per trained token: group 0 trains its prompt once (100) plus A's 100 and B's 40 own tokens, group 1
    100 + 10: 3.5 GPU-s; the work term on 2 GPUs is (0.3771 + 3.5) / 2."""
    b = lower_bound(HAND, LINEAR, n_gpus=2, groups_per_step=1)
    assert b.train_gpu_s == pytest.approx(3.5, rel=1e-12), b
    assert b.work_s == pytest.approx((0.3771 + 3.5) / 2, rel=1e-12), b


def test_critical_path_by_hand():
    """A alone: its prompt at the cheapest prefill (100 x (0.01 / 50 + 0.0005) = 0.07 s), 20 tokens at batch 1 and
    context 100 (0.0111 s each), the 5 s tool, its 50 output tokens (0.035 s), 30 tokens at context 170 (0.01117 s
    each): 5.6621 s; then group 0's training on 2 GPUs, 2.4 / 2 s. Group 1 is shorter (0.181 + 0.55)."""
    b = lower_bound(HAND, LINEAR, n_gpus=2, groups_per_step=1)
    assert b.critical_path_s == pytest.approx(0.07 + 0.222 + 5.0 + 0.035 + 0.3351 + 1.2, rel=1e-12), b


def test_staleness_chain_by_hand():
    """After its prompt group 0 needs 5.5921 s, group 1 0.111 s. One group per step: with eta 0 each step follows
    the last, (5.5921 + 0.111 + 3.5 / 2) s; with eta 1 two chains share it, half that. Both groups in one step:
    only the longer counts, (5.5921 + 1.75) / (eta + 1)."""
    for eta in (0, 1, 2):
        b = lower_bound(HAND, LINEAR, n_gpus=2, groups_per_step=1, eta=eta)
        assert b.staleness_s == pytest.approx((5.5921 + 0.111 + 1.75) / (eta + 1), rel=1e-12), (eta, b)
        b = lower_bound(HAND, LINEAR, n_gpus=2, groups_per_step=2, eta=eta)
        assert b.staleness_s == pytest.approx((5.5921 + 1.75) / (eta + 1), rel=1e-12), (eta, b)
    assert lower_bound(HAND, LINEAR, n_gpus=2, groups_per_step=1).staleness_s == 0.0, "no eta, no chain"


# Qwen2.5-7B (the dense-7b preset) on one H200, from the config and the data sheet (gyre.presets)
P, E, L, H, HKV, DH = 7.6e9, 152064 * 3584, 28, 28, 4, 128
BW, PEAK = 4.8e12, 989e12


def test_roofline_rollout_and_training_work_by_hand():
    """One execution, a 1,000-token prompt and 1,000 decoded tokens, bf16 on one H200, steps of <= 8,192 tokens:
    the weights without the input embedding (2 B x (P - E)) read once per 8,192 tokens at 0.8 of 4.8 TB/s plus
    1,000 x 1,000 KV tokens of 57,344 B at 0.65 of it, against 2 x (P - 2E) FLOPs per token plus 4 L H d_h per
    context token at 0.6 of 989 TFLOP/s, the larger, plus 4 ms per 8,192 tokens. Training: 6 P per token plus
    12 L H d_h per token per context token (1,000^2 / 2 + 1,000 x 1,000 + 1,000^2 / 2) at 35% of peak."""
    costs = derive_costs(MODELS["dense-7b"], GPUS["h200"], CostConfig())
    g = [GroupSpec(group_id=0, task_id=0, step=0, executions=[_ex(0, 0, [1000], prompt=1000)])]
    b = lower_bound(g, costs, n_gpus=2, groups_per_step=1)
    mem = 2000 * 2 * (P - E) / 8192 / (0.8 * BW) + 2 * L * HKV * DH * 2 * 1e6 / (0.65 * BW)
    flops = 2000 * 2 * (P - 2 * E) + 4 * L * H * DH * 1e6
    assert b.rollout_gpu_s == pytest.approx(max(mem, flops / (0.6 * PEAK)) + 0.004 * 2000 / 8192, rel=1e-9), b
    assert b.train_gpu_s == pytest.approx((2000 * 6 * P + 12 * L * H * DH * 2e6) / (0.35 * PEAK), rel=1e-9), b


@pytest.mark.invariants
@settings(deadline=None)
@given(groups=_groups(), gpus=st.sampled_from([4, 6]))
def test_rollout_work_is_at_least_the_logged_tokens_at_peak_flops(groups, gpus):
    """The rollout GPU-work term is at least the tokens the run's log records (every execution's generated tokens,
    plus its prompt) computed at the GPU's data-sheet peak: 2 x (P - 2E) FLOPs each at 989 TFLOP/s."""
    w = replace(workload(1, len(groups[0].executions)), context_window=1 << 17, summary_tokens=1024)
    cfg = RunConfig(name="random", cluster=ClusterConfig(gpus=gpus, gpu=GPUS["h200"], model=MODELS["dense-7b"]),
                    workload=w, steps=len(groups))
    r = simulate(cfg, "colocate", source=ReplaySource(groups, cfg.workload))
    sure = {e.exec_id: e for g in groups for e in g.executions if not math.isfinite(e.deadline_s)}
    prompts = sum(e.prompt for g in groups for e in g.executions)
    decoded = sum(x[4] for x in r.log if x[0] == "finish" and x[2] in sure)
    floor = (decoded + prompts) * 2 * (P - 2 * E) / PEAK
    assert r.bound.rollout_gpu_s >= floor, (r.bound.rollout_gpu_s, floor)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(mode="roles", j_max=1)], ids=["exact", "roles-1"])
def test_the_bounds_training_is_what_the_run_trains(sampling):
    """With nothing cut (no deadline), the bound's training GPU-seconds are the run's, read from its role records
    (gyre.gpu_time's `train` term: async trains on fixed GPUs, every TRAIN second computing): under role-bounded
    sampling the drawn paths' work, below exact training's on branching executions (compaction, sub-agents,
    retries)."""
    cfg = tiny_config(gpus=6, groups_per_step=3, steps=3, seed=4)
    cfg = replace(cfg, sampling=sampling, workload=replace(cfg.workload, deadline_s=float("inf"), subagent_p=0.3,
                                                           retry_p=0.3))
    r = simulate(cfg, "async", {"eta": 1, "rollout_gpus": 4})
    train = decompose(r.log, cfg.cluster.gpus, r.costs.sync_s)["train"]
    assert r.bound.train_gpu_s == pytest.approx(train, rel=1e-9), (r.bound.train_gpu_s, train)
    assert r.makespan_s >= r.bound.makespan_s
    if sampling.sampled:
        exact = simulate(replace(cfg, sampling=SamplingConfig()), "async", {"eta": 1, "rollout_gpus": 4})
        assert r.bound.train_gpu_s < 0.9 * exact.bound.train_gpu_s, (r.bound.train_gpu_s, exact.bound.train_gpu_s)
