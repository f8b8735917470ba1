"""Equal work: the work columns of a summary row, counted from the log on a hand-checked run, and rankings
that never choose a run that cut more of its rollouts than the least-cutting candidate."""

from __future__ import annotations

import math
from dataclasses import replace

from gyre.metrics import compute_metrics
from gyre.policies import make_policy
from gyre.policies.tuning import EqualWork, drive, equal_work, fastest_at_equal_work, refine_axis
from gyre.sim.harness.sched_cuts import scheduler_cuts
from gyre.workload import GroupSpec
from tests.simkit import ROUND_COSTS, cluster, spec

# step = 0.01 + 0.01 x batch: 50 tokens/s alone, 33.3 with two sequences, 25 with three; free prefill
COSTS = replace(ROUND_COSTS, step_b=0.01)


def test_summary_counts_the_cuts_the_scheduler_caused_exactly():
    """Of two executions cut by their deadline, the one that alone would have finished in time is a
    scheduler-induced cut, with the tokens it did not decode; the one too long even alone is not."""
    a = spec(0, 0, gen=[100, 100, 100], tool_s=[1.0, 1.0], deadline_s=8.5)  # alone: 3 x 2 s + 2 x 1 s = 8 s
    b = spec(1, 0, gen=[400])  # alone: 8 s, no deadline
    c = spec(2, 0, gen=[100, 100], tool_s=[20.0], deadline_s=10.0)  # alone: 2 + 20 + 2 = 24 s > 10 s
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[a, b, c])
    sim = cluster([g], n_gpus=1, groups_per_step=1, costs=COSTS)
    sim.run(make_policy("colocate"), steps=1)
    # by hand: all start at 3 (wake 2 s + sync 1 s); a and c decode 100 at 25 tok/s to 7; a's tool to 8,
    # b alone 7-8 (150 done); a and b at 33.3 tok/s to 11 (a 200, b 250); a's tool returns at 12, past its
    # deadline 3 + 8.5: cut with 200; b alone to 14; c's tool returns at 27, past 13: cut with 100
    fin = [(round(r[1], 9), r[2], r[3], r[4]) for r in sim.log if r[0] == "finish"]
    assert fin == [(12.0, 0, 2, 200), (14.0, 1, 0, 400), (27.0, 2, 2, 100)], fin
    m = compute_metrics(sim.log, n_gpus=1, policy="colocate")
    m.extra.update(scheduler_cuts(sim.log, [g], COSTS))
    s = m.summary()
    got = {k: s[k] for k in ("completed", "capped", "deadline_hit", "sched_cuts", "sched_cut_tokens_lost",
                             "tokens_generated")}
    assert got == {"completed": 1, "capped": 0, "deadline_hit": 2, "sched_cuts": 1, "sched_cut_tokens_lost": 100,
                   "tokens_generated": 700}, got


def test_a_cut_exactly_at_the_solo_latency_is_the_workloads():
    """An execution whose deadline equals its solo latency is not counted as the scheduler's cut (alone it
    would not have finished before its deadline)."""
    a = spec(0, 0, gen=[100, 100], tool_s=[10.0], deadline_s=14.0)  # alone: 2 + 10 + 2 = 14 s
    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[a])
    log = [("finish", 20.0, 0, 2, 100)]
    assert scheduler_cuts(log, [g], COSTS) == {"sched_cuts": 0, "sched_cut_tokens_lost": 0}
    later = [GroupSpec(group_id=0, task_id=0, step=0, executions=[replace(a, deadline_s=14.5)])]
    assert scheduler_cuts(log, later, COSTS) == {"sched_cuts": 1, "sched_cut_tokens_lost": 100}


def test_ranking_excludes_a_run_that_cut_more_than_one_percent_above_the_least():
    """Hand-built rows: with 2,000 executions (1% = 20), a run 21 cuts above the least is unequal work and
    never the fastest at equal work, however fast; one exactly 20 above still counts."""
    cuts = [5, 10, 26, 25]
    assert equal_work(cuts, 2000) == [True, True, False, True]
    assert fastest_at_equal_work([10.0, 9.0, 5.0, 9.5], cuts, 2000) == 1, "the 5.0 run cut 21 more than the least"
    assert fastest_at_equal_work([10.0, 9.0, 5.0, 9.0], cuts, 2000, tie=[0, 0, 0, -4]) == 3, "a tie goes to the least tie key"
    work = EqualWork(2000)
    assert work.scores([3.0, 2.0], [30, 40]) == [3.0, 2.0], "within 1% of the least seen so far (30)"
    assert work.scores([1.0], [5]) == [1.0] and work.least == 5
    assert work.scores([0.5, 2.0], [40, 25]) == [math.inf, 2.0], "40 is now 35 above the least (5)"


def test_the_split_search_never_picks_a_split_that_cuts_more():
    """Through async's search: when every split above 20 cuts 50 of 1,000 executions (and is faster), the
    search ranked at equal work ends at the fastest split that cuts none; ranked by makespan alone it
    would pick the largest split."""
    values = list(range(1, 33))

    def evaluate(batch):
        return [(100.0 - p["rollout_gpus"], 0 if p["rollout_gpus"] <= 20 else 50) for p in batch]

    tried = drive(refine_axis("rollout_gpus", values, (0,)), evaluate, executions=1000)
    rs = [p["rollout_gpus"] for p, _ in tried]
    m = [m for _, m in tried]
    best = rs[fastest_at_equal_work(m, [evaluate([p])[0][1] for p, _ in tried], 1000)]
    assert best == 20, f"tried {rs}, chose {best}"
    by_time = drive(refine_axis("rollout_gpus", values, (0,)), lambda b: [x[0] for x in evaluate(b)])
    assert min(by_time, key=lambda x: x[1])[0]["rollout_gpus"] == 32, "by makespan alone the largest split wins"


def test_ranking_picks_the_capped_run_over_the_uncapped_one_that_cuts_more():
    """Two rollouts of 4 x 100 tokens with 0.5 s tools and a 10 s deadline on one engine (decode 0.01 + 0.01 x
    batch s per token): alone each takes 4 x 2 + 1.5 = 9.5 s; together a turn takes 3 s and both are cut at
    their deadline, 13 s, after three turns. Async capped at one per engine runs them 3-12.5 and 12.5-22 s,
    uncut. The uncapped run ends first; the ranking at equal work picks the capped one."""
    from gyre.policies.tuning import halvings

    g = GroupSpec(group_id=0, task_id=0, step=0, executions=[spec(i, 0, gen=[100] * 4, tool_s=[0.5] * 3, deadline_s=10.0)
                                                             for i in (0, 1)])
    runs = {}
    for cap in halvings(2):
        sim = cluster([g], n_gpus=2, groups_per_step=1, costs=COSTS)
        sim.run(make_policy("async", rollout_gpus=1, eta=0, max_running=cap), steps=1)
        fin = [(round(r[1], 9), r[2], r[3]) for r in sim.log if r[0] == "finish"]
        runs[cap] = (max(r[1] for r in sim.log), scheduler_cuts(sim.log, [g], COSTS)["sched_cuts"], fin)
    assert runs[2][2] == [(13.0, 0, 2), (13.0, 1, 2)] and runs[2][1] == 2, runs[2]
    assert runs[1][2] == [(12.5, 0, 0), (22.0, 1, 0)] and runs[1][1] == 0, runs[1]
    caps = list(runs)
    assert runs[2][0] < runs[1][0], "the uncapped run ends first"
    best = fastest_at_equal_work([runs[c][0] for c in caps], [runs[c][1] for c in caps], 2)
    assert caps[best] == 1, f"chose cap {caps[best]} of {runs}"


def test_the_cap_search_tries_every_halving_and_keeps_the_fastest_at_equal_work():
    """Through async's split-and-cap search (1,000 executions: 1% = 10): cuts fall by 8 per halving of the
    cap (never more than the tolerance at one step) and a larger split is faster at every cap. The search
    tries every cap at the best split, chooses the largest cap within 10 cuts of the least (cap 2, 8 cuts
    above cap 1's 0), and refines the split there to the largest; the uncapped runs are never the best."""
    from gyre.policies.tuning import halvings, refine_split_and_cap

    caps = halvings(16)
    assert caps == [16, 8, 4, 2, 1], caps
    values = list(range(1, 17))

    def evaluate(batch):
        return [(1000.0 / p["rollout_gpus"] + 100.0 / p["max_running"], 8 * (len(caps) - 1 - caps.index(p["max_running"])))
                for p in batch]

    tried = drive(refine_split_and_cap("rollout_gpus", values, "max_running", caps, (0,)), evaluate, executions=1000)
    ps = [p for p, _ in tried]
    assert {p["max_running"] for p in ps} == set(caps), "every cap was tried"
    assert len(ps) == len({tuple(sorted(p.items())) for p in ps}), "each run reported once"
    measured = evaluate(ps)
    best = ps[fastest_at_equal_work([m for m, _ in measured], [c for _, c in measured], 1000)]
    assert best == {"rollout_gpus": 16, "eta": 0, "max_running": 2}, best
    assert len(ps) < len(values) * len(caps) / 2, f"{len(ps)} runs: the search tried half the grid or more"
