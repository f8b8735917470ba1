"""Both backends against the Protocols a policy and the fault injector program to (gyre.cluster, gyre.faults):
member by member, with each member's kind, signature and annotated types, and live values' types."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Sequence
from dataclasses import replace

import pytest

from gyre.engine_lifecycle import TRANSITIONS, EngineLifecycle, EngineState
from gyre.cluster import Cluster, EngineView, ExecutionView, Group, Phase
from gyre.faults import FaultTarget
from gyre.sim.cluster.backend import SimCluster
from gyre.sim.cluster.engine import SimEngine
from gyre.sim.cluster.execution import SimExecution, SimGroup
from gyre.sim.cluster.faults import SimFaults
from gyre.workload import GroupSpec, ReplaySource
from tests.simkit import ROUND_COSTS, spec, workload

# a backend's own class stands for the Protocol it implements in its annotations
STANDS_FOR = {"SimEngine": "EngineView", "RealEngine": "EngineView", "SimGroup": "Group", "RealGroup": "Group",
              "SimExecution": "ExecutionView", "RealExecution": "ExecutionView"}


def protocol_members(proto) -> dict[str, str]:
    """name -> "attr" (annotated), "property" or "method", over the Protocol's own body."""
    out = {n: "attr" for n in proto.__dict__.get("__annotations__", {})}
    for n, v in vars(proto).items():
        if not n.startswith("_"):
            out[n] = "property" if isinstance(v, property) else "method" if inspect.isfunction(v) else out.get(n, "?")
    return out


def _norm(ann) -> str:
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
    for impl, proto in STANDS_FOR.items():
        text = text.replace(impl, proto)
    return text.replace("typing.", "").replace("collections.abc.", "")


def _ann(fn, name: str):
    return inspect.get_annotations(fn).get(name, inspect.Parameter.empty)


def static_problems(cls: type, proto, instance=None) -> list[str]:
    """Where `cls` (and, for plain attributes, `instance`) differs from `proto`: a missing member, another kind,
    other parameters, or another annotated type (a backend's own view class standing for the Protocol's)."""
    bad = []
    for name, kind in protocol_members(proto).items():
        want = inspect.getattr_static(proto, name, None)
        got = inspect.getattr_static(cls, name, None)
        where = f"{cls.__name__}.{name}"
        if kind == "attr" or (kind == "property" and not isinstance(got, property) and not callable(got)):
            # a plain attribute, or a read-only property an instance attribute provides
            if instance is None or not hasattr(instance, name):
                bad.append(f"{where}: missing (a {kind})")
            continue
        if got is None:
            bad.append(f"{where}: missing (a {kind})")
        elif kind == "property":
            if not isinstance(got, property):
                bad.append(f"{where}: not a property")
            elif _ann(got.fget, "return") is not inspect.Parameter.empty and \
                    _norm(_ann(got.fget, "return")) != _norm(_ann(want.fget, "return")):
                bad.append(f"{where}: returns {_ann(got.fget, 'return')}, the Protocol {_ann(want.fget, 'return')}")
        else:
            if not inspect.isroutine(got):  # a function, or a compiled one (gyre.compiled)
                bad.append(f"{where}: not a method")
                continue
            ps, pw = inspect.signature(got).parameters, inspect.signature(want).parameters
            shape = [(p.name, p.kind) for p in ps.values()]
            if shape != [(p.name, p.kind) for p in pw.values()]:
                bad.append(f"{where}{inspect.signature(got)}: the Protocol has {name}{inspect.signature(want)}")
                continue
            for p in list(pw)[1:] + ["return"]:
                a, w = _ann(got, p), _ann(want, p)
                if a is not inspect.Parameter.empty and _norm(a) != _norm(w):
                    bad.append(f"{where}: {p} is {a}, the Protocol's {w}")
    return bad


def value_ok(value, hint) -> bool:
    """Whether a live value has the Protocol's annotated type (a Protocol view: isinstance of it)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(value_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is tuple:
        return isinstance(value, tuple) and all(value_ok(v, args[0]) for v in value) if args[-1] is Ellipsis \
            else isinstance(value, tuple)
    if origin in (list, Sequence):
        return isinstance(value, (list, tuple)) and all(value_ok(v, args[0]) for v in value) if args \
            else isinstance(value, (list, tuple))
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a form the check does not read


def value_problems(obj, proto) -> list[str]:
    """Live values of `obj`'s attributes and properties (and of its argument-free observations) against `proto`'s
    types."""
    import gyre.cluster
    import gyre.faults

    ns = {**vars(gyre.cluster), **vars(gyre.faults)}
    hints = typing.get_type_hints(proto, ns)
    bad = []
    for name, kind in protocol_members(proto).items():
        if kind == "attr":
            hint = hints[name]
        elif kind == "property":
            hint = typing.get_type_hints(inspect.getattr_static(proto, name).fget, ns)["return"]
        elif len(inspect.signature(getattr(proto, name)).parameters) == 1 and name not in ("next_group",):
            hint = typing.get_type_hints(getattr(proto, name), ns)["return"]
        else:
            continue
        value = getattr(obj, name)
        if kind == "method":
            value = value()
        if not value_ok(value, hint):
            bad.append(f"{type(obj).__name__}.{name} = {value!r} is not {hint}")
    return bad


def _probe_cluster():
    """A checked SimCluster mid-run: one engine decoding a group of three, a fault target armed (a late kill)."""
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(i, 0, gen=[200, 100], tool_s=[1.0]) for i in range(3)])
    c = SimCluster(n_gpus=2, costs=ROUND_COSTS, source=ReplaySource([g], workload(1, 3)), check=True,
                   faults=("kill-engine@1000000",))
    seen = {}

    class Probe:
        name = "probe"

        def run(self, cluster, steps):
            eng = yield cluster.start_engine([0])
            grp = cluster.next_group()
            for x in grp.executions:
                cluster.admit(x, eng)
            yield cluster.timeout(0.5)
            seen.update(engine=eng, group=grp, execution=grp.executions[0])

    c.run(Probe(), steps=0)
    return c, seen


def test_the_simulator_meets_every_protocol_member_by_member():
    """SimCluster, its engines, groups, executions and fault target have every member of gyre.cluster's and
    gyre.faults' Protocols, of the same kind, signature and types, and live values of those types."""
    c, seen = _probe_cluster()
    pairs = [(c, Cluster), (seen["engine"], EngineView), (seen["group"], Group), (seen["execution"], ExecutionView),
             (c._faults, FaultTarget)]
    assert [type(o) for o, _ in pairs] == [SimCluster, SimEngine, SimGroup, SimExecution, SimFaults]
    bad = [p for obj, proto in pairs for p in static_problems(type(obj), proto, obj) + value_problems(obj, proto)]
    assert not bad, "\n".join(bad)
    assert all(isinstance(obj, proto) for obj, proto in pairs), "a runtime_checkable isinstance fails"


def test_the_real_backend_meets_every_protocol_member_by_member():
    """RealCluster, its engines, groups, executions and the cluster as fault target have every member of the
    Protocols, of the same kind, signature and types; a fresh engine and group give values of those types."""
    pytest.importorskip("ray")
    pytest.importorskip("torch")
    from gyre.real.backend import RealCluster
    from gyre.real.config import preset_tiny_test
    from gyre.real.engine_view import RealEngine
    from gyre.real.execution import RealGroup
    from gyre.real.task_api import load_task

    cfg = preset_tiny_test().cluster
    grp = RealGroup(0, 0, load_task(cfg.task_class, cfg.task, cfg.seed, check=False).new_group(0, cfg.group_size), 0)
    eng = RealEngine(0, (0,), None, 0, 1000, 4)
    books = RealCluster.__new__(RealCluster)  # the driver's books, without actors
    books.init_books(2, gpus_per_engine=1, min_train_gpus=1, groups_per_step=1)
    bad = static_problems(RealCluster, Cluster, books) + static_problems(RealCluster, FaultTarget, books)
    for obj, proto in ((eng, EngineView), (grp, Group), (grp.executions[0], ExecutionView)):
        bad += static_problems(type(obj), proto, obj) + value_problems(obj, proto)
    assert not bad, "\n".join(bad)


def test_both_engine_views_count_phases_alike():
    """On both backends n_decoding counts decoding executions only (not prefilling ones), n_queued the waiting
    ones and n_live all of them: the simulator's at every probe of a run, the real one's with one execution in
    each phase."""
    pytest.importorskip("ray")
    from gyre.real.config import preset_tiny_test
    from gyre.real.engine_view import RealEngine
    from gyre.real.execution import RealGroup
    from gyre.real.task_api import load_task

    cfg = preset_tiny_test().cluster
    grp = RealGroup(0, 0, load_task(cfg.task_class, cfg.task, cfg.seed, check=False).new_group(0, 4), 0)
    eng = RealEngine(0, (0,), None, 0, 1000, 4)
    for x, ph in zip(grp.executions, (Phase.DECODE, Phase.PREFILL, Phase.TOOL, Phase.QUEUED)):
        x.phase, x.engine = ph, eng
        eng.members[x.id] = x
    eng.queue.append(grp.executions[3])
    assert (eng.n_decoding, eng.n_queued, eng.n_live) == (1, 1, 4), "real engine view counts"

    costs = replace(ROUND_COSTS, prefill_s_per_token=0.002, kv_capacity_tokens=1000)
    execs = [spec(i, 0, gen=[150, 100], tool_s=[0.3], prompt=100 + 40 * i) for i in range(6)]
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=execs)
    c = SimCluster(n_gpus=1, costs=costs, source=ReplaySource([g], workload(1, 6)), check=True)
    seen: list[tuple] = []

    class Probe:
        name = "probe"

        def run(self, cluster, steps):
            e = yield cluster.start_engine([0])
            grp = cluster.next_group()
            hs = [cluster.admit(x, e) for x in grp.executions]
            while not all(h.done for h in hs):
                mine = [x for x in cluster.live() if x.engine_id == e.id]
                want = (sum(x.phase == Phase.DECODE for x in mine), sum(x.phase == Phase.QUEUED for x in mine),
                        len(mine))
                seen.append(((e.n_decoding, e.n_queued, e.n_live), want, {x.phase for x in mine}))
                yield cluster.timeout(0.05)

    c.run(Probe(), steps=0)
    assert all(got == want for got, want, _ in seen), [s for s in seen if s[0] != s[1]][:3]
    phases = set().union(*(p for _, _, p in seen))
    assert {Phase.DECODE, Phase.PREFILL, Phase.QUEUED, Phase.TOOL} <= phases, f"the probes saw only {phases}"


def test_engine_lifecycle_moves_only_along_its_transitions():
    """An engine's state changes only along TRANSITIONS (a stopped engine never comes back; a starting one
    never stops), and a transition may set the version it serves."""
    eng = SimEngine.__new__(SimEngine)
    EngineLifecycle.__init__(eng, 3)
    eng.id = 7
    assert eng.state is EngineState.STARTING and eng.version == 3 and not eng.ready
    with pytest.raises(RuntimeError, match="starting -> stopping"):
        eng.transition(EngineState.STOPPING)
    eng.transition(EngineState.READY, version=5)
    assert eng.ready and eng.version == 5, "ready at the version given"
    eng.transition(EngineState.RESTARTING, version=6)
    assert not eng.ready and eng.version == 6
    eng.transition(EngineState.READY)
    eng.transition(EngineState.STOPPING)
    eng.transition(EngineState.STOPPED)
    for to in EngineState:
        with pytest.raises(RuntimeError):
            eng.transition(to)
    assert set(TRANSITIONS) == set(EngineState), "every state has its transitions"


def test_both_engine_views_count_kv_alike():
    """kv_used is the contexts of the members holding KV: on the simulator, one execution (prompt 100, turns of
    150 and 100 tokens at 100 tokens/s, a 1 s tool call between) holds 100 tokens when admitted at 3 s, 200 at
    4 s, its 250-token context through the tool call, 300 at 6 s and nothing once done at 6.5 s; on the real
    backend a queued member holds none and a decoding, prefilling or between-turns one its context."""
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(0, 0, gen=[150, 100], tool_s=[1.0], prompt=100)])
    c = SimCluster(n_gpus=1, costs=ROUND_COSTS, source=ReplaySource([g], workload(1, 1)), check=True)
    seen: list[tuple] = []

    class Probe:
        name = "probe"

        def run(self, cluster, steps):
            e = yield cluster.start_engine([0])
            x = cluster.next_group().executions[0]
            done = cluster.admit(x, e)
            for dt in (0.0, 1.0, 1.0, 0.5, 0.5):
                yield cluster.timeout(dt)
                seen.append((round(cluster.now, 9), x.phase, round(e.kv_used, 9)))
            yield done
            seen.append((round(cluster.now, 9), x.phase, round(e.kv_used, 9)))

    c.run(Probe(), steps=0)
    D, T = Phase.DECODE, Phase.TOOL
    assert seen == [(3.0, D, 100.0), (4.0, D, 200.0), (5.0, T, 250.0), (5.5, D, 250.0), (6.0, D, 300.0),
                    (6.5, Phase.DONE, 0.0)], seen

    pytest.importorskip("ray")
    from gyre.real.config import preset_tiny_test
    from gyre.real.engine_view import RealEngine
    from gyre.real.execution import RealGroup
    from gyre.real.task_api import load_task

    cfg = preset_tiny_test().cluster
    grp = RealGroup(0, 0, load_task(cfg.task_class, cfg.task, cfg.seed, check=False).new_group(0, 4), 0)
    eng = RealEngine(0, (0,), None, 0, 1000, 4)
    for x, ph, ctx in zip(grp.executions, (D, Phase.PREFILL, T, Phase.QUEUED), (300, 200, 250, 400)):
        x.phase, x.engine, x._ctx = ph, eng, ctx
        eng.members[x.id] = x
    eng.queue.append(grp.executions[3])
    assert eng.kv_used == 750.0, f"real engine kv_used {eng.kv_used}: the three non-queued contexts are 750"
