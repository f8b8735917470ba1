"""The real backend runs a predictor with ordered admission unchanged (local Ray, 4 logical GPUs)."""

from __future__ import annotations

from collections import Counter

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from gyre.policies import make_policy  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.pool import ActorPool  # noqa: E402
from gyre.real.runner import run_real  # noqa: E402

CFG = preset_tiny_test()
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def pool(local_ray):
    return ActorPool.shared(CFG.pool)


def test_async_with_a_predictor_and_ordered_admission_runs_for_real(pool):
    """async with history+siblings, drawing a step ahead: every execution trained once within eta, the
    predictor observed every group, and each trained record counts the execution's generated tokens with a
    per-token lag within [0, its staleness]."""
    policy = make_policy("async", eta=1, predictor="history+siblings", lookahead=1)
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
    notes = [x[3] for x in log if x[0] == "note" and x[2] == "foresight"]
    want = CFG.steps * CFG.cluster.groups_per_step
    assert len(notes) == 1 and notes[0]["groups"] == want, f"foresight notes {notes}, want {want} groups"
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
