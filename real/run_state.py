"""The run state saved beside a real run's checkpoint, to continue a killed run: the trainer, the task
sequence and the policy's state.

What it models: a run killed mid-way and started again with the same `[cluster] checkpoint`. Once a step whose
trainer state was checkpointed is booked (the policy has seen it end), `RunState.tick` writes beside the
trainer's checkpoint `<checkpoint>`:

- `<checkpoint>.run.json`: `version` (the trainer version the checkpoint holds), `next_task` (the first index of
  the task sequence no group drew yet) and `redraw` (the indexes of the groups drawn but not trained by that
  version, in order: their rollouts die with the run, so the resumed run draws those tasks again first, then
  goes on from `next_task`). A group counts as trained when a `trained` record of a step the checkpoint holds
  names it (the event log, gyre.metrics schema);
- `<checkpoint>.policy.pkl`: the policy's state with the policy's name, when the policy exposes one.

A policy's state is an optional pair on the policy object: `state()` returns a picklable object, `load_state(obj)`
restores it; a policy with `state()` only must return a dict of its attribute names and values, restored by
setting them. `restore_policy` runs once the policy's `run` has set itself up (right after its first wait),
so state that `run` initialises is restored over that; only for the policy that saved it (another one starts
fresh; a `policy_state` note says which happened).

Simplifications: rollouts in flight at the kill are lost, not resumed; the trainer's checkpoint is written before
`run.json`, so a kill between the two (one step's window) resumes the newer trainer with the older sequence and
trains that step's groups again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path
from typing import Any


def read_run_state(checkpoint: str | None) -> dict | None:
    """What a checkpointed run left for its resumption (None: nothing to resume)."""
    if not checkpoint:
        return None
    p = Path(checkpoint + ".run.json")
    if not (p.exists() and Path(checkpoint).exists()):
        return None
    return json.loads(p.read_text())


def config_from_run_state(cluster_cfg, state: dict | None):
    """The cluster config of a run resuming from `state`: its task sequence continues (a config that sets its
    own first_task or redraw keeps them)."""
    if state is None or cluster_cfg.first_task or cluster_cfg.redraw:
        return cluster_cfg
    return dataclasses.replace(cluster_cfg, first_task=int(state["next_task"]),
                               redraw=tuple(int(i) for i in state.get("redraw", ())))


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # atomic: a kill mid-write leaves the previous file


class RunState:
    """Writes the resume files after each checkpointed step (see the module docstring)."""

    def __init__(self, checkpoint: str, policy: Any, name: str) -> None:
        self.checkpoint, self.policy, self.name = checkpoint, policy, name
        self._last: int | None = None

    def tick(self, c) -> None:
        v = getattr(c, "_ckpt_version", None)
        if v is None or v == self._last or v - c.base_version > c.version:
            return  # no checkpoint yet, written already, or its step is not booked yet
        self._last = v
        held = v - c.base_version  # steps of this run the checkpoint holds
        trained = {rec[3] for rec in c.log if rec[0] == "trained" and rec[4] < held}
        redraw = list(c.cfg.redraw[len(c.groups):]) + [g.task_id for g in c.groups.values() if g.id not in trained]
        next_task = c.cfg.first_task + max(0, len(c.groups) - len(c.cfg.redraw))
        _write(Path(self.checkpoint + ".run.json"), json.dumps(
            {"version": v, "next_task": next_task, "redraw": redraw}).encode())
        if hasattr(self.policy, "state"):
            _write(Path(self.checkpoint + ".policy.pkl"), pickle.dumps({"policy": self.name, "state": self.policy.state()}))


def saved_policy_state(checkpoint: str | None) -> dict | None:
    """{"policy": name, "state": obj} as the checkpointed run saved it, or None."""
    p = Path(f"{checkpoint}.policy.pkl")
    return pickle.loads(p.read_bytes()) if checkpoint and p.exists() else None


def restore_policy(policy: Any, name: str, saved: dict | None, cluster) -> bool:
    """Give `policy` the state `saved` holds if the same policy saved it; a `policy_state` note either way."""
    ok = saved is not None and saved["policy"] == name
    if ok:
        state = saved["state"]
        if hasattr(policy, "load_state"):
            policy.load_state(state)
        else:
            for attr, value in state.items():
                setattr(policy, attr, value)
    cluster.note("policy_state", policy=name, restored=ok, saved_by=None if saved is None else saved["policy"])
    return ok
