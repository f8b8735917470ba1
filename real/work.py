"""Which deadline cuts of a real run the scheduler may have caused, from what the run measured.

The simulator's count (sim/harness/sched_cuts.py) knows each execution's whole spec, so it can say which cut one would
have finished alone. A real rollout cut at its deadline never ran its rest, so its whole solo latency is
unknown; what is known is a lower bound of it: the part it ran, alone, would have taken at least its tool
time (as measured) plus its generated tokens at the fastest per-token decode any engine of the run
measured (gyre.real engines' `decode` profile records: batch, context, seconds per token), plus its
prefilled tokens at the fastest prefill rate measured. A cut counts as the scheduler's unless that bound
already reaches its deadline (then the rollout was too long for its budget whatever ran it). So on the
real backend `sched_cuts` is an upper bound of the simulator's definition: it is exact for cuts the
workload causes early in a rollout and counts every other cut, which keeps the equal-work ranking
(policies.tuning) from ever favouring a run that cut more. The tokens such a cut lost are unknown and not
reported.

The deadline is the episode's own (`deadline_at`, the wall-clock budget from its first run); an
execution whose episode states none is never cut by one.
"""

from __future__ import annotations

from collections.abc import Iterable

END_DEADLINE = 2  # the finish code of a deadline cut (gyre.real.task_api.Done)


def fastest_rates(profile: dict) -> tuple[float, float]:
    """(decode s per token, prefill s per token): the least of each the run's engines measured (0 if none)."""
    dec = [s for _, _, s in profile.get("engine_decode", []) if s > 0]
    pre = [s / n for n, s in profile.get("engine_prefill", []) if n > 0 and s > 0]
    return min(dec, default=0.0), min(pre, default=0.0)


def solo_lower_bound_s(segs: list[dict], prompt_tokens: int, decode_s: float, prefill_s: float) -> float:
    """The least time the measured segments could have taken alone: tools as measured, generated tokens at
    `decode_s` each, the prompt and every context growth between segments at `prefill_s` per token."""
    tools = sum(float(s.get("tool_s", 0.0)) for s in segs)
    gen = sum(int(s["gen"]) for s in segs)
    grown = sum(max(0, b["kv"] - a["kv"] - int(a["gen"])) for a, b in zip(segs, segs[1:]))
    return tools + gen * decode_s + (prompt_tokens + grown) * prefill_s


def scheduler_cuts(executions: Iterable, profile: dict) -> dict[str, int]:
    """{"sched_cuts": deadline cuts whose run part alone would not already have reached the deadline}.

    `executions`: the run's gyre.real.execution.RealExecution objects (end, started_at, deadline_at, segs,
    group.prompt_tokens); `profile`: the run's profile (RealCluster.close)."""
    decode_s, prefill_s = fastest_rates(profile)
    cuts = 0
    for x in executions:
        if x.end != END_DEADLINE or x.started_at is None:
            continue
        budget = x.deadline_at - x.started_at
        if solo_lower_bound_s(x.segs, x.group.prompt_tokens, decode_s, prefill_s) < budget:
            cuts += 1
    return {"sched_cuts": cuts}
