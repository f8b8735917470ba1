"""Shared test fixtures: hand-made cost models and workloads small enough to compute by hand."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Property tests take their example count from the profile (HYPOTHESIS_PROFILE): "ci" (the default) runs 50 fixed
# examples each, "deep" (`make test-deep`, the invariants only) 1,000 random ones, "dev" 25 random ones.
settings.register_profile("ci", max_examples=50, deadline=None, derandomize=True)
settings.register_profile("deep", max_examples=1000, deadline=None)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray node (4 logical GPUs) for every test of this process that needs one."""
    ray = pytest.importorskip("ray", reason="the real backend needs ray (pip install -e '.[real]')")
    if not ray.is_initialized():
        for attempt in (1, 2):  # a loaded machine can time out starting the node: once more then
            try:
                ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
                break
            except Exception:
                ray.shutdown()
                if attempt == 2:
                    raise
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(local_ray):
    """The tiny-test preset's actor pool (trainers and engines) on the local Ray node, shared per module."""
    from gyre.real.config import preset_tiny_test
    from gyre.real.pool import ActorPool

    return ActorPool.shared(preset_tiny_test().pool)
