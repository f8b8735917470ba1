"""The core and the policies import without simpy, ray, vllm or torch."""

from __future__ import annotations

import subprocess
import sys

BLOCK = """
import sys
for name in ("simpy", "ray", "torch", "vllm"):
    sys.modules[name] = None  # any import of it raises ImportError
import gyre, gyre.cluster, gyre.handles, gyre.workload, gyre.presets, gyre.metrics, gyre.hardware
import gyre.backend, gyre.gpu_roles, gyre.config, gyre.outputs
import gyre.policies, gyre.policies.common, gyre.sim.cluster.bound
from gyre.policies import REGISTRY
for name in REGISTRY:
    __import__(REGISTRY[name].__module__)
print("ok", sorted(REGISTRY))
"""


def test_core_and_policies_import_without_backends():
    """`import gyre` and `import gyre.policies` need none of simpy, ray, torch, vllm."""
    out = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok"), out.stdout


def test_policies_never_import_a_backend():
    """No module in policies/ mentions simpy, ray or gyre.sim / gyre.real."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "policies"
    for path in root.glob("*.py"):
        text = path.read_text()
        for bad in ("import simpy", "import ray", "gyre.sim", "gyre.real", "from sim", "from real"):
            assert bad not in text, f"{path.name} contains {bad!r}"


def test_the_backends_never_import_each_other():
    """No module in sim/ mentions gyre.real and none in real/ mentions gyre.sim: they meet only in bridge/."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for folder, other in (("sim", "gyre.real"), ("real", "gyre.sim")):
        for path in (root / folder).rglob("*.py"):
            assert other not in path.read_text(), f"{folder}/{path.name} mentions {other}"


def test_backends_share_one_skeleton():
    """Both backends subclass gyre.backend.ClusterBase and redefine none of what it holds once for both."""
    import pytest

    pytest.importorskip("ray")
    pytest.importorskip("torch")
    from gyre.backend import ClusterBase
    from gyre.real.backend import RealCluster
    from gyre.sim.cluster.backend import SimCluster

    shared = {"n_gpus", "version", "role", "free_gpus", "engines", "live", "migrate", "timeout", "spawn", "note",
              "_drain", "_log", "_check_start", "_check_stop", "_check_admit", "_check_migrate", "_check_train",
              "_check_sync", "_book_group", "_place_engine", "_engine_up", "_engine_down", "_book_trained",
              "_step_done", "init_books", "gpus_per_engine", "min_train_gpus", "groups_per_step", "stop_engine",
              "sync", "park", "resume", "LISTED", "ACCEPTING", "STOPPABLE"}
    assert shared <= set(vars(ClusterBase)), sorted(shared - set(vars(ClusterBase)))
    for cls in (SimCluster, RealCluster):
        assert issubclass(cls, ClusterBase), f"{cls.__name__} is not a ClusterBase"
        own = {n for k in cls.__mro__ if k is not ClusterBase and k is not object for n in vars(k)}
        assert not own & shared, f"{cls.__name__} redefines {sorted(own & shared)}"
