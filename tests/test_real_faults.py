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
from gyre.policies import REGISTRY  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.runner import run_real  # noqa: E402
from test_real_cluster import check_run  # noqa: E402

CFG = preset_tiny_test()
pytestmark = pytest.mark.xdist_group("ray")


def steps_before(log, t: float) -> int:
    return sum(1 for x in log if x[0] == "step" and x[1] <= t)


def test_engine_killed_while_a_step_trains_serves_the_new_version(pool):
    """async (eta 0): an engine killed just after a step starts restarts while that step ends (a restart takes
    longer than a tiny step); the replacement must serve the new version, or async (admitting by the oldest
    engine's version, syncing only after steps) waits on nothing. On-policy, every step's samples come from
    exactly the trainer's weights (log-prob mismatch at its floor). A replacement actor takes ~16 s to come up on
    a loaded 2-core machine (a fresh process importing torch), ~5 tiny steps: 12 steps leave it time to."""
    cfg = dataclasses.replace(CFG, steps=12, policy_params={"async": {"eta": 0}})
    killed: list[tuple[int, int]] = []

    def chaos(c) -> None:
        training = any(c.role(g) == Role.TRAIN for g in range(c.n_gpus))
        if not training or c.version not in (0, 1) or any(v == c.version for v, _ in killed):
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
    # a kill late in the run may find it over before its replacement is ready
    assert 1 <= len(restarted) <= len(killed), f"restarts {restarted} for kills {killed}"
    for x in restarted:
        assert x[3]["version"] == steps_before(r.log, x[1]), f"engine back at a stale version: {x}"
    assert any(x[3]["version"] > steps_before(r.log, f[1]) for x in restarted
               for f in r.log if f[0] == "note" and f[2] == "engine_fault" and f[3]["engine"] == x[3]["engine"]
               and f[1] < x[1]), "no step ended during a restart: the window was not exercised"
    mismatch = r.learning()["logp_mismatch"]
    assert mismatch.max() < 1e-5, f"engines did not serve the trainer's weights: {list(mismatch)}"


def check_survived(r, bound: int) -> None:
    """The run completed exactly once per execution, within the staleness bound, with no execution lost or
    duplicated by the summary's count, and every step's samples came from exactly the trainer's weights."""
    from gyre.faults import fault_summary

    check_run(r, len(r.metrics.steps))
    assert r.metrics.staleness["staleness"].max() <= bound, f"{r.policy}: staleness above {bound}"
    fs = fault_summary(r.log)
    assert fs["executions_lost"] == fs["executions_duplicated"] == 0, f"{r.policy}: {fs}"
    mismatch = r.learning()["logp_mismatch"]
    assert 0 < mismatch.max() < 1e-5, f"{r.policy}: engines off the trainer's weights: {list(mismatch)}"


# every sample from the trainer's latest weights
ON_POLICY = {"async": {"eta": 0}, "elastic": {"eta": 0}, "waterlevel": {"eta": 0}}
FAULTABLE = sorted(REGISTRY)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", FAULTABLE)
def test_random_faults_are_survived_by_every_policy(pool, policy, seed):
    """Engines and a trainer worker killed at random moments of the run (seeded), every registered policy
    on-policy (so the log-prob mismatch must stay at its no-fault floor): the run completes, every execution is
    admitted, started, finished and trained exactly once, within the policy's staleness bound."""
    from gyre.faults import fault_summary

    seed = 2 * FAULTABLE.index(policy) + seed
    cluster = dataclasses.replace(CFG.cluster, seed=seed, checkpoint_every=2,
                                  faults=("random-engines:2", "random-trainers:1"))
    cfg = dataclasses.replace(CFG, steps=4, cluster=cluster, policy_params=ON_POLICY)
    r = run_real(cfg, policy, pool=pool)
    check_survived(r, 0)
    fired = [x[3] for x in r.log if x[0] == "note" and x[2] == "fault"]
    # a fault drawn late in the run may find it over before its moment comes
    assert len(fired) >= 2 and len(fired) + len(r.cluster.injector.pending) == 3, f"{policy}: fired {fired}"
    assert fault_summary(r.log)["faults"] == len(fired)


def test_a_trainer_killed_mid_step_is_rebuilt_and_the_step_retried(pool):
    """async (eta 0, one trainer worker, no checkpoint): the worker is killed while it trains step 2, so the
    state of record is gone. It is rebuilt from the starting weights plus step 1's batch (equal to the version 1
    the engines were serving), the step is run again, and versions continue."""
    import torch

    cfg = dataclasses.replace(CFG, steps=3, policy_params={"async": {"eta": 0}},
                              cluster=dataclasses.replace(CFG.cluster, checkpoint_every=0))
    killed, served, rebuilt = [], [], []

    def chaos(c) -> None:
        if not killed and c.version == 1 and c.step_in_flight():
            served.append(ray.get(c._weights))  # version 1, as the engines load it
            killed.append(c.step_in_flight()[0])
            c.kill_trainer(killed[0])
        elif killed and not rebuilt and any(x[0] == "note" and x[2] == "trainer_recovered" for x in c.log):
            # read while the worker still keeps version 1 (it keeps the last 2 published)
            rebuilt.append(ray.get(pool.trainers[killed[0]].weights.remote(1)))

    r = run_real(cfg, "async", pool=pool, on_tick=chaos)
    assert killed, "the fault never fired"
    check_survived(r, 0)
    notes = {x[2]: x[3] for x in r.log if x[0] == "note"}
    assert notes["step_retry"]["version"] == 2, notes.get("step_retry")
    rec = notes["trainer_recovered"]
    assert (rec["from_version"], rec["replayed"], rec["version"]) == (0, 1, 1), rec
    assert r.cluster.trainer_version == 3, "versions did not continue"
    assert rebuilt, "the rebuilt worker's version 1 was never read"
    assert all(torch.allclose(rebuilt[0][k], v, atol=1e-6) for k, v in served[0].items()), "rebuilt != version 1"


def test_a_dropped_sync_is_resent_and_a_delayed_one_arrives_late(pool):
    """async (eta 0): the first sync loses its message to one engine, which the driver sends again after its
    timeout; the second sync reaches every engine 0.5 s late. Every engine still serves each version."""
    from gyre.faults import SYNC_TIMEOUT_S

    cluster = dataclasses.replace(CFG.cluster, faults=("drop-sync@0", "delay-sync:0.5@0"))
    r = run_real(dataclasses.replace(CFG, steps=3, cluster=cluster, policy_params=ON_POLICY), "async", pool=pool)
    check_survived(r, 0)
    faults = [x for x in r.log if x[0] == "note" and x[2] == "fault"]
    assert [f[3]["fault"] for f in faults] == ["drop-sync", "delay-sync"], faults
    dropped, t_drop = faults[0][3]["engine"], faults[0][1]
    resent = [x for x in r.log if x[0] == "note" and x[2] == "sync_resent"]
    assert [x[3] for x in resent] == [{"engine": dropped, "version": 1}], resent
    late = [x for x in r.log if x[0] == "sync" and x[2] == dropped and x[3] == 1]
    assert len(late) == 1 and late[0][1] >= t_drop + SYNC_TIMEOUT_S, (late, t_drop)
    step2 = next(x[1] for x in r.log if x[0] == "step" and x[2] == 2)
    v2 = [x[1] for x in r.log if x[0] == "sync" and x[3] == 2]
    assert len(v2) == 3 and min(v2) >= step2 + 0.5, (v2, step2)


@pytest.mark.parametrize("spec", ["kill-engine", "kill-engine@soon", "random-engines:0", "delay-sync:0@1",
                                  "explode@1"])
def test_a_bad_fault_spec_is_one_line(tmp_path, spec):
    """A fault spec that cannot be read is one line naming the flag and the value, exit 2, before any actor."""
    from typer.testing import CliRunner

    from gyre.real.cli import app

    res = CliRunner().invoke(app, ["run", "--policy", "async", "--preset", "tiny-test", "--faults", spec,
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "\n" not in line and f"--faults {spec}:" in line, line
    assert not (tmp_path / "out").exists(), "nothing written for a refused spec"


def test_fault_specs_resolve_from_the_seed():
    """Random faults are drawn from the run's seed: the same seed gives the same moments, another seed others;
    fixed faults keep their times."""
    from gyre.faults import FaultInjector, parse_faults

    faults = parse_faults(["random-engines:3", "kill-trainer@4.0", "delay-sync:0.5@2"])
    assert [f.kind for f in faults] == ["kill-engine"] * 3 + ["kill-trainer", "delay-sync"]
    a, b, c = (FaultInjector(faults, s).pending for s in (7, 7, 8))
    assert a == b and a != c, "random moments not a function of the seed"
    assert all(0 <= f.at_progress <= 0.9 and 0 <= f.delay_s <= 1 for f in a[:3]), a
    assert a[3].at_s == 4.0 and a[4].sync_delay_s == 0.5 and a[4].at_s == 2.0


def test_fault_summary_counts_from_the_log():
    """Lost and duplicated executions are counted from the records, not assumed."""
    from gyre.faults import fault_summary

    log = [("admit", 0.0, 1, 0), ("admit", 0.0, 2, 0), ("admit", 0.0, 3, 0), ("start", 0.1, 1, 0),
           ("start", 0.1, 2, 0), ("start", 0.2, 2, 1), ("note", 0.5, "fault", {"fault": "kill-engine"}),
           ("note", 0.5, "engine_fault", {"engine": 0, "executions": [1, 2], "moved": 2}),
           ("note", 2.0, "engine_restarted", {"engine": 0, "version": 0, "recovery_s": 1.5}),
           ("finish", 1.0, 1, 0, 5), ("finish", 1.0, 2, 0, 5), ("trained", 3.0, 1, 0, 1, 0),
           ("trained", 3.0, 2, 0, 1, 0)]
    assert fault_summary(log) == {"faults": 1, "executions_moved": 2, "respawns": 1, "recovery_s_max": 1.5,
                                  "executions_lost": 1, "executions_duplicated": 1}
