"""Every verb refuses what the cluster cannot honour, with a one-line ClusterError naming the verb and the reason:
busy, missing or repeated GPUs, an engine that is not ready or still holds work, an execution in the wrong state,
a batch that is empty or unfinished, a bad delay, a policy that waits on nothing. Each refusal is triggered here
on the simulator (the preconditions are gyre.backend.ClusterBase's, shared with the real backend)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gyre.cluster import ClusterError
from gyre.config import ConfigError
from gyre.handles import Handle
from gyre.workload import GroupSpec
from tests.simkit import ROUND_COSTS, cluster, spec


def _refused(seen: list[str], what: str, fn, *args) -> None:
    """fn(*args) raises a ClusterError whose message contains `what`; noted in `seen`."""
    with pytest.raises(ClusterError) as err:
        fn(*args)
    assert what in str(err.value), f"{fn.__name__}{args}: expected {what!r}, got {err.value!r}"
    assert "\n" not in str(err.value), f"not one line: {err.value!r}"
    seen.append(what)


class Refusals:
    """A scripted policy on 4 GPUs that tries each refused use of a verb at a moment it must be refused, between
    the legal calls that bring the cluster there (the legal ones must succeed)."""

    name = "refusals"

    def __init__(self) -> None:
        self.seen: list[str] = []

    def run(self, c, steps):
        no = self.seen
        # t = 0: engine 0 starting on GPU 0 (up at 3 s), a group of three executions not yet admitted
        h0 = c.start_engine([0])
        _refused(no, "start_engine: GPU 0 is busy (SWITCHING)", c.start_engine, [0])
        _refused(no, "start_engine: GPU 9 does not exist (cluster has 4)", c.start_engine, [9])
        _refused(no, "start_engine: GPU list has duplicates: (1, 1)", c.start_engine, [1, 1])
        _refused(no, "start_engine: an engine needs 1 GPUs, got 2", c.start_engine, [1, 2])
        (starting,) = c.engines()
        grp = c.next_group()
        a, b, p = grp.executions
        _refused(no, "admit: engine 0 is not ready", c.admit, a, starting)
        _refused(no, "stop_engine: engine 0 is not running", c.stop_engine, starting)
        _refused(no, "migrate: execution 0 is not live on an engine", c.migrate, a, starting)
        _refused(no, "park: execution 0 is not live on an engine", c.park, a)
        _refused(no, "resume: execution 0 is not parked", c.resume, a, starting)
        _refused(no, "train: empty batch", c.train, [2], [])
        _refused(no, "train: GPU 0 is busy (SWITCHING)", c.train, [0], [grp])
        _refused(no, "train: the model needs >= 1 GPUs to train, got 0", c.train, [], [grp])
        _refused(no, "train: group 0 has unfinished executions", c.train, [2], [grp])
        _refused(no, "timeout: bad delay -1", c.timeout, -1.0)
        _refused(no, "timeout: bad delay nan", c.timeout, math.nan)
        e0 = yield h0
        h1 = c.start_engine([1])  # engine 1 up at 6 s
        done_a, done_b, done_p = c.admit(a, e0), c.admit(b, e0), c.admit(p, e0)
        _refused(no, "admit: execution 0 is not a fresh execution", c.admit, a, e0)
        _refused(no, "stop_engine: engine 0 still holds 3 executions", c.stop_engine, e0)
        _refused(no, "train: GPU 0 is busy (ROLLOUT)", c.train, [0], [grp])
        new = next(e for e in c.engines() if e.id == 1)
        _refused(no, "migrate: target engine 1 is not ready", c.migrate, a, new)
        parked = c.park(p)  # p decodes: it leaves at its tool call (4 s)
        _refused(no, "park: execution 2 already has a migration pending", c.park, p)
        _refused(no, "migrate: execution 2 already has a migration pending", c.migrate, p, e0)
        assert (yield parked) is True, "p parked at its tool-call boundary"
        _refused(no, "resume: engine 1 is not ready", c.resume, p, new)
        e1 = yield h1
        c.resume(p, e1)
        moved = c.migrate(a, e1)  # a decodes its first turn (3-7 s): it moves at its tool call
        _refused(no, "migrate: execution 0 already has a migration pending", c.migrate, a, e1)
        assert (yield moved) is True, "a migrated at its tool-call boundary"
        yield done_a
        yield done_b
        yield done_p
        yield c.train([2], [grp])
        stopping = c.stop_engine(e0)  # empty now: a left, b and p are done
        _refused(no, "sync: engine 0 is not ready", c.sync, [e0])
        yield c.sync([e1])
        yield stopping


def test_every_verb_refuses_what_it_cannot_honour():
    """Each refusal fires with its own one-line message at the moment it must, and the legal calls between them
    succeed (the run ends with one training step and engine 1 serving its weights)."""
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[
        spec(0, 0, gen=[400, 100], tool_s=[5.0]), spec(1, 0, gen=[50]), spec(2, 0, gen=[100, 100], tool_s=[5.0])])
    c = cluster([g], n_gpus=4, groups_per_step=1)
    pol = Refusals()
    c.run(pol, steps=1)
    assert len(pol.seen) == 24 and len(set(pol.seen)) == 24, f"{len(pol.seen)} refusals seen: {pol.seen}"
    assert [r[2] for r in c.log if r[0] == "step"] == [1], "the legal calls trained one step"
    assert [(r[2], r[3]) for r in c.log if r[0] == "sync"] == [(1, 1)], "engine 1 synced to version 1"
    assert [r[2:] for r in c.log if r[0] == "migrate"] == [(0, 0, 1)], "exec 0 moved from engine 0 to 1"


def test_an_engine_of_two_gpus_and_a_trainer_of_two_refuse_one():
    """With 2-GPU engines and a 2-GPU minimum trainer, one GPU is refused by both verbs."""
    costs = replace(ROUND_COSTS, engine_gpus=2, min_train_gpus=2)
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, gen=[10])])
    seen: list[str] = []

    class Policy:
        name = "two"

        def run(self, c, steps):
            _refused(seen, "start_engine: an engine needs 2 GPUs, got 1", c.start_engine, [0])
            grp = c.next_group()
            e = yield c.start_engine([0, 1])
            yield c.admit(grp.executions[0], e)
            _refused(seen, "train: the model needs >= 2 GPUs to train, got 1", c.train, [2], [grp])
            yield c.train([2, 3], [grp])

    cluster([g], n_gpus=4, groups_per_step=1, costs=costs).run(Policy(), steps=1)
    assert len(seen) == 2, seen


def test_a_policy_waiting_on_nothing_is_a_deadlock():
    """A policy that waits on a handle nothing will complete is stopped with a one-line deadlock error."""

    class Stuck:
        name = "stuck"

        def run(self, c, steps):
            yield c.timeout(2.5)
            yield Handle("never")

    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, gen=[10])])
    with pytest.raises(ClusterError, match=r"^deadlock at t=2\.5s: the policy waits on nothing$"):
        cluster([g], n_gpus=1, groups_per_step=1).run(Stuck(), steps=1)


def test_a_context_larger_than_the_engine_is_refused_at_admission():
    """An execution whose context would outgrow a whole engine (1,000 KV tokens) is refused when admitted, with
    one line naming it and the engine's capacity."""
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, gen=[950], prompt=100)])

    class Admit:
        name = "admit"

        def run(self, c, steps):
            grp = c.next_group()
            e = yield c.start_engine([0])
            yield c.admit(grp.executions[0], e)

    with pytest.raises(ConfigError, match=r"execution 0 reaches a 1,050-token context; an engine holds 1,000 KV"):
        cluster([g], n_gpus=1, groups_per_step=1, costs=replace(ROUND_COSTS, kv_capacity_tokens=1000),
                window=1000).run(Admit(), steps=1)


def test_the_fault_target_refuses_to_kill_an_engine_that_is_not_running():
    """kill_engine (gyre.faults.FaultTarget, the fault injector's verb) refuses an engine still starting and one
    that does not exist, with one line each, and kills a ready one (it restarts: listed, not ready)."""
    from gyre.sim.cluster.backend import SimCluster
    from gyre.workload import ReplaySource
    from tests.simkit import workload

    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, gen=[10])])
    c = SimCluster(n_gpus=2, costs=ROUND_COSTS, source=ReplaySource([g], workload(1, 1)), check=True,
                   faults=("kill-engine@1000000",))  # armed far past the run: only the calls below kill
    seen: list[str] = []
    states: list[str] = []

    class Kill:
        name = "kill"

        def run(self, cluster, steps):
            h = cluster.start_engine([0])
            (starting,) = cluster.engines()
            _refused(seen, f"kill_engine: engine {starting.id} is not running", c._faults.kill_engine, starting.id)
            _refused(seen, "kill_engine: engine 99 is not running", c._faults.kill_engine, 99)
            e = yield h
            c._faults.kill_engine(e.id)
            states.extend(x.state.value for x in cluster.engines())

    c.run(Kill(), steps=0)
    assert len(seen) == 2, seen
    assert states == ["restarting"], f"a killed ready engine is listed as {states}"
