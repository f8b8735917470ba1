"""Moves at the request (CostConfig.move_at = "request"): a decoding execution's migration cancels its in-flight
model request at the source and retries it at the destination. Exact timelines computed by hand from ROUND_COSTS
(100 tokens/s per sequence; engines up 3 s after start; prefill priced where a test sets prefill_s_per_token,
a step then taking 0.01 s + 0.001 s per prefilled token), the log invariants over random moves, and bad input."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.cluster import ClusterError, Phase
from gyre.config import ConfigError, override
from gyre.hardware import CostConfig
from gyre.gpu_time import decompose
from gyre.metrics import compute_metrics
from gyre.presets import get_preset
from gyre.workload import GroupSpec
from tests.logcheck import check_staleness, decode_intervals, kv_occupancy
from tests.simkit import ROUND_COSTS, cluster, spec
from tests.test_log_invariants import _groups

REQUEST = replace(ROUND_COSTS, move_at="request")
PRICED = replace(REQUEST, prefill_s_per_token=0.001)  # a step with m prefill tokens: 0.01 + 0.001 m s


def group(gid: int, *execs) -> GroupSpec:
    return GroupSpec(group_id=gid, task_id=gid, step=0, executions=list(execs))


def records(log, kinds):
    return [(r[0], round(r[1], 9), *(round(v, 9) if isinstance(v, float) else v for v in r[2:]))
            for r in log if r[0] in kinds]


class MoveAt:
    """Engines 0 and 1 (GPUs 0, 1), up at 3 s; the one group's execution admitted to engine 0 at 3 s, migrated to
    engine 1 at `at`; the group trained on GPU 2 once done."""

    name = "move-at"

    def __init__(self, at: float) -> None:
        self.at, self.moved = at, None

    def run(self, c, steps):
        h0, h1 = c.start_engine([0]), c.start_engine([1])
        e0 = yield h0
        e1 = yield h1
        g = c.next_group()
        x = g.executions[0]
        c.admit(x, e0)
        yield c.timeout(self.at - c.now)
        self.phase = x.phase
        self.moved = yield c.migrate(x, e1)
        while not g.done:
            yield c.timeout(0.25)
        yield c.train([2], [g])


# prompt 1000, a 100-token turn, a 1 s tool call returning 200 tokens, then a 300-token turn: on engine 0 the
# prompt prefills 3.0-4.01 (1.01 s), turn 1 decodes to 5.01, the tool returns at 6.01, its 200 tokens prefill to
# 6.22 (0.21 s) and turn 2 decodes from there; the move at 7.22 finds 100 of its 300 tokens decoded
TWO_TURNS = spec(0, 0, gen=[100, 300], tool_s=[1.0], tool_out=[200], prompt=1000)


def test_request_cancelled_mid_decode_is_retried_after_its_reprefill():
    """At 7.22 turn 2 (100 of 300 tokens decoded) is cancelled on engine 0 and retried on engine 1, which
    re-prefills the 1,300-token context before the turn (1.31 s, to 8.53) and decodes all 300 (to 11.53)."""
    c = cluster([group(0, TWO_TURNS)], n_gpus=3, groups_per_step=1, costs=PRICED)
    pol = MoveAt(7.22)
    c.run(pol, 1)
    assert pol.phase == Phase.DECODE and pol.moved is True, (pol.phase, pol.moved)
    assert records(c.log, ("start", "move_request", "migrate", "finish")) == [
        ("start", 3.0, 0, 0),
        ("move_request", 7.22, 0, 0, 1, 100.0, 1.0),  # 100 tokens of a 0.01 s step of a batch of one, 1 GPU
        ("migrate", 7.22, 0, 0, 1),
        ("finish", 11.53, 0, 0, 400),  # nothing lost: every token of both turns, the last 300 from engine 1
    ], records(c.log, ("start", "move_request", "migrate", "finish"))
    busy = records(c.log, ("busy",))
    assert ("busy", 7.22, 0, 0) in busy and ("busy", 8.53, 1, 1) in busy, busy
    m = compute_metrics(c.log, n_gpus=3, policy=pol.name)
    s = m.summary()
    assert (s["request_moves"], s["discarded_tokens"], round(s["discarded_gpu_s"], 9)) == (1, 100.0, 1.0), s
    assert [r[2:] for r in c.log if r[0] == "step"] == [(1, 1, 1000 + 400 + 200)], "trains the kept trajectory"
    # engine 0 decodes 4.01-5.01 and 6.22-7.22, engine 1 8.53-11.53: 5 GPU-s, of which the cancelled 1 s is discarded
    d = decompose(c.log, 3, sync_s=1.0)
    assert (round(d["request_discarded"], 9), round(d["rollout_decoding"], 9)) == (1.0, 4.0), d


def test_request_retried_after_a_kv_read_skips_the_reprefill():
    """migration = "kv_transfer" at 0.0005 s per token: engine 1 reads the 1,300-token context before the turn
    (0.65 s, to 7.87) and decodes the turn's 300 tokens from there, with no prefill (to 10.87)."""
    costs = replace(PRICED, migration="kv_transfer", kv_transfer_s_per_token=0.0005)
    c = cluster([group(0, TWO_TURNS)], n_gpus=3, groups_per_step=1, costs=costs)
    c.run(MoveAt(7.22), 1)
    assert records(c.log, ("move_request", "finish")) == [
        ("move_request", 7.22, 0, 0, 1, 100.0, 1.0),
        ("finish", 10.87, 0, 0, 400),
    ], records(c.log, ("move_request", "finish"))
    assert ("busy", 7.87, 1, 1) in records(c.log, ("busy",)), "decodes once its KV is read"


def test_tool_mode_waits_for_the_boundary():
    """The default move_at = "tool": the same migration waits for a tool-call boundary; turn 2 is the last, so
    the execution finishes on engine 0 at 9.22 and the migration reports it did not move."""
    c = cluster([group(0, TWO_TURNS)], n_gpus=3, groups_per_step=1, costs=replace(PRICED, move_at="tool"))
    pol = MoveAt(7.22)
    c.run(pol, 1)
    assert pol.moved is False, pol.moved
    assert records(c.log, ("move_request", "migrate", "finish")) == [("finish", 9.22, 0, 0, 400)], c.log


def test_request_move_keeps_the_deadline_clock():
    """Deadline 5 s after its start at 3.0 (8.0): turn 1 (300 tokens) is cancelled at 5.01 with 100 decoded,
    re-prefilled on engine 1 to 6.02 and decoded to 9.02, past the deadline, so the execution ends there cut; a
    clock restarted at the move would have let turn 2 finish at 10.52."""
    x = spec(0, 0, gen=[300, 100], tool_s=[0.5], prompt=1000, deadline_s=5.0)
    c = cluster([group(0, x)], n_gpus=3, groups_per_step=1, costs=PRICED)
    c.run(MoveAt(5.01), 1)
    assert records(c.log, ("start", "move_request", "finish")) == [
        ("start", 3.0, 0, 0),
        ("move_request", 5.01, 0, 0, 1, 100.0, 1.0),
        ("finish", 9.02, 0, 2, 300),  # end 2: its deadline
    ], records(c.log, ("start", "move_request", "finish"))


class Credit:
    """Exec 2 (2,000 tokens, one turn) decodes on engine 0 from 3.0 while groups of exec 0 and exec 1 (100
    tokens each) run on engine 1 and train on GPU 2 (versions 1 at 6.5 and 2 at 10.5), both engines syncing
    after each (1 s pauses); at 12.5 exec 2 moves to engine 1 at the request."""

    name = "credit"

    def run(self, c, steps):
        h0, h1 = c.start_engine([0]), c.start_engine([1])
        e0 = yield h0
        e1 = yield h1
        gb, gc, ga = c.next_group(), c.next_group(), c.next_group()
        c.admit(ga.executions[0], e0)
        for g in (gb, gc):
            yield c.admit(g.executions[0], e1)
            yield c.train([2], [g])
            yield c.sync([e0, e1])
        yield c.timeout(12.5 - c.now)
        yield c.migrate(ga.executions[0], e1)
        yield ga.executions[0].handle
        yield c.train([2], [ga])


def test_discarded_tokens_leave_the_version_credit():
    """Exec 2 decodes 350 tokens at v0 (3.0-6.5), 300 at v1 (7.5-10.5) and 100 more to 12.5, all discarded by the
    move; engine 1 (v2) decodes the 2,000 kept tokens 12.5-32.5, trained by the step from v2: staleness 0 and no
    lag, as if the discarded tokens had never been (credited, they would make it staleness 2 and a lag of -300)."""
    groups = [group(0, spec(0, 0, gen=[100])), group(1, spec(1, 1, gen=[100])), group(2, spec(2, 2, gen=[2000]))]
    c = cluster(groups, n_gpus=3, groups_per_step=1, costs=REQUEST)
    c.run(Credit(), 3)
    assert records(c.log, ("step", "move_request", "finish")) == [
        ("finish", 4.0, 0, 0, 100),
        ("step", 6.5, 1, 1, 200),  # onload 0.5 s + 200 tokens x 0.01 s
        ("finish", 8.5, 1, 0, 100),
        ("step", 10.5, 2, 1, 200),
        ("move_request", 12.5, 2, 0, 1, 750.0, 7.5),
        ("finish", 32.5, 2, 0, 2000),
        ("step", 53.5, 3, 1, 2100),
    ], records(c.log, ("step", "move_request", "finish"))
    trained = [r[2:] for r in c.log if r[0] == "trained" and r[2] == 2]
    assert trained == [(2, 2, 2, 0, 0.0, 2000)], trained


class RandomMoves:
    """async (eta) with a second process that every `period` seconds migrates one random decoding execution to a
    random other ready engine, each execution at most once (seeded): request moves at random moments. (Moved
    again and again, an execution whose turn outlasts the period would never finish: each move discards it.)"""

    name = "random-moves"

    def __init__(self, eta: int, seed: int, period: float) -> None:
        self.eta, self.seed, self.period = eta, seed, period

    def run(self, cluster, steps):
        from gyre.policies.async_split import AsyncSplit

        stop = [False]
        cluster.spawn(self._mover(cluster, np.random.default_rng(self.seed), stop), "mover")
        yield from AsyncSplit(eta=self.eta).run(cluster, steps)
        stop[0] = True

    def _mover(self, cluster, rng, stop):
        once: set[int] = set()
        while not stop[0]:
            yield cluster.timeout(self.period)
            ready = [e for e in cluster.engines() if e.ready]
            live = sorted((x for x in cluster.live() if x.phase == Phase.DECODE and x.id not in once),
                          key=lambda x: x.id)
            if live and len(ready) > 1:
                x = live[int(rng.integers(len(live)))]
                once.add(x.id)
                to = [e for e in ready if e.id != x.engine_id]
                cluster.migrate(x, to[int(rng.integers(len(to)))])


def _moved_run(groups, costs, eta, gpus, gps, steps, seed, check, window=131072):
    c = cluster(groups, n_gpus=gpus, groups_per_step=gps, costs=costs, window=window)
    c.check = check
    c.run(RandomMoves(eta, seed, period=0.7), steps)
    assert any(r[0] == "move_request" for r in c.log), "no request moved: nothing tested"
    return c


SLOW_OK = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=12)


@pytest.mark.invariants
@SLOW_OK
@given(seed=st.integers(0, 2**32 - 1), eta=st.integers(0, 2), gpus=st.integers(3, 4), gps=st.integers(1, 2),
       mode=st.sampled_from(["reprefill", "kv_transfer"]))
def test_random_request_moves_keep_the_log_invariants(seed, eta, gpus, gps, mode):
    """Random multi-turn workloads under async with random request moves, free prefill: staleness rebuilt from
    the log bounds every trained execution's recorded oldest version and its lag sum, staleness <= eta; every
    execution that ends done generated every token of its spec (none lost, none twice); the discarded tokens the
    summary reports are the move records'."""
    steps = 3
    groups = _groups(np.random.default_rng(seed), (steps + eta + 3) * gps, 3, turns=4, gen=(100, 600), prompt=(50, 300))
    costs = replace(REQUEST, migration=mode, kv_transfer_s_per_token=0.0005)
    c = _moved_run(groups, costs, eta, gpus, gps, steps, seed, check=False)
    check_staleness(c.log, eta, exact=True)
    want = {x.exec_id: sum(x.gen) for g in groups for x in g.executions}
    for r in c.log:
        if r[0] == "finish" and r[3] == 0:
            assert r[4] == want[r[2]], f"exec {r[2]} finished with {r[4]} tokens, its spec has {want[r[2]]}"
    moves = [r for r in c.log if r[0] == "move_request"]
    s = compute_metrics(c.log, n_gpus=gpus, policy="random-moves").summary()
    assert s["request_moves"] == len(moves) and s["discarded_tokens"] == pytest.approx(sum(r[5] for r in moves)), s
    assert all(r[5] >= 0 and r[6] >= 0 for r in moves), moves


@pytest.mark.invariants
@SLOW_OK
@given(seed=st.integers(0, 2**32 - 1), eta=st.integers(0, 1), gpus=st.integers(3, 4))
def test_random_request_moves_never_overfill_an_engine(seed, eta, gpus):
    """Random single-turn workloads whose contexts outgrow a small engine (6,000 KV tokens, 4 admitted at once),
    random request moves: the KV each engine holds, rebuilt from starts, preemptions, request moves (each ends a
    decoding interval; the retry decodes from none) and finishes at 100 tok/s, never exceeds its capacity; the
    simulator's own checks (check=True) hold after every event."""
    cap = 6000
    groups = _groups(np.random.default_rng(seed), (2 + eta + 3), 3, turns=1, gen=(300, 4800), prompt=(50, 300))
    c = _moved_run(groups, replace(REQUEST, kv_capacity_tokens=cap), eta, gpus, 1, 2, seed, check=True,
                   window=cap // 4)
    prompts = {x.exec_id: x.prompt for g in groups for x in g.executions}
    rate = 1.0 / ROUND_COSTS.step_a
    peak = kv_occupancy(decode_intervals(c.log, prompts, rate, ROUND_COSTS.sync_s), rate, ROUND_COSTS.sync_s, c.log)
    assert max(peak.values()) <= cap + 1e-6, f"an engine held {max(peak.values()):.1f} KV tokens of {cap}"


def test_an_unknown_move_at_is_one_line_naming_the_field():
    """A move_at other than "tool" or "request": one line naming the field, from the config and the simulator."""
    with pytest.raises(ValueError, match=r"^move_at must be 'tool' or 'request', got 'sometimes'$"):
        CostConfig(move_at="sometimes")
    with pytest.raises(ConfigError) as exc:
        override(get_preset("xlong-swe-small"), **{"cluster.cost.move_at": "sometimes"})
    msg = str(exc.value)
    assert "cluster.cost" in msg and "move_at" in msg and "\n" not in msg, msg
    with pytest.raises(ConfigError, match="cost.move_at must be 'tool' or 'request'"):
        cluster([group(0, spec(0, 0, gen=[10]))], n_gpus=1, groups_per_step=1,
                costs=replace(ROUND_COSTS, move_at="now"))


def test_the_real_backend_names_a_bad_move_mode():
    """The real backend takes the simulator's move modes (`move_at = "request"` moves a decoding execution's request
    through the model proxy's cancel and re-issue); a bad value is one line naming the field."""
    pytest.importorskip("ray")
    from gyre.real.component_config import RealClusterConfig

    assert RealClusterConfig(move_at="request").move_in_flight and not RealClusterConfig().move_in_flight
    with pytest.raises(ValueError, match=r"^RealClusterConfig.move_at must be 'tool' or 'request', got 'x'$"):
        RealClusterConfig(move_at="x")
