"""Data-parallel trainer workers and collective weight sync of the real backend (local Ray, gloo on CPU)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))  # the random tree generator lives beside this file
from test_trajectory_pack import random_group  # noqa: E402

from gyre.real import task as T  # noqa: E402
from gyre.real.collective import CollectiveConfig, GroupBook, buckets, plan_broadcast  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.runner import run_real  # noqa: E402
from gyre.real.trainer import Trainer, shard_packs  # noqa: E402
from gyre.trajectory import group_advantages, score_group  # noqa: E402

CFG = preset_tiny_test()


def test_shard_packs_covers_every_pack_once_and_balances():
    """Largest-first sharding: every pack on exactly one rank; loads within one pack of each other."""
    sizes = [50, 7, 31, 31, 12, 5, 44, 9]
    shards = shard_packs(sizes, 3)
    assert sorted(i for s in shards for i in s) == list(range(len(sizes))), f"packs lost or doubled: {shards}"
    loads = [sum(sizes[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(sizes), f"unbalanced loads {loads}"
    assert shard_packs([3], 2) == [[0], []], "a rank may get no pack (it still joins the all-reduce)"


def test_plan_broadcast_keeps_nccl_groups_off_the_senders_gpu():
    """gloo broadcasts to every engine; NCCL sends the engine on the sender's GPU through the object store."""
    assert plan_broadcast(1, [0, 1, 2], "gloo") == ([0, 1, 2], []), "gloo: everyone in the group"
    assert plan_broadcast(1, [0, 1, 2], "nccl") == ([0, 2], [1]), "nccl: the colocated engine takes the store"


def test_group_book_reuses_groups_and_drops_those_of_a_dead_member():
    """Same members -> same group; a respawned engine is a new member; survivors drop the old group once."""
    book = GroupBook(("h", 1), CollectiveConfig(), [("w", (2, 3), "float32")])
    a = book.specs(("t0", "e1.0", "e2.0"), "sync")
    b = book.specs(("t0", "e1.0", "e2.0"), "sync")
    assert a[0]["name"] == b[0]["name"] and [s["rank"] for s in a] == [0, 1, 2], "membership names the group"
    assert [s["seq"] for s in b] == [1, 1, 1], f"per-member sequence numbers: {[s['seq'] for s in b]}"
    book.forget("e1.0")
    c = book.specs(("t0", "e1.1", "e2.0"), "sync")
    assert c[0]["name"] != a[0]["name"], "a respawned engine gets a fresh group"
    assert c[0]["drop"] == [a[0]["name"]] and c[2]["drop"] == [a[0]["name"]], "survivors drop the dead group"
    assert c[1]["seq"] == 0 and book.specs(("t0", "e2.0"), "sync")[0]["drop"] == [], "drops are sent once"
    assert buckets([("a", (4,), "float32"), ("b", (4,), "float32"), ("c", (2,), "int64")], 32) == [[0, 1], [2]]



@pytest.mark.xdist_group("ray")
def test_each_gpu_hosts_its_engine_and_its_trainer_worker_on_one_device(pool):
    """GPU roles are Ray resources: engine g and trainer worker g share GPU g's bundle and device."""
    n = CFG.pool.n_gpus
    workers = ray.get([t.gpu_ids.remote() for t in pool.trainers])
    engines = ray.get([pool.engine((g,)).__ray_call__.remote(lambda self: [str(i) for i in ray.get_gpu_ids()])
                       for g in range(n)])
    assert workers == engines, f"trainer workers on {workers}, engines on {engines}"
    assert len({d for ids in workers for d in ids}) == n, f"GPUs not one per bundle: {workers}"


def batch_of(seed: int, groups: int = 8):
    """Random task trees (sub-agents, retries, compactions) with GRPO advantages: several packs' worth."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        rec, _ = random_group(rng, 8, 12, vocab=T.VOCAB_SIZE)
        out.append((rec.tree.preorder(), group_advantages(score_group(rec, lambda s: 0.1 * s.generated_tokens))))
    return out


@pytest.mark.xdist_group("ray")
def test_data_parallel_step_equals_single_process_step(pool):
    """Two workers, each on its shard of the packs, all-reducing gradients: the single-process gradient (to
    fp32 summation order), hence the same update; the ranks stay bitwise replicas of each other."""
    batch = batch_of(0)
    ref = Trainer(CFG.pool.model, CFG.pool.trainer_config, seed=3)
    w0, w1 = pool.trainers[0], pool.trainers[1]
    ray.get([w.reset.remote(3) for w in (w0, w1)])  # as the reference (a run resets them again)
    specs = pool.book.specs(("t0", "t1"), "dp")
    g_dp = ray.get([w.gradient.remote(batch, s) for w, s in zip((w0, w1), specs)])[0]
    g_one = ref.gradient(batch)
    scale = max(float(g.abs().max()) for g in g_one.values())
    g_err = max(float((g_dp[k] - g).abs().max()) for k, g in g_one.items())
    assert g_err <= 1e-6 * scale, f"gradients differ by {g_err:.3g} (largest entry {scale:.3g})"

    w_init = ref.weights()
    single = ref.train(batch)
    assert single["packs"] >= 3, f"the batch should span several packs, got {single['packs']}"
    stats = ray.get([w.train.remote(batch, s) for w, s in zip((w0, w1), specs)])
    a, b = ray.get([w0.weights.remote(), w1.weights.remote()])
    assert all(torch.equal(a[k], b[k]) for k in a), "the two ranks' replicas differ"
    want = ref.weights()
    move = max(float((want[k] - w_init[k]).abs().max()) for k in want)
    err = max(float((a[k] - v).abs().max()) for k, v in want.items())
    # AdamW divides by sqrt(v) + 1e-8: on entries whose gradient is ~1e-9, fp32 rounding of the sum moves the
    # update by up to ~1e-6 per step, so the weights are held to 1e-3 of the largest update
    assert err <= 1e-3 * move, f"weights differ by {err:.3g} (largest update {move:.3g})"
    assert abs(stats[0]["loss"] - single["loss"]) <= 1e-6 and stats[0]["ranks"] == 2, f"{stats[0]} vs {single}"
    assert abs(stats[0]["logp_mismatch"] - single["logp_mismatch"]) <= 1e-6, "mismatch not summed over the ranks"


class ProbeAfter:
    """Runs a policy, then syncs every engine and reads back engine and trainer weights."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.seen = inner, inner.name, None

    def run(self, cluster, steps):
        yield from self.inner.run(cluster, steps)
        while any(e.state == "restarting" for e in cluster.engines()):  # a replacement still waking
            yield cluster.timeout(0.05)
        engines = [e for e in cluster.engines() if e.ready]
        yield cluster.sync(engines)
        self.seen = (ray.get([e.actor.get_weights.remote() for e in engines]), cluster.trainer_weights())


@pytest.mark.xdist_group("ray")
def test_collective_sync_reaches_every_engine_bitwise_even_after_a_kill(pool):
    """Collective sync (gloo): an engine killed mid-run is respawned and woken by broadcast; in the end every
    engine holds the trainer's weights bit for bit."""
    from gyre.policies import make_policy

    killed = []

    def chaos(c) -> None:
        busy = [e for e in c.engines() if e.ready and any(x.phase.name == "DECODE" for x in e.members.values())]
        if not killed and busy and c.now > 0.3:
            killed.append(busy[0].id)
            c.kill_engine(busy[0].id)

    cfg = dataclasses.replace(CFG, cluster=dataclasses.replace(CFG.cluster, weight_sync="collective"))
    probe = ProbeAfter(make_policy("async", rollout_gpus=2))  # 2 engines; steps train 2-way data-parallel
    respawns = pool.respawns
    r = run_real(cfg, probe, pool=pool, on_tick=chaos)
    assert killed and pool.respawns == respawns + 1, "fault injection never fired"
    assert len(r.metrics.steps) == CFG.steps, "the run did not finish"
    restarted = [x for x in r.log if x[0] == "note" and x[2] == "engine_restarted"]
    assert restarted, "the replacement engine never came up"
    fallbacks = [x[3] for x in r.log if x[0] == "note" and x[2] == "weights_fallback"]
    assert not fallbacks, f"broadcasts fell back to the object store: {fallbacks}"
    engines, trainer = probe.seen
    assert len(engines) == 2, f"{len(engines)} engines up at the end"
    for i, w in enumerate(engines):
        bad = [k for k in trainer if not torch.equal(w[k], trainer[k])]
        assert not bad, f"engine {i}: {len(bad)} tensors differ from the trainer's, e.g. {bad[:3]}"
    notes = [x[3] for x in r.log if x[0] == "note" and x[2] == "train"]
    assert {n["ranks"] for n in notes} == {2}, f"steps should run on 2 ranks: {notes}"


def test_trust_region_ends_the_step_once_the_log_probs_moved_too_far():
    """max_drift (PPO's target-KL early stop): before each epoch after the first, if the weights have moved the
    batch's log-probs (mean |change| per trained token since the step began) past the bound, the step ends;
    without a bound every epoch is applied. The reported drift is that of the final weights, recomputed here."""
    from gyre.trajectory import PackConfig, build_packs
    from gyre.trajectory.torch_ops import LossConfig, packed_loss

    batch = batch_of(1, groups=4)
    tc = dataclasses.replace(CFG.pool.trainer_config, lr=3e-2, epochs=4)

    def logps(trainer):
        packed = build_packs([t for t, _ in batch], [a for _, a in batch], PackConfig(max_tokens=tc.max_pack_tokens))
        out: list = []
        with torch.no_grad():
            packed_loss(trainer.model, packed.packs, LossConfig(), logps=out)
        return torch.cat(out)

    free = Trainer(CFG.pool.model, tc, seed=5)
    before = logps(free)
    stats = free.train(batch)
    assert stats["epochs"] == 4 and stats["drift"] == 0.0, stats  # no bound: nothing measured
    full_move = float((logps(free) - before).abs().mean())

    t = Trainer(CFG.pool.model, dataclasses.replace(tc, max_drift=full_move / 3), seed=5)
    before = logps(t)
    stats = t.train(batch)
    assert 1 <= stats["epochs"] < 4, stats
    moved = float((logps(t) - before).abs().mean())
    assert abs(moved - stats["drift"]) <= 1e-5 and moved > full_move / 3, f"moved {moved:.4g}, stats {stats}"
    assert moved < full_move, f"stopping early should move less: {moved:.3g} vs {full_move:.3g}"
    assert t.version == 1, "a step that ends early still makes a version"
