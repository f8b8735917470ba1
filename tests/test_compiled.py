"""The hot path's C build (gyre.compiled) is what runs when it is built, and it runs the simulator exactly as the
pure-Python sources do: the same event log, record for record and repr for repr, on workloads that take every
branch of the compiled code (dense and hybrid roofline steps, expert routing, linear hand-built costs with free
prefill, KV preemption and eviction, reservation mode, request latency, a running-sequence cap, engine crashes
and migrations, moves at the request, dropped and delayed syncs), under every policy. The pure side runs in a
subprocess with GYRE_PURE=1."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import gyre.compiled as compiled

ROOT = Path(__file__).resolve().parent.parent


def _sha(log: list) -> str:
    return hashlib.sha256("\n".join(repr(r) for r in log).encode()).hexdigest()


def _logs() -> dict[str, str]:
    """sha256 of the event log of each case, run in this process (compiled or not, as imports loaded it)."""
    from gyre.config import override
    from gyre.policies import make_policy, takes
    from gyre.presets import get_preset
    from gyre.sim.harness.runner import simulate
    from tests.simkit import ROUND_COSTS, cluster, tiny_config
    from tests.test_log_invariants import _groups

    out = {}
    for seed in range(3):
        for pol, params in (("colocate", {}), ("async", {"eta": 1}), ("elastic", {"eta": 2})):
            for wl in ("xlong", "math"):
                cfg = tiny_config(gpus=6, steps=2, seed=seed, workload_name=wl)
                if seed == 1:  # reservation mode, request latency and a running-sequence cap
                    cfg = override(cfg, **{"cluster.cost.kv_reserve": True, "cluster.cost.request_s": 0.05,
                                           "cluster.cost.max_num_seqs": 2})
                if seed == 2:
                    cfg = override(cfg, faults=("random-engines:2", "delay-sync:5@60", "drop-sync@200"),
                                   checkpoint_every=1)
                out[f"tiny-{wl}-{pol}-{seed}"] = _sha(simulate(cfg, pol, params).log)
    for preset, gpus, pol in (("xlong-swe-kv", 384, "elastic"), ("xlong-swe-small", 64, "async"),
                              ("short-math", 64, "elastic")):
        cfg = override(get_preset(preset), steps=1, **{"cluster.gpus": gpus})
        out[f"{preset}-{pol}"] = _sha(simulate(cfg, pol, {}).log)
    for seed in range(4):  # linear costs, free prefill, contexts that outgrow a small engine: preempt and evict
        groups = _groups(np.random.default_rng(seed), 8, 4, turns=3, gen=(400, 1700), prompt=(100, 400))
        c = cluster(groups, n_gpus=3, groups_per_step=1, costs=replace(ROUND_COSTS, kv_capacity_tokens=6000),
                    window=1200)
        pol = "async" if seed % 2 else "elastic"
        c.run(make_policy(pol, **({"eta": 1} if takes(pol, "eta") else {})), 3)
        out[f"round-{pol}-{seed}"] = _sha(c.log)
    from tests.test_request_moves import RandomMoves

    for seed in range(2):  # moves at the request: segments cancelled mid-decode (after syncs, preemptions)
        groups = _groups(np.random.default_rng(seed), 8, 4, turns=3, gen=(400, 1700), prompt=(100, 400))
        costs = replace(ROUND_COSTS, kv_capacity_tokens=6000, move_at="request", kv_transfer_s_per_token=0.0005,
                        migration="kv_transfer" if seed else "reprefill")
        c = cluster(groups, n_gpus=3, groups_per_step=1, costs=costs, window=1200)
        c.run(RandomMoves(1, seed, 0.7), 3)
        assert any(r[0] == "move_request" for r in c.log), "no request moved"
        out[f"round-request-{seed}"] = _sha(c.log)
    return out


def _built() -> bool:
    return all(compiled._so(compiled.build_dir(), n).exists() for n in compiled.MODULES)


def test_the_build_is_what_runs():
    """With a build of these sources (make install makes one), importing the simulator loads every compiled
    module; without Cython or a C compiler there is nothing to build (the pure path is what runs)."""
    pytest.importorskip("Cython")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc})")
    if os.environ.get("GYRE_PURE"):
        pytest.skip("GYRE_PURE set: the pure-Python path is asked for")
    assert _built(), f"no build of these sources in {compiled.build_dir()}: run `make install`"
    import gyre.sim.cluster.backend  # noqa: F401 (imports every compiled module)

    assert compiled.active() == list(compiled.MODULES)


@pytest.mark.slow
def test_compiled_and_pure_runs_write_the_same_log():
    if not compiled.active():
        pytest.skip("the compiled build is not loaded in this process")
    here = _logs()
    env = dict(os.environ, GYRE_PURE="1")
    code = "import json; from tests.test_compiled import _logs; print(json.dumps(_logs()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    pure = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(here) == len(pure) == 27
    diff = sorted(k for k in here if here[k] != pure[k])
    assert not diff, f"compiled and pure logs differ on {diff}"


def test_an_edited_source_is_not_loaded_from_an_old_build(tmp_path):
    """The build key covers every compiled source and declaration: one changed byte in either gives another key,
    so a stale extension is never loaded for an edited module."""
    for rel in compiled.MODULES.values():
        for f in (ROOT / rel, (ROOT / rel).with_suffix(".pxd")):
            dest = tmp_path / f.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(f.read_bytes())
    base = compiled.key(tmp_path)
    assert base == compiled.key(ROOT)
    keys = {base}
    for rel in ("sim/cluster/engine.py", "sim/cluster/kv_ledger.pxd"):
        f = tmp_path / rel
        f.write_bytes(f.read_bytes() + b"\n")
        keys.add(compiled.key(tmp_path))
    assert len(keys) == 3


def _declared(pxd: str) -> dict[str, list[str]]:
    """Per `cdef class` of a .pxd, the attributes it declares (`cdef [public|readonly] TYPE a, b`), in order."""
    out: dict[str, list[str]] = {}
    cls = None
    for line in pxd.splitlines():
        code = line.split("#")[0].rstrip()
        m = re.match(r"cdef class (\w+)", code)
        if m:
            cls = out.setdefault(m.group(1), [])
        elif code and not code[0].isspace():
            cls = None
        elif cls is not None and (m := re.match(r"\s+cdef (?:public |readonly )?\w+ ([\w, ]+)$", code)):
            cls += [n.strip() for n in m.group(1).split(",")]
    return out


def _slots(py: str) -> dict[str, list[str]]:
    """Per class of a module's source, its `__slots__`."""
    return {node.name: list(ast.literal_eval(stmt.value)) for node in ast.walk(ast.parse(py))
            if isinstance(node, ast.ClassDef) for stmt in node.body
            if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "__slots__" for t in stmt.targets)}


def _slot_mismatches(py: str, pxd: str) -> list[str]:
    slots = _slots(py)
    return [f"{cls}: declared {sorted(names)}, __slots__ {sorted(slots.get(cls, []))}"
            for cls, names in _declared(pxd).items() if sorted(names) != sorted(slots.get(cls, []))]


def test_declarations_match_slots():
    """Each compiled class declares in its .pxd exactly the attributes its `__slots__` name (pure Python): one
    added to one side only fails here."""
    classes, bad = [], []
    for rel in compiled.MODULES.values():
        py, pxd = ROOT / rel, (ROOT / rel).with_suffix(".pxd")
        classes += _declared(pxd.read_text())
        bad += [f"{rel}: {m}" for m in _slot_mismatches(py.read_text(), pxd.read_text())]
    assert not bad, "\n".join(bad)
    assert sorted(classes) == ["EngineLifecycle", "EventLoop", "KvLedger", "KvPressure", "SimEngine", "SimExecution",
                               "StepCost"], f"compiled classes found: {classes}"


def test_a_slot_on_one_side_only_is_a_mismatch():
    """A name added to `__slots__` only, or declared only, is reported."""
    py = (ROOT / "sim/cluster/kv_ledger.py").read_text()
    pxd = (ROOT / "sim/cluster/kv_ledger.pxd").read_text()
    assert _slot_mismatches(py, pxd) == []
    assert _slot_mismatches(py.replace('"st")', '"st", "extra")'), pxd), "a slot added to the source only"
    assert _slot_mismatches(py, pxd.replace("holders\n", "holders, extra\n")), "a name declared only"
