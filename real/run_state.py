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
- `<checkpoint>.policy.json`: the policy's state with the policy's name, when the policy exposes one, as data
  (`encode_state`: JSON of None, booleans, numbers, strings, lists, and tuples and dicts tagged so they come back
  as they were). A resumed run reads nothing else: a checkpoint folder can come from anywhere, and unpickling
  runs code, so a `<checkpoint>.policy.pkl` (what older runs wrote) is refused in one line, as is a JSON file
  with anything but these types.

A policy's state is an optional pair on the policy object: `state()` returns such data, `load_state(obj)`
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


class RunStateError(ValueError):
    """A saved policy state that is not data (one line naming the file)."""


def encode_state(obj: Any, where: str = "state") -> Any:
    """`obj` as JSON-ready data; a TypeError names the first value that is not None, bool, int, float, str, list,
    tuple or dict (numpy scalars count as numbers)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "dtype") and getattr(obj, "shape", None) == ():  # a numpy scalar
        return obj.item()
    if isinstance(obj, list):
        return [encode_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        items = obj.items()
        return {"__dict__": [[encode_state(k, f"{where} key"), encode_state(v, f"{where}[{k!r}]")] for k, v in items]}
    raise TypeError(f"policy state: {where} is a {type(obj).__name__}, not data (None, bool, int, float, str, list, "
                    f"tuple, dict)")


def decode_state(obj: Any, where: str = "state") -> Any:
    """The inverse of `encode_state`; a RunStateError names anything else."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [decode_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict) and set(obj) == {"__tuple__"} and isinstance(obj["__tuple__"], list):
        return tuple(decode_state(v, f"{where}[{i}]") for i, v in enumerate(obj["__tuple__"]))
    if isinstance(obj, dict) and set(obj) == {"__dict__"} and isinstance(obj["__dict__"], list):
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in obj["__dict__"]):
            raise RunStateError(f"{where}: a dict's items must be [key, value] pairs")
        return {_key(decode_state(k, where), where): decode_state(v, f"{where}[{k!r}]") for k, v in obj["__dict__"]}
    raise RunStateError(f"{where}: {json.dumps(obj)[:60]} is not encoded policy state "
                        f"(gyre.real.run_state.encode_state)")


def _key(k: Any, where: str) -> Any:
    try:
        hash(k)
    except TypeError:
        raise RunStateError(f"{where}: a dict key {k!r} is not hashable") from None
    return k


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
            state = encode_state(self.policy.state())
            _write(Path(self.checkpoint + ".policy.json"), json.dumps({"policy": self.name, "state": state}).encode())


def saved_policy_state(checkpoint: str | None) -> dict | None:
    """{"policy": name, "state": obj} as the checkpointed run saved it, or None; a RunStateError (one line, naming
    the file) for a pickled state or a file that is not encoded data."""
    if not checkpoint:
        return None
    old = Path(f"{checkpoint}.policy.pkl")
    if old.exists():
        raise RunStateError(f"{old}: a pickled policy state is not loaded (unpickling can run code); remove it to "
                            f"resume with a fresh policy state, or resume from a checkpoint that saved .policy.json")
    p = Path(f"{checkpoint}.policy.json")
    if not p.exists():
        return None
    try:
        raw = json.loads(p.read_text())
        if not (isinstance(raw, dict) and isinstance(raw.get("policy"), str) and "state" in raw):
            raise RunStateError("expected {\"policy\": name, \"state\": data}")
        return {"policy": raw["policy"], "state": decode_state(raw["state"])}
    except (ValueError, UnicodeDecodeError) as exc:  # RunStateError and JSONDecodeError are ValueErrors
        raise RunStateError(f"{p}: {exc}") from None


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
