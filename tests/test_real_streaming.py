"""Streaming training steps on the real backend (local Ray, 4 logical GPUs, the tiny CPU model): micro-steps on
elastic cells give the whole batch's update, each micro-step trained once."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))  # the random tree generator lives beside this file
from test_contracts import static_problems, value_problems  # noqa: E402
from test_trajectory_pack import random_group  # noqa: E402

from gyre.cluster import Phase, StepView  # noqa: E402
from gyre.real import task as T  # noqa: E402
from gyre.real.backend import RealCluster  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.streaming import RealStep  # noqa: E402
from gyre.real.trainer import Trainer  # noqa: E402
from gyre.trajectory import AdvantageConfig, group_advantages, score_group  # noqa: E402
from gyre.trajectory.torch_ops import LossConfig, branches_of, naive_loss  # noqa: E402

CFG = preset_tiny_test()
pytestmark = pytest.mark.xdist_group("ray")  # one local Ray node per process


class Scripted:
    """A test-local policy: opens a step on `core` for fresh groups whose trees are random (sub-agents, retries,
    compactions) and makes each group finish, a cell join or a satellite leave at its planned time. A group
    "finishes" as the rollout path would leave it: its executions DONE and its scores handed to the verifier."""

    name = "scripted"

    def __init__(self, core, recs, plan) -> None:
        self.core, self.recs, self.plan = core, recs, plan  # plan: [(t, "finish" | "join" | "leave", arg)]
        self.joins, self.leaves, self.version, self.groups = [], [], None, []

    def run(self, c, steps):
        self.groups = [c.next_group() for _ in self.recs]
        for g, (rec, _) in zip(self.groups, self.recs):
            g.env.recorder = rec
        h = c.open_step(self.core, self.groups)
        self.view = c.training
        t = 0.0
        for at, what, arg in self.plan:
            if at > t:
                yield c.timeout(at - t)
                t = at
            if what == "finish":
                g = self.groups[arg]
                for ex in g.executions:
                    ex.phase = Phase.DONE
                c.verifier._back(g, self.recs[arg][1], c.now, 0, {})  # what the tool service answers for the group
            elif what == "join":
                self.joins.append(c.join_step(arg))
            elif c.training is not None and arg in c.training.cells:
                self.leaves.append(c.leave_step(arg))
        self.version = yield h


def random_recs(rng, n_groups: int):
    """(recorder, scores) per group: random trees of group_size executions, scored by their generated tokens."""
    out = []
    for _ in range(n_groups):
        rec, _ = random_group(rng, CFG.cluster.group_size, int(rng.integers(4, 10)), vocab=T.VOCAB_SIZE)
        out.append((rec, score_group(rec, lambda s: 0.1 * s.generated_tokens)))
    return out


def naive_update(steps: list, seed: int):
    """One process, each step's whole batch at once: every branch as its own causal sequence (naive_loss), the
    gradient, clipped, one AdamW step. Returns (weights before, weights after, and per step: its loss, its gradient
    norm before clipping, its gradient)."""
    tc = CFG.pool.trainer_config
    ref = Trainer(CFG.pool.model, tc, seed=seed)
    before = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    adv_cfg = AdvantageConfig(normalize_std=CFG.cluster.normalize_std)
    params = list(ref.model.parameters())
    losses, norms, grads = [], [], []
    for recs in steps:
        branches, off = [], 0
        for rec, scores in recs:
            branches += branches_of(rec.tree, group_advantages(scores, adv_cfg), execution_offset=off)
            off += len(rec.executions)
        loss = naive_loss(ref.model, branches, tc.normalization, LossConfig(clip_low=tc.clip, clip_high=tc.clip))
        ref.opt.zero_grad()
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in ref.model.named_parameters()})
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)))
        losses.append(float(loss.detach()))
        ref.opt.step()
    return before, ref.model.state_dict(), losses, norms, grads


def run_scripted(pool, policy, **cluster):
    cfg = dataclasses.replace(CFG.cluster, estimate="none", **cluster)
    c = RealCluster(pool=pool, config=cfg)
    try:
        c.run(policy, 1)
        weights = c.trainer_weights()
    finally:
        c.close()
    return c, weights


def check_micro_log(c, policy) -> None:
    """From the log: every execution of the batch trained exactly once (after a cell_lost, once more for each of
    the lost cell's micro-steps), never before its group was scored, each cell one micro-step at a time, and
    only cells that had joined."""
    log = c.log
    execs = [ex.id for g in policy.groups for ex in g.executions]
    micro = [r for r in log if r[0] == "micro" and r[3] in execs]
    lost = Counter(e for r in log if r[0] == "note" and r[2] == "cell_lost" for e in r[3]["micro"] if e in execs)
    got = Counter(r[3] for r in micro)
    want = Counter(execs) + lost
    assert got == want, f"micro-steps trained {dict(got)}, expected {dict(want)} (lost: {dict(lost)})"
    scored = {r[3]["group"]: r[1] for r in log if r[0] == "note" and r[2] == "scored"}
    group_of = {ex.id: g.id for g in policy.groups for ex in g.executions}
    early = [r for r in micro if r[4] < scored[group_of[r[3]]]]
    assert not early, f"micro-steps started before their group was scored: {early}"
    joined = [r for r in log if r[0] == "cell_join"]
    for r in micro:
        assert any(j[3][0] == r[5] and j[1] <= r[4] for j in joined), f"micro-step on a cell never joined: {r}"
    by_cell: dict[int, list] = {}
    for r in micro:
        by_cell.setdefault(r[5], []).append((r[4], r[1]))
    for gpu, spans in by_cell.items():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"cell {gpu} overlapped micro-steps: {spans}"


def check_update(c, weights, steps: list, rel: float = 1e-5) -> None:
    """The run's weights, and each step's loss and gradient norm, against naive_update of the same batches (`rel`:
    the relative tolerance of losses and norms; a step after the first trains on weights that differ where the
    earlier gradients were not firm, see below)."""
    before, want, losses, norms, grads = naive_update(steps, CFG.cluster.seed)
    notes = [r[3] for r in c.log if r[0] == "note" and r[2] == "train"]
    for i, (note, loss, gnorm) in enumerate(zip(notes, losses, norms)):
        assert abs(note["grad_norm"] - gnorm) <= rel * gnorm, f"step {i + 1}: grad norm {note['grad_norm']} vs {gnorm}"
        assert abs(note["loss"] - loss) <= rel * max(abs(loss), 1e-3), f"step {i + 1}: loss {note['loss']} vs {loss}"
    lr = CFG.pool.trainer_config.lr
    # AdamW's first step moves entry i by lr * g_i / (|g_i| + 1e-8): wherever the gradient is well above fp32's
    # rounding of the sums it cancels from (1e-4 of its largest entry), that is lr * sign(g_i), to 1e-3 of lr; an
    # entry below is decided by summation order, and AdamW still moves it by about lr per step at most
    firm = {k: torch.ones_like(v, dtype=torch.bool) for k, v in want.items()}
    for grad in grads:
        top = max(float(g.abs().max()) for g in grad.values())
        firm = {k: firm[k] & (grad[k].abs() >= 1e-4 * top) for k in firm}
    err = max(float(((weights[k] - want[k]).abs() * firm[k]).max()) for k in want)
    anywhere = max(float((weights[k] - before[k]).abs().max()) for k in want)
    assert err <= 1e-3 * lr * len(steps), f"weights differ from the naive update by {err:.3g} where gradients are firm"
    # (a second step's bias-corrected m / sqrt(v) reaches 1.0013 at most: Cauchy-Schwarz over the betas' weights)
    assert anywhere <= 1.01 * lr * len(steps), f"an entry moved {anywhere:.3g}, more than {len(steps)} AdamW steps"
    moved = sum(int((want[k] != before[k]).sum()) for k in want)
    assert moved > 0, "the naive update moved nothing: the check is empty"


@pytest.mark.parametrize("seed,n_cells", [(0, 1), (1, 2), (2, 3), (3, 4)])
def test_streaming_step_on_elastic_cells_equals_the_whole_batch_at_once(pool, seed, n_cells):
    """Random trees, group-finish orders and times, 1 to 4 one-GPU cells (a random core) joining at random times,
    with 3 or more cells the last one leaving mid-step: the new weights are one process's naive update of the
    whole batch (to float summation order), its loss and gradient norm too, and the log shows every micro-step
    trained exactly once, after its group was scored, one at a time per cell."""
    rng = np.random.default_rng(seed)
    n_groups = int(rng.integers(2, 4))
    recs = random_recs(rng, n_groups)
    cells = [(g,) for g in rng.permutation(4)[:n_cells].tolist()]
    plan = [(float(rng.uniform(0, 0.3)), "finish", i) for i in rng.permutation(n_groups).tolist()]
    last = max(p[0] for p in plan)  # the step stays open until the last group's micro-steps are trained
    plan += [(0.0 if n_cells == 4 else float(rng.uniform(0, last)), "join", cell) for cell in cells[1:]]
    if n_cells > 2:
        joined = next(p[0] for p in plan if p[1] == "join" and p[2] == cells[-1])
        plan.append((float(rng.uniform(joined, last)), "leave", cells[-1]))
    plan.sort(key=lambda p: p[0])
    policy = Scripted(cells[0], recs, plan)
    c, weights = run_scripted(pool, policy)
    assert policy.version == 1, f"the step made version {policy.version}"
    assert all(h.done for h in policy.joins + policy.leaves), "a join or a leave never completed"
    bad = static_problems(RealStep, StepView, policy.view) + value_problems(policy.view, StepView)
    assert not bad and isinstance(policy.view, StepView), "\n".join(bad)
    view = policy.view
    assert (view.done, view.n_untrained, view.n_queued, view.version) == (True, 0, 0, 0), "the step's view at its end"
    check_micro_log(c, policy)
    assert len(c.free_gpus()) == 4, f"GPUs still held after the step: free {c.free_gpus()}"
    trained_on = {r[5] for r in c.log if r[0] == "micro"}
    if n_cells == 4:  # all joined before any group was ready: the first micro-steps spread over the cells
        assert len(trained_on) >= 2, f"4 cells, micro-steps trained on {trained_on} only"
    check_update(c, weights, [recs])


def test_two_gpu_cells_share_each_micro_step_and_a_satellite_lost_mid_step_returns_its_micro_steps(pool):
    """Cells of 2 GPUs (each micro-step's packs split over the cell's two workers); a satellite worker killed
    while the step runs: the satellite's micro-steps go back to the queue and are trained again by the core,
    a "cell_lost" note says which, and the update is still the whole batch's."""
    rng = np.random.default_rng(5)
    recs = random_recs(rng, 3)
    plan = [(0.0, "join", (2, 3)), (0.0, "finish", 1), (0.05, "finish", 0), (0.4, "finish", 2)]
    policy = Scripted((0, 1), recs, plan)
    killed = []

    def kill_once(c) -> None:
        micro = [r for r in c.log if r[0] == "micro" and r[5] == 2]
        if not killed and micro:
            killed.append(c.now)
            c.kill_trainer(3)

    cfg = dataclasses.replace(CFG.cluster, estimate="none", cell_gpus=2)
    c = RealCluster(pool=pool, config=cfg)
    try:
        c.run(policy, 1, on_tick=kill_once)
        weights = c.trainer_weights()
    finally:
        c.close()
    assert killed, "the satellite never trained a micro-step"
    lost = [r[3] for r in c.log if r[0] == "note" and r[2] == "cell_lost"]
    assert len(lost) == 1 and lost[0]["gpus"] == [2, 3] and lost[0]["micro"], f"cell_lost notes {lost}"
    check_micro_log(c, policy)
    check_update(c, weights, [recs])


class StreamingPolicy:
    """A small streaming policy: engines on GPUs 1-3; each step's first group rolls out on engine 3; the step opens
    at once on GPU 0 (nothing finished yet); once the first group is done, engine 3 stops, GPU 3 joins the step
    and the other groups roll out on engines 1 and 2, training as they finish; after the step GPU 3 serves again
    and the engines sync (to the published version: every mu-th)."""

    name = "streaming-test"

    def __init__(self) -> None:
        self.joined: list = []

    def run(self, c, steps):
        from gyre.handles import all_of

        e1, e2, e3 = yield all_of([c.start_engine((g,)) for g in (1, 2, 3)])
        for _ in range(steps):
            groups = [c.next_group() for _ in range(c.groups_per_step)]
            first = [c.admit(x, e3) for x in groups[0].executions]
            step = c.open_step((0,), groups)
            yield all_of(first)
            yield c.stop_engine(e3)
            self.joined.append(c.join_step((3,)))
            rest = [x for g in groups[1:] for x in g.executions]
            for i, x in enumerate(rest):
                c.admit(x, (e1, e2)[i % 2])
            yield step
            e3 = yield c.start_engine((3,))
            yield c.sync([e1, e2])


def test_a_streaming_policy_runs_end_to_end_with_bursts(pool, tmp_path):
    """A streaming policy on Ray (a core opened before any group finished, a satellite joining mid-step) with mu = 2:
    every execution rolled out, trained once as one micro-step; engines receive only version 2 (the burst's
    end), so step 2's executions train one version behind; summary.csv reports mu."""
    from gyre.real.runner import run_real, write_outputs

    cfg = dataclasses.replace(CFG, cluster=dataclasses.replace(CFG.cluster, estimate="none", steps_per_burst=2,
                                                               groups_per_step=3))
    policy = StreamingPolicy()
    r = run_real(cfg, policy, pool=pool, steps=2)
    log = r.log
    finished = Counter(x[2] for x in log if x[0] == "finish")
    trained = Counter(x[2] for x in log if x[0] == "trained")
    micro = Counter(x[3] for x in log if x[0] == "micro")
    assert set(finished) == set(trained) == set(micro) and len(finished) == 2 * 3 * CFG.cluster.group_size, \
        f"executions finished {len(finished)}, trained {len(trained)}, micro-stepped {len(micro)}"
    assert max(trained.values()) == max(micro.values()) == 1, "an execution trained twice"
    pairs = []  # (execution, tokens its micro-step trains, tokens it generated), for single-context executions
    for g in r.cluster.groups.values():
        pre = g.env.recorder.tree.preorder()
        for i, x in enumerate(g.recorded_ids()):
            ex = next(e for e in g.executions if e.id == x)
            if not ex.branch_marks:
                pairs.append((x, int(pre.of_execution(i).trained.sum()), ex.generated))
    assert pairs and all(a == b for _, a, b in pairs), f"micro-steps train other executions' tokens: {pairs}"
    assert [x[2] for x in log if x[0] == "step"] == [1, 2], "versions made"
    joins = [x for x in log if x[0] == "cell_join"]
    assert [j[3] for j in joins].count((3,)) + sum(1 for h in policy.joined if h.value is False) == 2, \
        f"GPU 3 joined {joins}"
    assert {x[3] for x in log if x[0] == "sync"} == {2}, "engines got a version other than the burst's end"
    lags = {v: sorted({x[5] for x in log if x[0] == "trained" and x[4] == v}) for v in (0, 1)}
    assert lags == {0: [0], 1: [1]}, f"with mu = 2 both steps roll out on version 0: staleness by step {lags}"
    assert int(r.metrics.summary()["staleness_max"]) == 1, "summary staleness"
    end = {x[2]: x[1] for x in log if x[0] == "finish"}
    last = {v: max(end[x[2]] for x in log if x[0] == "trained" and x[4] == v) for v in (0, 1)}
    early = [j for j in joins if j[3] == (3,) and j[1] < last[j[2]]]
    assert early, f"GPU 3 never joined while executions still rolled out: joins {joins}, last finishes {last}"
    write_outputs(tmp_path, [r])
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert list(summary["steps_per_burst"]) == [2], f"summary.csv: {summary.columns.tolist()}"


@pytest.mark.parametrize("table,field", [("steps_per_burst = 0", "steps_per_burst"),
                                         ("cell_gpus = 3", "cell_gpus"),
                                         ("standalone_gpus = 1\ncell_gpus = 2", "cell_gpus")])
def test_a_bad_burst_or_cell_setting_is_one_line(tmp_path, table, field):
    """mu < 1, or a cell size that does not divide the GPUs left after the standalone pool: one line naming the
    field, exit 2, before any actor starts."""
    from typer.testing import CliRunner

    from gyre.real.cli import app

    cfg = tmp_path / "run.toml"
    cfg.write_text(f'preset = "tiny-test"\n[cluster]\n{table}\n')
    res = CliRunner().invoke(app, ["run", "--policy", "async", "--config", str(cfg), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in res.output, res.output


class Steps:
    """Scripted steps one after another in one run."""

    name = "scripted-steps"

    def __init__(self, parts) -> None:
        self.parts = parts

    def run(self, c, steps):
        for p in self.parts:
            yield from p.run(c, 1)


def test_the_core_lost_mid_step_rebuilds_the_state_of_record_and_trains_again(pool):
    """Step 1 on core (1,) makes worker 1 the worker of record; in step 2 (core (1,), satellite (2,)) worker 1 is
    killed once the core has trained a micro-step: the state of record is rebuilt (the start weights, step 1
    replayed as one optimizer step), the core's micro-steps go back to the queue and it trains on; both steps'
    updates are the naive ones."""
    rng = np.random.default_rng(11)
    recs1, recs2 = random_recs(rng, 2), random_recs(rng, 3)
    p1 = Scripted((1,), recs1, [(0.0, "finish", 0), (0.0, "finish", 1)])
    p2 = Scripted((1,), recs2, [(0.0, "join", (2,)), (0.0, "finish", 0), (0.2, "finish", 1), (0.4, "finish", 2)])
    killed = []

    def kill_core(c) -> None:
        if not killed and any(r[0] == "micro" and r[2] == 1 and r[5] == 1 for r in c.log):
            killed.append(c.now)
            c.kill_trainer(1)

    c = RealCluster(pool=pool, config=dataclasses.replace(CFG.cluster, estimate="none"))
    try:
        c.run(Steps([p1, p2]), 2, on_tick=kill_core)
        weights = c.trainer_weights()
    finally:
        c.close()
    assert killed, "the core never trained a micro-step of step 2"
    assert (p1.version, p2.version) == (1, 2), f"versions {p1.version}, {p2.version}"
    lost = [r[3] for r in c.log if r[0] == "note" and r[2] == "cell_lost"]
    assert [x["gpus"] for x in lost] == [[1]] and lost[0]["micro"], f"cell_lost notes {lost}"
    rebuilt = [r[3] for r in c.log if r[0] == "note" and r[2] == "trainer_recovered"]
    assert len(rebuilt) == 1 and rebuilt[0]["replayed"] == 1 and rebuilt[0]["worker"] == 1, f"recoveries {rebuilt}"
    check_micro_log(c, p1)
    check_micro_log(c, p2)
    check_update(c, weights, [recs1, recs2], rel=1e-3)


def test_a_groups_recorded_executions_are_its_episodes_in_start_order():
    """The recorder numbers executions as episodes start: started in reverse, the recorder's i-th execution is the
    i-th started (what a micro-step is attributed to); never started, episode order."""
    from gyre.real.execution import RealGroup
    from gyre.real.task_api import load_task

    cfg = CFG.cluster
    task = load_task(cfg.task_class, cfg.task, cfg.seed, check=False)
    grp = RealGroup(0, 0, task.new_group(0, cfg.group_size), 10)
    assert grp.recorded_ids() == [], "no execution recorded before any start"
    for ex in reversed(grp.executions):
        ex.start(0.0)
    want = [ex.id for ex in reversed(grp.executions)]
    assert grp.recorded_ids() == want, f"recorded {grp.recorded_ids()}, started {want}"
    assert [e.id for e in grp.env.recorder.executions] == list(range(cfg.group_size)), "recorder numbering"


def _kill_in_reduction(pool, victim: int, blocked: int | None):
    """Two streaming steps on core (1,) and satellite (2,), both joined from the start; in step 2, `blocked`'s worker
    is kept busy 1 s (its end of the reduction queued behind), so the other member waits inside the all-reduce of
    the group step 1 formed, and `victim`'s worker is killed 0.3 s into the reduction (`blocked` None: killed, and
    its loss handled, as the end is launched, before any call of the reduction). Returns (cluster, weights, the two
    steps' policies and batches, what the test hook saw)."""
    import time

    rng = np.random.default_rng(23)
    recs1, recs2 = random_recs(rng, 2), random_recs(rng, 2)
    p1 = Scripted((1,), recs1, [(0.0, "join", (2,)), (0.0, "finish", 0), (0.1, "finish", 1)])
    p2 = Scripted((1,), recs2, [(0.0, "join", (2,)), (0.0, "finish", 0), (0.1, "finish", 1)])
    seen = {}
    launch = RealStep.launch

    def hooked(self, state, stale, save, batch):
        c = self.c
        if self._version == 1 and "members" not in seen:
            seen["members"] = tuple(x.gpus for x in self._reducing)
            if blocked is None:  # what the driver does once it learns of the death
                seen["killed"] = c.now
                actor = pool.trainers[victim]
                ray.kill(actor, no_restart=True)
                c._trainer_dead(victim, actor)
            else:
                pool.trainers[blocked].__ray_call__.remote(lambda _self: time.sleep(1.0))
                c._call_after(0.3, lambda: (seen.setdefault("killed", c.now), c.kill_trainer(victim)))
        launch(self, state, stale, save, batch)

    RealStep.launch = hooked
    c = RealCluster(pool=pool, config=dataclasses.replace(CFG.cluster, estimate="none"))
    try:
        c.run(Steps([p1, p2]), 2)
        weights = c.trainer_weights()
    finally:
        RealStep.launch = launch
        c.close()
    return c, weights, (p1, p2), (recs1, recs2), seen


def _reduced_cells(c) -> list[int]:
    return [r[3]["cells"] for r in c.log if r[0] == "note" and r[2] == "train"]


@pytest.mark.parametrize("inside", [True, False])
def test_a_satellite_lost_during_the_reduction_voids_it_and_the_core_trains_its_micro_steps_again(pool, inside):
    """Step 2's reduction waits on the satellite (2,), killed inside it (or lost as the end is launched): the
    reduction is voided (the core's rank was in the all-reduce, or never called, so nothing was applied), the
    satellite's micro-steps go back to the queue and the core, whose accumulated gradient the void left intact,
    trains them and ends the step alone: both steps' weights are one process's naive update of each batch, and
    every micro-step stands once."""
    c, weights, (p1, p2), (recs1, recs2), seen = _kill_in_reduction(pool, victim=2, blocked=2 if inside else None)
    assert seen.get("members") == ((1,), (2,)) and "killed" in seen, f"the kill did not land in a 2-cell end: {seen}"
    assert (p1.version, p2.version) == (1, 2), f"versions {p1.version}, {p2.version}"
    notes = [r for r in c.log if r[0] == "note" and r[2] in ("reduction_void", "cell_lost", "trainer_fault")]
    kinds = [(r[2], r[3].get("gpus", r[3].get("lost", r[3].get("worker")))) for r in notes]
    assert kinds == [("trainer_fault", 2), ("reduction_void", [[2]]), ("cell_lost", [2])], f"notes {kinds}"
    failed = sorted(e.split(" (")[0] for e in notes[1][3]["errors"])
    assert failed == (["rank 0", "rank 1"] if inside else []), f"the reduction's calls: {notes[1][3]['errors']}"
    lost = notes[2][3]["micro"]
    assert lost and notes[1][1] >= seen["killed"], f"the satellite's micro-steps {lost} after the kill"
    again = [r for r in c.log if r[0] == "micro" and r[3] in lost and r[1] > notes[1][1]]
    assert sorted(r[3] for r in again) == sorted(lost) and {r[5] for r in again} == {1}, f"retrained {again}"
    assert _reduced_cells(c) == [2, 1], f"cells reduced per step: {_reduced_cells(c)}"
    check_micro_log(c, p1)
    check_micro_log(c, p2)
    check_update(c, weights, [recs1, recs2], rel=1e-3)


def test_the_core_lost_during_the_reduction_is_rebuilt_and_the_reduction_redone_with_the_satellite(pool):
    """Step 2's reduction waits on the core (1,), killed inside it while the satellite waits in the all-reduce: the
    reduction is voided; the core held the only state of record (version 1), so it is rebuilt (the starting weights,
    step 1 replayed); its micro-steps go back to the queue, and the step ends with a fresh reduction of the two
    cells, the satellite's gradient kept through the void: the weights are the naive update of both batches."""
    c, weights, (p1, p2), (recs1, recs2), seen = _kill_in_reduction(pool, victim=1, blocked=1)
    assert seen.get("members") == ((1,), (2,)) and "killed" in seen, f"the kill did not land in a 2-cell end: {seen}"
    assert (p1.version, p2.version) == (1, 2), f"versions {p1.version}, {p2.version}"
    notes = {r[2]: r[3] for r in c.log if r[0] == "note"}
    assert notes["reduction_void"]["lost"] == [[1]], notes["reduction_void"]
    failed = sorted(e.split(" (")[0] for e in notes["reduction_void"]["errors"])
    assert failed == ["rank 0", "rank 1"], f"the satellite did not fail in the all-reduce: {notes['reduction_void']}"
    assert notes["cell_lost"]["gpus"] == [1] and notes["cell_lost"]["micro"], notes["cell_lost"]
    rec = notes["trainer_recovered"]
    assert (rec["worker"], rec["version"], rec["replayed"]) == (1, 1, 1), rec
    assert _reduced_cells(c) == [2, 2], f"cells reduced per step: {_reduced_cells(c)}"
    check_micro_log(c, p1)
    check_micro_log(c, p2)
    check_update(c, weights, [recs1, recs2], rel=1e-3)


def test_a_satellite_asked_to_leave_then_killed_returns_its_micro_steps_and_its_leave_completes(pool):
    """The satellite (2,) is asked to leave while it trains a micro-step, having trained one already, and is killed
    at once (before it hands its gradient over): its leave still completes (None), every micro-step it took goes
    back to the queue (a "cell_lost" note) and is trained again on the core, and the update is the whole batch's."""
    rng = np.random.default_rng(31)
    recs = random_recs(rng, 3)
    policy = Scripted((1,), recs, [(0.0, "join", (2,)), (0.0, "finish", 0), (0.0, "finish", 1), (0.0, "finish", 2)])
    asked = []

    def leave_then_kill(c) -> None:
        sat = next((x for x in c._step._cells if x.gpus == (2,)), None) if c._step is not None else None
        if not asked and sat is not None and sat.busy is not None and sat.trained:
            asked.append((c.leave_step((2,)), [m[0] for m in sat.trained] + [sat.busy[0][0]]))
            c.kill_trainer(2)

    c = RealCluster(pool=pool, config=dataclasses.replace(CFG.cluster, estimate="none"))
    try:
        c.run(policy, 1, on_tick=leave_then_kill)
        weights = c.trainer_weights()
    finally:
        c.close()
    assert asked, "the satellite never trained a second micro-step"
    leave, took = asked[0]
    assert leave.done and leave.value is None, f"the leave did not complete: {leave}"
    lost = [r[3] for r in c.log if r[0] == "note" and r[2] == "cell_lost"]
    assert [x["gpus"] for x in lost] == [[2]] and set(lost[0]["micro"]) <= set(took) and lost[0]["micro"], lost
    t_lost = next(r[1] for r in c.log if r[0] == "note" and r[2] == "cell_lost")
    again = {r[3] for r in c.log if r[0] == "micro" and r[1] > t_lost}
    assert set(took) <= again | set(lost[0]["micro"]) and set(lost[0]["micro"]) <= again, \
        f"micro-steps taken {took}, lost {lost[0]['micro']}, trained after the loss {again}"
    assert [r[3] for r in c.log if r[0] == "cell_leave"] == [(2,)], "the satellite left once (the end frees the core)"
    check_micro_log(c, policy)
    check_update(c, weights, [recs])
