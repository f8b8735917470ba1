"""Faults on the real backend (local Ray, 4 logical GPUs): engines and trainer workers killed mid-run.

Every run must complete with every execution admitted, started, finished and trained exactly once, within
the policy's staleness bound, and engines serving the trainer's latest weights afterwards.
"""

from __future__ import annotations

import dataclasses

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from gyre.cluster import Role  # noqa: E402
from gyre.real.pool import ActorPool  # noqa: E402
from gyre.real.runner import preset_tiny_test, run_real  # noqa: E402
from test_real_cluster import check_run  # noqa: E402

CFG = preset_tiny_test()
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def pool(local_ray):
    return ActorPool.shared(CFG.pool)


def steps_before(log, t: float) -> int:
    return sum(1 for x in log if x[0] == "step" and x[1] <= t)


def test_engine_killed_while_a_step_trains_serves_the_new_version(pool):
    """async (eta 0): an engine killed just after a step starts restarts while that step ends (a restart takes
    longer than a tiny step); the replacement must serve the new version, or async (admitting by the oldest
    engine's version, syncing only after steps) waits on nothing. On-policy, every step's samples come from
    exactly the trainer's weights (log-prob mismatch at its floor)."""
    cfg = dataclasses.replace(CFG, steps=5, policy_params={"async": {"eta": 0}})
    killed: list[tuple[int, int]] = []

    def chaos(c) -> None:
        training = any(c.role(g) == Role.TRAIN for g in range(c.n_gpus))
        if not training or c.version not in (0, 2) or any(v == c.version for v, _ in killed):
            return
        up = [e for e in c.engines() if e.ready]
        if up:
            killed.append((c.version, up[0].id))
            c.kill_engine(up[0].id)

    r = run_real(cfg, "async", pool=pool, on_tick=chaos)
    assert len(killed) == 2, f"faults fired: {killed}"
    check_run(r, cfg.steps)
    assert r.metrics.staleness["staleness"].max() == 0, "async eta=0 trained a stale sample"
    restarted = [x for x in r.log if x[0] == "note" and x[2] == "engine_restarted"]
    assert len(restarted) == len(killed), f"restarts {restarted} for kills {killed}"
    for x in restarted:
        assert x[3]["version"] == steps_before(r.log, x[1]), f"engine back at a stale version: {x}"
    assert any(x[3]["version"] > steps_before(r.log, f[1]) for x in restarted
               for f in r.log if f[0] == "note" and f[2] == "engine_fault" and f[3]["engine"] == x[3]["engine"]
               and f[1] < x[1]), "no step ended during a restart: the window was not exercised"
    mismatch = r.learning()["logp_mismatch"]
    assert mismatch.max() < 1e-5, f"engines did not serve the trainer's weights: {list(mismatch)}"
