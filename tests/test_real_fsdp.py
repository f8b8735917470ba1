"""The FSDP2 trainer on local Ray (gloo, CPU): re-sharded as the trainer's ranks change, it trains as the
data-parallel trainer does."""

from __future__ import annotations

import dataclasses

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from gyre.handles import all_of  # noqa: E402
from gyre.policies.common import spread  # noqa: E402
from gyre.real.checkpoint import read_checkpoint  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.pool import ActorPool  # noqa: E402
from gyre.real.runner import run_real  # noqa: E402
from gyre.real.trainer import Trainer  # noqa: E402

PLAN = ((0, 1), (1,), (0, 1), (0, 1))  # the trainer's GPUs per step: 2 ranks, 1 (the other one), 2 again


class Replace:
    """Every step's groups rolled out first on GPU 3's engine (all at version 0, so the batches do not depend
    on the trainer), then one step per entry of `plan`, each on its own GPUs; keeps the batches trained."""

    name = "replace"

    def __init__(self, plan, save_to: str) -> None:
        self.plan, self.save_to, self.batches, self.weights = plan, save_to, [], None

    def run(self, cluster, steps):
        e = yield cluster.start_engine([3])
        groups = [[cluster.next_group() for _ in range(cluster.groups_per_step)] for _ in self.plan]
        yield all_of(spread(cluster, [x for gs in groups for g in gs for x in g.executions], [e]))
        for gpus, gs in zip(self.plan, groups):
            yield cluster.train(list(gpus), gs)
        v0 = cluster.base_version
        self.batches = [ray.get(cluster._batches[v][0]) for v in range(v0 + 1, v0 + 1 + len(self.plan))]
        self.weights = cluster.trainer_weights()
        ray.get(cluster.pool.trainers[cluster.worker_of_record()].save.remote(self.save_to))


def _run(cfg, pool, save_to):
    policy = Replace(PLAN, save_to)
    res = run_real(cfg, policy, pool=pool, steps=len(PLAN))
    notes = [x[3] for x in res.log if x[0] == "note" and x[2] == "train"]
    return policy, notes


@pytest.mark.xdist_group("ray")
def test_fsdp_trainer_resharded_across_rank_changes_trains_as_data_parallel(local_ray, tmp_path):
    """Steps on GPUs (0,1), (1,), (0,1), (0,1) with FSDP2, in two runs on one pool (the same groups formed
    again): each rank holds half the parameters, every step's loss and the final weights equal the
    single-process data-parallel trainer's on the same batches, and the worker of record checkpoints the
    whole model and AdamW state."""
    base = preset_tiny_test()
    tc = dataclasses.replace(base.pool.trainer_config, sharding="fsdp", epochs=2)
    cfg = dataclasses.replace(base, pool=dataclasses.replace(base.pool, trainer_config=tc))
    for run in range(2):
        ckpt = tmp_path / f"trainer{run}.pt"
        policy, notes = _run(cfg, ActorPool.shared(cfg.pool), str(ckpt))
        _check(cfg, tc, policy, notes, ckpt, run)


def _check(cfg, tc, policy, notes, ckpt, run) -> None:
    assert [n["ranks"] for n in notes] == [2, 1, 2, 2], f"run {run}: ranks per step {[n['ranks'] for n in notes]}"
    # step 2 runs on GPU 1, which held only its shard: it is sent the state of record; step 3's GPU 0 missed
    # step 2; step 4 keeps step 3's shards
    assert [n["caught_up"] for n in notes] == [0, 1, 1, 0], f"run {run}: caught up {[n['caught_up'] for n in notes]}"
    ref = Trainer(cfg.pool.model, dataclasses.replace(tc, sharding="dp"), seed=cfg.cluster.seed)
    init = ref.weights()
    total = sum(p.numel() for p in ref.model.parameters())
    for i, n in enumerate(notes):
        share = n["local_params"] / total
        want = 0.5 if n["ranks"] == 2 else 1.0
        # rank 0 holds ceil(rows / 2) of each parameter: at most one row more than half
        assert want <= share <= want + 0.05, f"run {run} step {i + 1}: rank 0 holds {share:.3f} of the parameters"
    for i, batch in enumerate(policy.batches):
        got, want = notes[i]["loss"], ref.train(batch)["loss"]
        # the loss before each step's update: the same weights up to the updates' fp32 summation order
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"run {run} step {i + 1}: loss {got} vs {want}"
    want = ref.weights()
    move = max(float((want[k] - init[k]).abs().max()) for k in want)
    err = max(float((policy.weights[k] - v).abs().max()) for k, v in want.items())
    # as the data-parallel test (test_real_dist): AdamW divides by sqrt(v) + 1e-8, so on entries whose gradient
    # is ~1e-9 fp32 rounding of a differently ordered sum moves the update by ~1e-6 per step; held to 1e-3 of
    # the largest update over the 4 steps
    assert err <= 1e-3 * move, f"run {run}: weights differ by {err:.3g} (largest update {move:.3g})"
    saved = read_checkpoint(ckpt, cfg.pool.model)
    assert saved["version"] == len(PLAN) and all(torch.equal(saved["model"][k], policy.weights[k]) for k in want), \
        f"run {run}: the checkpoint holds the published weights, whole"
    moments = [s["exp_avg"].shape for s in saved["opt"]["state"].values()]
    assert moments == [p.shape for p in ref.model.parameters()], f"run {run}: AdamW state not whole: {moments[:3]}"


def test_an_unknown_sharding_is_one_line_naming_the_file_and_field(tmp_path):
    """`sharding = "zero3"` in a run's TOML: a RealConfigError naming the file, the table and both choices."""
    from gyre.real.config import RealConfigError
    from gyre.real.config_file import load_config

    bad = tmp_path / "run.toml"
    bad.write_text('preset = "tiny-test"\n[pool.trainer_config]\nsharding = "zero3"\n')
    with pytest.raises(RealConfigError) as exc:
        load_config(bad)
    msg = str(exc.value)
    assert "\n" not in msg and str(bad) in msg and "pool.trainer_config" in msg and "'dp' or 'fsdp'" in msg, msg
