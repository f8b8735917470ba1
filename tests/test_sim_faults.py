"""Injected faults in the simulator: exact timelines of an engine kill and a trainer kill by hand, every policy
surviving random faults on random workloads, and one-line refusals of bad specs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gyre.cluster import Role
from gyre.faults import fault_summary
from gyre.policies import REGISTRY, make_policy, takes

FAULTABLE = sorted(REGISTRY)  # waterlevel among them: faults during its streaming steps
from gyre.sim.cluster.backend import SimCluster
from gyre.sim.cli.app import app
from gyre.sim.harness.runner import simulate
from gyre.workload import GroupSpec, ReplaySource
from tests.simkit import ROUND_COSTS, spec, tiny_config, workload
from tests.test_sim_invariants import _check_run

R, S = int(Role.ROLLOUT), int(Role.SWITCHING)
# ROUND_COSTS (100 tokens/s per sequence, step 0.01 s) with a prefill of 1 ms per token on top of the step,
# an engine back 4 s after a crash and a trainer worker 5 s
COSTS = replace(ROUND_COSTS, prefill_s_per_token=0.001, engine_restart_s=4.0, trainer_restart_s=5.0)
KINDS = ("role", "start", "finish", "migrate", "step", "note")
NOTES = ("fault", "engine_fault", "engine_restarted", "trainer_fault", "step_retry", "trainer_recovered")


def run(groups: list[GroupSpec], n_gpus: int, policy, steps: int, faults: tuple[str, ...], seed: int,
        checkpoint_every: int = 0) -> SimCluster:
    src = ReplaySource(groups, workload(1, len(groups[0].executions)))
    c = SimCluster(n_gpus=n_gpus, costs=COSTS, source=src, check=True, faults=faults, seed=seed,
                   checkpoint_every=checkpoint_every)
    c.run(policy, steps=steps)
    return c


def timeline(log, until: float = float("inf"), kinds: tuple[str, ...] = KINDS):
    out = []
    for rec in log:
        if rec[0] not in kinds or rec[1] > until or (rec[0] == "note" and rec[2] not in NOTES):
            continue
        if rec[0] == "note":
            fields = {k: round(v, 9) if isinstance(v, float) else v for k, v in rec[3].items() if k != "spec"}
            out.append((rec[2], round(rec[1], 9), fields))
        else:
            out.append((rec[0], round(rec[1], 9), *rec[2:]))
    return out


def group(gid: int, *execs) -> GroupSpec:
    return GroupSpec(group_id=gid, task_id=gid, step=0, executions=list(execs))


def test_engine_kill_exact_timeline():
    """Colocate on 2 one-GPU engines; engine 0 (the seed's pick) dies mid-decode: the segment's 100 decoded tokens
    are lost, execution 0 moves to engine 1 and re-prefills its 100-token prompt there (one 0.11 s step, which
    execution 1's decode shares), and engine 0 is back 4 s later serving the latest version."""
    a = spec(0, 0, gen=[200, 100], tool_s=[1.0])  # prefill 0.11 s, decode 2 s, tool 1 s, decode 1 s
    b = spec(1, 0, gen=[300])  # prefill 0.11 s, decode 3 s
    c = run([group(0, a, b)], 2, make_policy("colocate"), 1, ("kill-engine@4.11",), seed=4)
    assert timeline(c.log, until=9.0) == [
        ("role", 0.0, (0,), S), ("role", 0.0, (1,), S),  # wake 2 s + weight sync 1 s
        ("role", 3.0, (0,), R), ("role", 3.0, (1,), R),
        ("start", 3.0, 0, 0), ("start", 3.0, 1, 1),  # both decode from 3.11
        ("fault", 4.11, {"fault": "kill-engine", "engine": 0}),
        ("role", 4.11, (0,), S),  # engine 0 restarts
        ("engine_fault", 4.11, {"engine": 0, "executions": [0], "moved": 1, "tokens_lost": 100.0,
                          "reprefill_tokens": 100}),
        ("migrate", 4.11, 0, 0, 1),
        # 0 re-prefills 100 tokens (0.11 s, b decodes 1 token meanwhile), then 200 at 100/s: tool call at 6.22;
        # b's 199 tokens left end at 6.21
        ("finish", 6.21, 1, 0, 300),
        ("role", 8.11, (0,), R),
        ("engine_restarted", 8.11, {"engine": 0, "version": 0, "recovery_s": 4.0}),
        ("finish", 8.22, 0, 0, 300),  # tool 1 s, the last 100 tokens (its context is cached on engine 1)
        ("role", 8.22, (0,), S), ("role", 8.22, (1,), S),  # both engines stop
    ], timeline(c.log, until=9.0)
    fs = fault_summary(c.log)
    assert abs(fs.pop("recovery_s_max") - 4.0) < 1e-9, fs
    assert fs == {"faults": 1, "executions_moved": 1, "respawns": 1, "executions_lost": 0,
                  "executions_duplicated": 0}, fs


def test_engine_kill_with_no_other_engine_waits_for_it():
    """One engine, killed in the execution's tool call: the tool call runs on; once the engine is back the
    execution re-prefills its whole 300-token context (0.31 s) before its last 100 tokens."""
    a = spec(0, 0, gen=[200, 100], tool_s=[1.0])
    c = run([group(0, a)], 1, make_policy("colocate"), 1, ("kill-engine@5.61",), seed=0)
    assert timeline(c.log, until=11.0) == [
        ("role", 0.0, (0,), S), ("role", 3.0, (0,), R), ("start", 3.0, 0, 0),
        ("fault", 5.61, {"fault": "kill-engine", "engine": 0}),
        ("role", 5.61, (0,), S),
        ("engine_fault", 5.61, {"engine": 0, "executions": [0], "moved": 0, "tokens_lost": 0.0,
                          "reprefill_tokens": 300}),
        ("role", 9.61, (0,), R),
        ("engine_restarted", 9.61, {"engine": 0, "version": 0, "recovery_s": 4.0}),
        ("finish", 10.92, 0, 0, 300),  # 9.61 + re-prefill 0.31 s + 100 tokens 1 s
        ("role", 10.92, (0,), S),  # the engine stops
    ], timeline(c.log, until=11.0)


def test_a_group_admitted_while_every_engine_restarts_waits_for_one():
    """Async (R=1, eta=0) on 2 GPUs: its one engine dies at 7 s while step 1 trains (5.61-8.61 s); the next
    group, admitted at 8.61 s with no engine ready, waits on the restarting engine and starts when it is back
    (11 s, serving version 1)."""
    g0, g1 = group(0, spec(0, 0, gen=[200])), group(1, spec(1, 1, gen=[100]))
    c = run([g0, g1], 2, make_policy("async", rollout_gpus=1, eta=0), 2, ("kill-engine@7",), seed=0)
    got = [x for x in timeline(c.log) if x[0] != "role" and x[1] >= 7.0]
    assert got == [
        ("fault", 7.0, {"fault": "kill-engine", "engine": 0}),
        ("engine_fault", 7.0, {"engine": 0, "executions": [], "moved": 0, "tokens_lost": 0.0, "reprefill_tokens": 0}),
        ("step", 8.61, 1, 1, 300),
        ("engine_restarted", 11.0, {"engine": 0, "version": 1, "recovery_s": 4.0}),
        ("start", 11.0, 1, 0),  # prefill 0.11 s, decode 1 s
        ("finish", 12.11, 1, 0, 100),
        ("step", 14.11, 2, 1, 200),
    ], got
    assert timeline([x for x in c.log if x[0] == "admit"], kinds=("admit",))[-1] == ("admit", 8.61, 1, 0), \
        "admitted to the restarting engine"


def trainer_timeline(kill_at: float, every: int, since: float) -> list:
    """Async (R=2, eta=0) on 3 GPUs, two one-execution groups, a trainer kill at `kill_at`: the records from
    `since` on, GPU 2's roles only (the trainer's), without start records."""
    g0, g1 = group(0, spec(0, 0, gen=[200])), group(1, spec(1, 1, gen=[100]))
    c = run([g0, g1], 3, make_policy("async", rollout_gpus=2, eta=0), 2, (f"kill-trainer@{kill_at}",), seed=0,
            checkpoint_every=every)
    return [x for x in timeline(c.log) if x[0] != "start" and (x[0] != "role" or x[2] == (2,)) and x[1] >= since]


def rebuilt_then_step_2(back: float, every: int, lost_at: float) -> list:
    """The state of version 1 rebuilt at `back` (replaying step 1 unless checkpointed), then step 2's 2 s."""
    return [("trainer_recovered", back, {"worker": 2, "version": 1, "from_version": every, "replayed": 1 - every,
                                         "recovery_s": back - lost_at}),
            ("role", back, (2,), int(Role.TRAIN)),
            ("role", back + 2.0, (2,), int(Role.IDLE)),
            ("step", back + 2.0, 2, 1, 200)]


def test_trainer_kill_mid_step_rebuilds_then_retries():
    """Async (R=2, eta=0) on 3 GPUs: step 2 (10.72-12.72 s without faults) loses its only worker at 11.5 s, which
    held the only copy of version 1: it is rebuilt (restart 5 s, then step 1's 3 s replayed; with a checkpoint
    every step, no replay) and step 2 runs again, 2 s."""
    for every, back in ((0, 19.5), (1, 16.5)):
        got = trainer_timeline(11.5, every, since=10.7)
        assert got == [
            ("finish", 10.72, 1, 0, 100),  # admitted at 9.61 after step 1 and its sync, prefill 0.11 s, decode 1 s
            ("role", 10.72, (2,), int(Role.TRAIN)),  # the trainer's state is resident: no onload
            ("fault", 11.5, {"fault": "kill-trainer", "worker": 2, "in_step": True}),
            ("trainer_fault", 11.5, {"worker": 2, "version": 1, "in_step": True, "record": True}),
            ("step_retry", 11.5, {"version": 2, "gpus": [2]}),
            ("role", 11.5, (2,), S),
            *rebuilt_then_step_2(back, every, lost_at=11.5),
        ], (every, got)


def test_trainer_kill_between_steps_delays_the_next():
    """Async as above: its only trainer worker, the sole holder of version 1, dies at 9 s between steps; step 2,
    asked for at 10.72 s, starts once the worker is back (14 s) and the state is rebuilt (step 1 replayed, 3 s;
    none with a checkpoint every step)."""
    for every, back in ((0, 17.0), (1, 14.0)):
        got = trainer_timeline(9, every, since=8.6)
        assert got == [
            ("role", 8.61, (2,), int(Role.IDLE)),
            ("step", 8.61, 1, 1, 300),
            ("fault", 9.0, {"fault": "kill-trainer", "worker": 2, "in_step": False}),
            ("trainer_fault", 9.0, {"worker": 2, "version": 1, "in_step": False, "record": True}),
            ("finish", 10.72, 1, 0, 100),
            ("role", 10.72, (2,), S),
            *rebuilt_then_step_2(back, every, lost_at=9.0),
        ], (every, got)


@pytest.mark.invariants
@settings(deadline=None)
@given(name=st.sampled_from(FAULTABLE), seed=st.integers(0, 10_000), gpus=st.sampled_from([4, 6, 8]),
       eta=st.integers(0, 2), kind=st.sampled_from(["xlong", "math"]),
       faults=st.lists(st.sampled_from(["random-engines:1", "random-engines:3", "random-trainers:3", "kill-engine@30",
                                        "kill-trainer@60", "kill-trainer@150", "delay-sync:20@0", "drop-sync@100"]),
                       min_size=1, max_size=3),
       every=st.sampled_from([0, 1]))
def test_every_policy_survives_random_faults(name, seed, gpus, eta, kind, faults, every):
    """Every registered policy under random faults conserves GPUs and KV at every event, and every execution is
    admitted, finished and trained exactly once within eta; the summary counts nothing lost or duplicated."""
    cfg = replace(tiny_config(gpus=gpus, seed=seed, workload_name=kind), faults=tuple(faults), checkpoint_every=every)
    bounded = takes(name, "eta")
    r = simulate(cfg, name, {"eta": eta} if bounded else {}, check=True)
    _check_run(r, eta if bounded else 0)
    assert r.metrics.extra["kv_peak_frac"] <= 1 + 1e-9, f"{name}: KV over capacity"
    assert r.metrics.extra["executions_lost"] == r.metrics.extra["executions_duplicated"] == 0, name
    kills = sum(1 for x in r.log if x[0] == "note" and x[2] == "fault" and x[3]["fault"].startswith("kill"))
    assert r.metrics.extra["respawns"] == kills, f"{name}: {kills} kills, {r.metrics.extra['respawns']} respawns"


def test_no_faults_same_log_as_without_the_machinery():
    """A run configured with no faults is the very run it was before faults existed: the fault hooks add no
    record, and a fault that cannot fire (too late) changes no record before its moment."""
    cfg = tiny_config(seed=3)
    for name in FAULTABLE:
        params = {"eta": 1} if takes(name, "eta") else {}
        plain = simulate(cfg, name, params)
        late = simulate(replace(cfg, faults=("kill-engine@1000000000",)), name, params)
        assert late.log == plain.log, f"{name}: an unfired fault changed the run"
        assert "faults" not in plain.metrics.extra and late.metrics.extra["faults"] == 0


def test_bad_fault_spec_is_one_line_exit_2(tmp_path):
    """A spec that cannot be read is refused with one line naming it, before anything runs."""
    for args in (["--faults", "kill-engine@soon"], ["--faults", "random-engines:0"], ["--checkpoint-every", "-1"]):
        res = CliRunner().invoke(app, ["run", "--preset", "xlong-swe-small", "--steps", "1", *args,
                                       "--out", str(tmp_path / "out")])
        assert res.exit_code == 2, res.output
        line = res.output.strip()
        assert "\n" not in line and args[1] in line, line
        assert not (tmp_path / "out").exists(), "nothing written for a refused flag"


def test_elastic_resumes_when_every_engine_it_had_restarts():
    """After step 1 (at 29.6 s) elastic's two engines are killed at the same moment (30 s), with no execution on
    them: none is ready until both are back (94.3 s). Elastic looks again once one may be back and admits the next
    batch there; before, its producer slept on a load signal no restart fires ("deadlock at t=94.3s")."""
    cfg = replace(tiny_config(gpus=6, seed=948, workload_name="math"), faults=("kill-engine@30", "kill-engine@30"))
    r = simulate(cfg, "elastic", {"eta": 0})
    back = max(rec[1] for rec in r.log if rec[0] == "note" and rec[2] == "engine_restarted")
    assert back == pytest.approx(94.276, abs=1e-3)
    first = min(rec[1] for rec in r.log if rec[0] == "admit" and rec[1] > 30)
    assert first >= back, f"admitted at {first} while every engine was down"
    assert [rec[2] for rec in r.log if rec[0] == "step"] == [1, 2, 3]
