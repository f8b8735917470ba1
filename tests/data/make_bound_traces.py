"""Writes the two hand-built rollout traces the lower bound is tested on (deterministic; run from the repo root).

- bound_prefill_heavy.jsonl: 8 groups of 8 executions, each a 100K-token prompt and 1 generated token
  (one step, meant for 8 GPUs of xlong-swe-small): prefill is nearly all the work.
- bound_long_tool.jsonl: two one-group steps of 16 executions (meant for 4 GPUs of short-math, eta 1):
  group 0 waits on a 3,000 s tool call; group 1 reads 100K-token tool outputs, so it is short in time
  but long to train, and a policy with eta >= 1 may train it first.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from gyre.presets import get_preset
from gyre.traces.schema import write_trace
from gyre.workload import ExecutionSpec, GroupSpec

HERE = Path(__file__).parent


def _spec(eid: int, gid: int, step: int, prompt: int, gen: list[int], tool_s: list[float], tool_out: list[int]):
    kv, ctx = [], prompt
    for i, g in enumerate(gen):
        kv.append(ctx)
        ctx += g + (tool_out[i] if i < len(tool_out) else 0)
    return ExecutionSpec(exec_id=eid, group_id=gid, task_id=gid, step=step, prompt=prompt, gen=gen, tool_s=tool_s,
                         tool_out=tool_out, kv=kv, branches=[], capped=False, deadline_s=math.inf)


def prefill_heavy() -> tuple[list[GroupSpec], object]:
    groups = [GroupSpec(group_id=g, task_id=g, step=0,
                        executions=[_spec(g * 8 + k, g, 0, 100_000, [1], [], []) for k in range(8)]) for g in range(8)]
    w = replace(get_preset("xlong-swe-small").workload, groups_per_step=8, group_size=8, deadline_s=math.inf)
    return groups, w


def long_tool() -> tuple[list[GroupSpec], object]:
    g0 = [_spec(k, 0, 0, 1000, [100, 100], [3000.0], [100]) for k in range(16)]
    g1 = [_spec(16 + k, 1, 1, 1000, [100, 100], [1.0], [100_000]) for k in range(16)]
    groups = [GroupSpec(group_id=0, task_id=0, step=0, executions=g0),
              GroupSpec(group_id=1, task_id=1, step=1, executions=g1)]
    w = replace(get_preset("short-math").workload, groups_per_step=1, group_size=16, context_window=131072,
                summary_tokens=4096)
    return groups, w


def main() -> None:
    g, w = prefill_heavy()
    write_trace(HERE / "bound_prefill_heavy.jsonl", g, workload=w, run={"preset": "xlong-swe-small", "gpus": 8})
    g, w = long_tool()
    write_trace(HERE / "bound_long_tool.jsonl", g, workload=w, run={"preset": "short-math", "gpus": 4})


if __name__ == "__main__":
    main()
