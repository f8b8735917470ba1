"""The real backend on local Ray with 4 logical GPUs: the same policies as the simulator, end to end."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from gyre.cluster import Cluster, Role  # noqa: E402
from gyre.policies import REGISTRY  # noqa: E402
from gyre.real.pool import ActorPool  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.runner import run_real, write_outputs  # noqa: E402

CFG = preset_tiny_test()
# every test that starts a local Ray node runs in one xdist worker (two nodes on one host collide)
pytestmark = pytest.mark.xdist_group("ray")


def check_run(r, steps: int) -> None:
    """Every admitted execution started once, finished once and was trained once; no restart, no loss."""
    log = r.log
    admitted = [x[2] for x in log if x[0] == "admit"]
    started = Counter(x[2] for x in log if x[0] == "start")
    finished = Counter(x[2] for x in log if x[0] == "finish")
    trained = Counter(x[2] for x in log if x[0] == "trained")
    assert len(r.metrics.steps) == steps, f"{r.policy}: {len(r.metrics.steps)} steps, expected {steps}"
    assert set(admitted) == set(started) == set(finished) == set(trained), f"{r.policy}: executions lost"
    assert max(started.values()) == max(finished.values()) == max(trained.values()) == 1, f"{r.policy}: restarted"
    assert not r.cluster.live(), f"{r.policy}: executions left live after the run"


@pytest.mark.parametrize("policy", ["colocate", "async"])
def test_policy_completes_a_real_run(pool, policy):
    """colocate and async run unchanged on Ray; staleness is as the policy says (0, <= eta)."""
    r = run_real(CFG, policy, pool=pool)
    check_run(r, CFG.steps)
    stale = r.metrics.staleness["staleness"]
    bound = 0 if policy == "colocate" else 1
    assert stale.max() <= bound, f"{policy}: staleness {stale.max()} > {bound}"
    roles = {x[3] for x in r.log if x[0] == "role"}
    assert {int(Role.ROLLOUT), int(Role.TRAIN)} <= roles, f"{policy}: roles seen {roles}"
    assert r.metrics.gpu_seconds["rollout_busy"] > 0, f"{policy}: engines never decoded"
    if policy == "async":
        syncs = Counter(x[3] for x in r.log if x[0] == "sync")
        want = {v: 3 for v in range(1, CFG.steps + 1)}  # each of the 3 engines gets every new version once
        assert dict(syncs) == want, f"async: weight versions synced {dict(syncs)}, expected {want}"


def test_engine_killed_mid_run_loses_no_execution(pool):
    """Killing an engine actor mid-run: its executions resume elsewhere; none is lost; the run completes."""
    killed = []

    def chaos(c: Cluster) -> None:
        if killed:
            return
        busy = [e for e in c.engines() if e.ready and any(x.phase.name == "DECODE" for x in e.members.values())]
        if busy and c.now > 0.3:
            killed.append((busy[0].id, sorted(busy[0].members)))
            c.kill_engine(busy[0].id)

    r = run_real(CFG, "async", pool=pool, on_tick=chaos)
    assert killed, "fault injection never fired"
    check_run(r, CFG.steps)
    eid, victims = killed[0]
    faults = [x for x in r.log if x[0] == "note" and x[2] == "engine_fault"]
    assert faults and faults[0][3]["engine"] == eid, f"fault not recorded: {faults}"
    moved = {x[2] for x in r.log if x[0] == "migrate" and x[3] == eid}
    assert moved == set(faults[0][3]["executions"]), f"moved {moved}, on the dead engine {faults[0][3]}"
    assert pool.respawns >= 1, "the dead engine was not replaced"


class Killed(RuntimeError):
    """Stands for the run being killed."""


def test_a_killed_elastic_run_resumes_its_trainer_tasks_and_policy_state(pool, tmp_path):
    """Elastic killed after a checkpointed step with groups drawn but untrained: rerun, the trainer continues its
    version, those tasks are drawn again first (same indexes), and elastic's records of finished groups are
    restored as the checkpointed step left them."""
    import copy

    from gyre.policies.elastic import Elastic
    from gyre.real.run_state import read_run_state, saved_policy_state

    ck = str(tmp_path / "trainer.pt")
    cfg = dataclasses.replace(CFG, steps=4, cluster=dataclasses.replace(CFG.cluster, checkpoint=ck))
    pol, seen = Elastic(), {}

    def kill(c) -> None:
        trained = {x[3] for x in c.log if x[0] == "trained"}
        called = {x[4] for x in c.log if x[0] == "trained"}  # versions trained on: every call booked as a step
        untrained = [g.task_id for g in c.groups.values() if g.id not in trained]
        if c.version >= 2 and len(called) == c.version and untrained:
            seen.update(version=c.version, untrained=untrained, drawn=max(g.task_id for g in c.groups.values()),
                        base=c.base_version,
                        state=copy.deepcopy(pol.state()))
            raise Killed("killed after a checkpointed step")

    with pytest.raises(Killed):
        run_real(cfg, pol, pool=pool, on_tick=kill)
    assert seen, "never killed"
    assert seen["base"] == 0, "a fresh run starts at version 0"
    saved = saved_policy_state(ck)["state"]
    assert saved["started_durations"], f"no finished execution recorded in the saved state {saved}"
    for k, v in saved.items():  # records only grow: what the checkpointed step saw is what the policy held then
        held = seen["state"][k]
        assert (v == held[: len(v)]) if isinstance(v, list) else k in ("max_ctx", "last_counts", "seen_step", "group_size"), \
            f"saved {k} = {v}, the policy held {held} at the kill"
    pol2, got = Elastic(), []
    r2 = run_real(cfg, pol2, pool=pool, steps=1, on_tick=lambda c: got or got.append(copy.deepcopy(pol2.state())))
    assert r2.cluster.base_version == seen["version"], f"resumed at {r2.cluster.base_version}, killed at {seen}"
    assert r2.cluster.trainer_version == seen["version"] + 1, "trainer version after the resumed step"
    assert got[0] == saved, f"restored {got[0]}, saved {saved}"
    assert [x[3] for x in r2.log if x[0] == "note" and x[2] == "policy_state"] == [
        {"policy": "elastic", "restored": True, "saved_by": "elastic"}], "policy_state note"
    tasks = [g.task_id for g in sorted(r2.cluster.groups.values(), key=lambda g: g.id)]
    k = min(len(tasks), len(seen["untrained"]))
    assert tasks[:k] == seen["untrained"][:k], f"resumed run drew {tasks}; untrained at the kill {seen['untrained']}"
    assert tasks[k:] == list(range(seen["drawn"] + 1, seen["drawn"] + 1 + len(tasks) - k)), f"then {tasks[k:]}"
    state = read_run_state(ck)
    assert state["next_task"] == max(seen["drawn"], *tasks) + 1, f"run state after the resume {state}"
    assert state["redraw"] == seen["untrained"][len(tasks):], f"run state after the resume {state}"


def test_outputs_have_the_simulator_formats(pool, tmp_path):
    """write_outputs writes the simulator's files plus a trace gyre.traces reads back."""
    from gyre.traces.schema import read_trace

    r = run_real(CFG, "colocate", pool=pool)
    paths = write_outputs(tmp_path, [r])
    for name in ("summary.csv", "steps_colocate.csv", "staleness_colocate.csv", "role_timeline.png",
                 "learning_colocate.csv", "profile_colocate.json"):
        assert (tmp_path / name).exists(), f"missing {name}"
    tr = read_trace(paths["trace_colocate"])
    assert tr.n_executions == len(r.cluster.executions), f"trace holds {tr.n_executions} executions"


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_contract_every_policy_on_both_backends(pool, policy):
    """Every registered policy completes on the simulator and on the real backend."""
    from gyre.presets import get_preset
    from gyre.sim.harness.runner import simulate

    sim = simulate(dataclasses.replace(get_preset("xlong-swe-small"), steps=2), policy)
    assert len(sim.metrics.steps) == 2, f"{policy}: simulator did not finish"
    check_run(run_real(CFG, policy, pool=pool), CFG.steps)


def test_cli_run_then_calibrate(pool, tmp_path):
    """`gyre-real run` writes the outputs; `gyre-real calibrate` predicts makespans from them, replaying the
    source run's rollouts or each predicted policy's own (which must then exist)."""
    import pandas as pd
    from typer.testing import CliRunner

    from gyre.bridge.cost_fit import CostFitError, predict_makespans
    from gyre.bridge.cli import app

    res = CliRunner().invoke(app, ["run", "--preset", "tiny-test", "--policy", "colocate", "--policy", "async",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, f"run failed: {res.output}"
    assert (tmp_path / "role_timeline.png").exists() and (tmp_path / "trace_colocate.jsonl").exists(), "outputs"
    csv = tmp_path / "pred.csv"
    res = CliRunner().invoke(app, ["calibrate", str(tmp_path), "--from", "colocate", "--predict", "colocate",
                                   "--predict", "async", "--workload", "own", "--out", str(csv)])
    assert res.exit_code == 0 and "predicted_s" in res.output, f"calibrate failed: {res.output}"
    assert "calibrated on colocate: engine step" in res.output and "ms/turn" in res.output, res.output
    own = pd.read_csv(csv).set_index("policy")
    src = predict_makespans(tmp_path, "colocate", ["colocate", "async"]).set_index("policy")
    assert set(own["workload"]) == {"own"} and set(src["workload"]) == {"source"}
    # the source's own prediction replays the same trace either way; async's replays a different one
    assert own.loc["colocate", "predicted_s"] == src.loc["colocate", "predicted_s"]
    assert own.loc["async", "predicted_s"] != src.loc["async", "predicted_s"], "own workload not replayed"
    (tmp_path / "trace_async.jsonl").unlink()
    with pytest.raises(CostFitError, match="no profile/trace for policy 'async'"):
        predict_makespans(tmp_path, "colocate", ["async"], workload="own")
    assert predict_makespans(tmp_path, "colocate", ["async"]).loc[0, "predicted_s"] == src.loc["async", "predicted_s"]
    with pytest.raises(CostFitError, match="workload must be"):
        predict_makespans(tmp_path, "colocate", ["async"], workload="mine")


def test_elastic_moves_gpus_between_roles(pool):
    """elastic on Ray: a GPU goes from rollout to training while another keeps generating, and back.

    Elastic reads the real backend's cost estimate (the preset's start-up profile). The engines' KV is cut
    to 24 tokens (about one execution each), so executions wait for room: every GPU starts an engine, a
    ready batch drains engines to train, and after the step, with executions still waiting, engines
    start on the trainer's GPUs again."""
    import dataclasses

    from gyre.policies import make_policy

    cfg = dataclasses.replace(CFG, steps=3, cluster=dataclasses.replace(CFG.cluster, kv_capacity=24))
    r = run_real(cfg, make_policy("elastic"), pool=pool)
    check_run(r, cfg.steps)
    role: dict[int, int] = {}
    path: dict[int, list[int]] = {}
    overlap = False
    for _, _, gpus, new in (x for x in r.log if x[0] == "role"):
        for g in gpus:
            role[g] = new
            if new in (int(Role.ROLLOUT), int(Role.TRAIN)) and path.setdefault(g, [-1])[-1] != new:
                path[g].append(new)
        overlap |= {int(Role.ROLLOUT), int(Role.TRAIN)} <= set(role.values())
    assert overlap, "no GPU trained while another kept generating"
    cycled = [g for g, p in path.items() if p[1:4] == [int(Role.ROLLOUT), int(Role.TRAIN), int(Role.ROLLOUT)]]
    assert cycled, f"no GPU went rollout -> train -> rollout: {path}"
    assert r.metrics.staleness["staleness"].max() <= 1, "elastic staleness above eta=1"


def test_run_starts_from_an_init_checkpoint(pool, tmp_path):
    """`init_checkpoint`: trainer workers start at the Llama directory's weights (version 0), engines serve them.
    The pool differs only in init_checkpoint, so its warm actors are kept (and kept again for the next test)."""
    import numpy as np
    import torch

    from gyre.real.nn.hf_llama import load_hf_llama, write_hf_llama
    from gyre.real.nn.model import TinyLlama
    from gyre.real.pool import with_init_checkpoint

    model = CFG.pool.model
    ck = write_hf_llama(tmp_path / "llama", model, TinyLlama(model, np.random.default_rng(7)).state_dict(), shards=2)
    _, want = load_hf_llama(ck)
    cfg = dataclasses.replace(CFG, pool=with_init_checkpoint(CFG.pool, str(ck)))
    warm = pool
    pool = ActorPool.shared(cfg.pool)
    assert pool is warm and pool.cfg.init_checkpoint == str(ck.resolve()), "warm actors kept, checkpoint taken"
    served = []

    def grab(c: Cluster) -> None:  # an engine's weights while the run is still at version 0
        if not served and c.version == 0:
            up = [e for e in c.engines() if e.ready]
            if up:
                served.append(ray.get(pool.engine(up[0].gpus).get_weights.remote()))

    r = run_real(cfg, "colocate", pool=pool, steps=1, on_tick=grab)
    check_run(r, 1)
    for name, got in [("trainer worker of record", r.cluster.pool.trainers[0].weights.remote(0)),
                      *[(f"trainer worker {g}", t.weights.remote(0)) for g, t in enumerate(pool.trainers)]]:
        got = ray.get(got)
        assert all(torch.equal(got[k], want[k]) for k in want) and set(got) == set(want), f"{name}: not the file's"
    assert served and all(torch.equal(served[0][k], want[k]) for k in want), "engine at version 0: not the file's"
    assert any(not torch.equal(v, want[k]) for k, v in ray.get(pool.trainers[0].weights.remote(1)).items()), "no step"
    assert ActorPool.shared(CFG.pool) is warm, "back to random initial weights on the same actors"
    r = run_real(CFG, "colocate", pool=warm, steps=1)
    assert not torch.equal(ray.get(warm.trainers[0].weights.remote(0))["embed.weight"], want["embed.weight"])


def test_stalled_since_finds_a_final_run_of_steps_without_learning_signal():
    """A policy that collapsed (every group's rewards equal: all advantages 0) is reported from the first step
    of the final run of such steps; a short run of them, or one that recovers, is not."""
    from gyre.real.runner import RealResult

    def result(signal):
        log = [("note", float(i), "train", {"version": i + 1, "reward_mean": 0.1, "loss": 0.0,
                                            "groups_with_signal": s}) for i, s in enumerate(signal)]
        return RealResult(policy="p", config=None, log=log, metrics=None, profile={}, wall_s=0.0, cluster=None)

    assert result([4, 3, 0, 0, 0, 0]).stalled_since() == 3
    assert result([4, 0, 0, 0, 2, 0, 0]).stalled_since() is None  # recovered; the last run is 2 steps
    assert result([4, 0, 0, 0, 2, 0, 0]).stalled_since(steps=2) == 6
    assert result([0, 0, 0]).stalled_since() == 1
    assert result([]).stalled_since() is None
    assert list(result([3]).learning()["groups_with_signal"]) == [3]


def test_a_pool_built_for_another_config_is_refused(pool):
    """run_real with a warm pool whose [pool] config differs (here the trainer's lr) would silently run with the
    pool's settings: it is a one-line error naming the fields instead."""
    from gyre.real.config import RealConfigError

    tc = dataclasses.replace(CFG.pool.trainer_config, lr=CFG.pool.trainer_config.lr / 2)
    other = dataclasses.replace(CFG, pool=dataclasses.replace(CFG.pool, trainer_config=tc))
    with pytest.raises(RealConfigError, match=r"trainer_config differ"):
        run_real(other, "colocate", pool=pool)


def test_cli_refuses_bad_policy_params_in_one_line(tmp_path):
    """A [policy_params.<p>] value the policy refuses is one line naming the file and field, before any actor starts."""
    from typer.testing import CliRunner

    from gyre.bridge.cli import app

    cfg = tmp_path / "bad.toml"
    cfg.write_text('[policy_params.elastic]\nstart_trainer = "half"\n')
    res = CliRunner().invoke(app, ["run", "--policy", "elastic", "--preset", "tiny-test", "--config", str(cfg),
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "\n" not in line and f"{cfg}: policy_params.elastic:" in line and "start_trainer" in line, line
    assert not (tmp_path / "out").exists(), "nothing written for a refused config"


def test_a_policy_given_by_dotted_path_runs_for_real(pool):
    """A user's policy (defined in a test module, configured by its own typed config) runs on Ray by dotted path."""
    path = "test_policy_path:HalfPool"
    cfg = dataclasses.replace(CFG, policy_params={path: {"engines": 2}})
    r = run_real(cfg, path, pool=pool)
    check_run(r, CFG.steps)
    ups = [x for x in r.log if x[0] == "engine_up"]
    assert len(ups) == 2 * CFG.steps, f"{path}: engines started {len(ups)}, expected 2 per step"


class ConstantReward:
    """A user's task: the built-in agent task with every execution rewarded 1.0 (so no group has signal)."""

    from gyre.real.task import TaskConfig as config_class

    def __init__(self, config, seed: int) -> None:
        from gyre.real.agent import AgentTask

        self.inner = AgentTask(config, seed)
        self.stop = self.inner.stop
        self.max_context = self.inner.max_context

    def new_group(self, index: int, size: int):
        return self.inner.new_group(index, size)

    def score(self, group):
        return [dataclasses.replace(s, reward=1.0) for s in self.inner.score(group)]


def test_a_task_given_by_dotted_path_scores_the_run(pool):
    """The task and its reward come from the class at cluster.task_class: its rewards are the ones trained on."""
    cluster = dataclasses.replace(CFG.cluster, task_class=f"{__name__}:ConstantReward")
    r = run_real(dataclasses.replace(CFG, cluster=cluster), "colocate", pool=pool)
    lc = r.learning()
    assert list(lc["reward_mean"]) == [1.0] * CFG.steps, lc
    assert list(lc["groups_with_signal"]) == [0] * CFG.steps, "equal rewards leave no advantage"


def test_a_bad_task_path_is_one_line(tmp_path):
    """An unloadable [cluster] task_class is one line naming it, before any actor starts."""
    from typer.testing import CliRunner

    from gyre.bridge.cli import app

    cfg = tmp_path / "bad.toml"
    cfg.write_text('[cluster]\ntask_class = "no_such_module:Task"\n')
    res = CliRunner().invoke(app, ["run", "--policy", "colocate", "--preset", "tiny-test", "--config", str(cfg),
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "\n" not in line and "cannot load task 'no_such_module:Task'" in line, line


def test_async_counts_each_tokens_version_lag_for_real(pool):
    """async at eta 1: every execution trained once within eta, and each trained record counts the execution's
    generated tokens with a per-token lag within [0, its staleness]."""
    from gyre.policies import make_policy

    policy = make_policy("async", eta=1)
    r = run_real(CFG, policy, pool=pool)
    log = r.log
    admitted = Counter(x[2] for x in log if x[0] == "admit")
    trained = {x[2]: x for x in log if x[0] == "trained"}
    gen = {x[2]: x[4] for x in log if x[0] == "finish"}
    assert len(r.metrics.steps) == CFG.steps, "the run did not complete"
    assert set(admitted) == set(trained) and max(admitted.values()) == 1, "an execution lost or restarted"
    for x in trained.values():
        assert x[5] <= 1, f"staleness {x[5]} > eta"
        assert x[7] == gen[x[2]], "lag counted over other tokens than the execution generated"
        assert 0 <= x[6] <= x[5] * x[7], f"token lag {x[6]} outside [0, {x[5]} x {x[7]}]"
    assert r.metrics.summary()["lag_mean"] <= r.metrics.summary()["lag_max"]


def test_parked_executions_resume_for_real(pool):
    """Executions parked at tool-call boundaries and resumed on other engines: the run completes, each
    execution trained once within eta, every park matched by a resume."""
    from tests.simkit import ParkingAsync

    r = run_real(CFG, ParkingAsync(eta=1, seed=0, period=0.3), pool=pool)
    log = r.log
    kinds = Counter(x[0] for x in log)
    admitted = Counter(x[2] for x in log if x[0] == "admit")
    trained = Counter(x[2] for x in log if x[0] == "trained")
    assert len(r.metrics.steps) == CFG.steps, "the run did not complete"
    assert set(admitted) == set(trained) and max(trained.values()) == 1, "an execution lost or trained twice"
    assert kinds["park"] >= 1 and kinds["park"] == kinds["resume"], f"parks {kinds['park']}, resumes {kinds['resume']}"
    assert r.metrics.staleness["staleness"].max() <= 1
    assert not r.cluster.live() and not r.cluster.parked(), "executions left over"


def test_queued_executions_start_as_room_frees(pool):
    """KV of 28 tokens per engine and the task's 28-token window: each engine is handed one execution at a time.
    From the log: no engine ever holds two, every admission after an engine's first follows a finish on it, and
    executions waited unstarted (admitted after their group was drawn) yet every one was trained once."""
    from tests.test_sim_admission import occupancy

    cfg = dataclasses.replace(CFG, cluster=dataclasses.replace(CFG.cluster, kv_capacity=28))
    r = run_real(cfg, "async", pool=pool)
    check_run(r, cfg.steps)
    occ = occupancy(r.log)
    assert all(n <= 1 for s in occ.values() for _, n in s), f"an engine held more than one: {dict(occ)}"
    drawn = {}
    for x in r.log:
        if x[0] == "group":
            drawn[x[2]] = x[1]
    group_of = {e.id: e.group_id for g in r.cluster.groups.values() for e in g.executions}
    waited = [x for x in r.log if x[0] == "admit" and x[1] > drawn[group_of[x[2]]] + 0.05]
    assert waited, "no execution waited for room"
    last_finish: dict[int, float] = {}
    where: dict[int, int] = {}
    seen: set[int] = set()
    for x in r.log:
        if x[0] == "admit":
            if x[3] in seen:
                assert x[3] in last_finish and last_finish[x[3]] <= x[1], f"admit {x} before room freed on it"
            seen.add(x[3])
            where[x[2]] = x[3]
        elif x[0] == "finish":
            last_finish[where[x[2]]] = x[1]


def test_summary_counts_the_deadline_cuts_the_scheduler_may_have_caused(pool, tmp_path):
    """A 0.3 s budget, below every slow tool call (0.4-1.5 s): summary.csv's sched_cuts is at most the run's
    deadline cuts less those whose measured tool time alone already reached the budget (the workload's cuts),
    and its deadline_hit is every cut execution."""
    import pandas as pd

    task = dataclasses.replace(CFG.cluster.task, deadline_s=0.3)
    cfg = dataclasses.replace(CFG, cluster=dataclasses.replace(CFG.cluster, task=task))
    r = run_real(cfg, "async", pool=pool)
    check_run(r, cfg.steps)
    row = pd.read_csv(write_outputs(tmp_path, [r])["summary"]).iloc[0]
    execs = [x for g in r.cluster.groups.values() for x in g.executions]
    cut = [x for x in execs if x.end == 2]
    assert cut, "a 0.3 s budget cut nothing"
    workloads = [x for x in cut if sum(s.get("tool_s", 0.0) for s in x.segs) >= x.deadline_at - x.started_at]
    assert int(row["deadline_hit"]) == len(cut), (row["deadline_hit"], len(cut))
    assert 0 <= int(row["sched_cuts"]) <= len(cut) - len(workloads), \
        f"sched_cuts {row['sched_cuts']} of {len(cut)} cuts, {len(workloads)} of them longer than the budget in tools alone"


def test_role_bounded_sampling_shows_in_trained_share(pool):
    """The trainer samples J_max = 1 path per execution (the pool retargeted, warm actors kept): after a step whose
    trees hold more paths than executions, trained_share is below 1 in tokens and attention, its token share the
    "train" note's kept tokens over the unique tokens of the batch's trees (read from the groups' recorders); the
    same step trained exactly leaves (1.0, 1.0)."""
    from gyre.trajectory import SamplingConfig

    tc = dataclasses.replace(CFG.pool.trainer_config, sampling=SamplingConfig(mode="roles", j_max=1))
    cfg = dataclasses.replace(CFG, pool=dataclasses.replace(CFG.pool, trainer_config=tc))
    warm = pool
    try:
        assert ActorPool.shared(cfg.pool) is warm, "only the trainer config differs: warm actors kept"
        r = run_real(cfg, "colocate", pool=warm, steps=1)
    finally:
        assert ActorPool.shared(CFG.pool) is warm, "back to exact training on the same actors"
    check_run(r, 1)
    assert not [x for x in r.log if x[0] == "note" and x[2] == "group_left"], "every execution trains (exact = trees)"
    batch = next(x[3]["groups"] for x in r.log if x[0] == "note" and x[2] == "train_batch")
    pres = [r.cluster.groups[g].env.recorder.tree.preorder() for g in batch]
    paths, execs = sum(len(p.branch_leaf) for p in pres), sum(len(r.cluster.groups[g].executions) for g in batch)
    assert paths > execs, f"{paths} paths for {execs} executions: J_max 1 would train them all"
    note = next(x[3] for x in r.log if x[0] == "note" and x[2] == "train")
    share = r.cluster.trained_share
    assert share[0] == note["kept_tokens"] / sum(p.size for p in pres), (share, note["kept_tokens"])
    assert 0 < share[0] < 1 and 0 < share[1] < 1, f"J_max 1 over {paths} paths: share {share}"
    exact = run_real(CFG, "colocate", pool=warm, steps=1)
    assert exact.cluster.trained_share == (1.0, 1.0), exact.cluster.trained_share
