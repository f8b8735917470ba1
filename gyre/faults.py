"""Injected faults, one grammar for both backends: what a fault spec means, when each fires, and what a run
survived.

A run's faults are strings (`RealClusterConfig.faults` and `gyre-real run --faults`; `RunConfig.faults` and
`gyre-sim run --faults`):
- `kill-engine@T`: T seconds after the run starts, kill one ready engine (chosen by the seed; if none is
  ready then, the first that is);
- `kill-trainer@T`: kill a trainer worker: a rank of the step in flight (chosen by the seed), else the
  worker of record (the one holding the latest state);
- `random-engines:N`, `random-trainers:N`: N such kills at random moments of the whole run, drawn from the
  run's seed: each fires once a random fraction f (uniform on [0, 0.9]) of the run's executions finished,
  after a random part u (uniform on [0, 1]) of the mean time between finishes so far, so kills fall across
  the run whatever its length, in generation and in training alike (one drawn late may find the run over);
- `delay-sync:S@T`: the first weight sync at or after T reaches its engines S seconds late;
- `drop-sync@T`: the first weight sync at or after T loses its message to one engine (chosen by the seed);
  the driver's sync timeout (`SYNC_TIMEOUT_S`) sends it again.
Each fault, when it fires, is a `fault` note in the run's log. `fault_summary` counts from the log what the
run survived: faults, executions moved, engines and trainer workers respawned, the longest recovery, and
executions lost or duplicated (counted from the admit/start/finish/trained records, not assumed).

`FaultInjector` decides when and on what each fault fires; a backend carries the fault out through a
`FaultTarget` (`kill_engine(id)`, `kill_trainer(gpu)`, `step_in_flight()`, `worker_of_record()`, and what it reads
of the run) and, in its `sync`, `take_sync_fault`. The real backend calls `tick` from its run loop; the simulator calls it at the moments
`wake_at` names and after each finish.

Simplifications: the real backend injects faults from the driver (ray.kill of an actor, a sync held back or
not sent), the simulator by its model of the same loss (gyre.sim.cluster.faults); a node's loss, a lost object, or a
driver crash are not modelled.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from gyre.cluster import EngineView

LAST_PROGRESS = 0.9  # random faults fire before this fraction of the executions finished (+ a gap's share)
SYNC_TIMEOUT_S = 3.0  # a weight load with no reply after this long is sent again
KILLS = ("kill-engine", "kill-trainer")
FORMS = "kill-engine@T, kill-trainer@T, random-engines:N, random-trainers:N, delay-sync:S@T, drop-sync@T"
_SPEC = re.compile(r"^(kill-engine|kill-trainer|drop-sync)@([0-9.]+)$|^(random-engines|random-trainers):([0-9]+)$"
                   r"|^delay-sync:([0-9.]+)@([0-9.]+)$")


class FaultSpecError(ValueError):
    """A fault spec that cannot be read (a one-line message naming it)."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str  # "kill-engine", "kill-trainer", "delay-sync", "drop-sync"
    spec: str  # the spec it came from
    at_s: float | None = None  # fires at this time (s since the run started)
    at_progress: float | None = None  # or once this fraction of the run's executions finished (+ delay_s)
    delay_s: float = 0.0  # progress faults: the share of the mean time between finishes to wait after it
    sync_delay_s: float = 0.0  # delay-sync: how late the sync arrives


def _number(text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise FaultSpecError(f"fault {spec!r}: {text!r} is not a number") from None


def parse_faults(specs: tuple[str, ...] | list[str]) -> tuple[Fault, ...]:
    """The faults of these specs, random ones unresolved (FaultInjector draws them from the run's seed)."""
    out = []
    for spec in specs:
        m = _SPEC.match(str(spec).strip())
        if m is None:
            raise FaultSpecError(f"fault {spec!r}: not a fault spec (forms: {FORMS})")
        if m.group(1):
            out.append(Fault(kind=m.group(1), spec=spec, at_s=_number(m.group(2), spec)))
        elif m.group(3):
            n = int(m.group(4))
            if n < 1:
                raise FaultSpecError(f"fault {spec!r}: the number of faults must be >= 1")
            kind = "kill-engine" if m.group(3) == "random-engines" else "kill-trainer"
            out += [Fault(kind=kind, spec=spec, at_progress=-1.0) for _ in range(n)]
        else:
            delay = _number(m.group(5), spec)
            if delay <= 0:
                raise FaultSpecError(f"fault {spec!r}: the delay must be > 0")
            out.append(Fault(kind="delay-sync", spec=spec, at_s=_number(m.group(6), spec), sync_delay_s=delay))
    return tuple(out)


def spec_error(specs: tuple[str, ...] | list[str]) -> str | None:
    """The CLI's one line for the first spec that cannot be read ("--faults SPEC: why"), or None."""
    for spec in specs:
        try:
            parse_faults([spec])
        except FaultSpecError as exc:
            return f"--faults {spec}: {exc}"
    return None


@runtime_checkable
class FaultTarget(Protocol):
    """What FaultInjector reads of a run and does to it (gyre.real.backend.RealCluster,
    gyre.sim.cluster.faults.SimFaults)."""

    @property
    def now(self) -> float: ...  # seconds since the run started
    @property
    def log(self) -> list[tuple]: ...  # the run's event log (finishes are counted from it)
    def engines(self) -> list[EngineView]: ...  # the engines listed now; a kill picks a ready one
    def note(self, kind: str, **fields: Any) -> None: ...  # a "note" record in the log
    def kill_engine(self, engine_id: int) -> None: ...  # the engine's process dies now
    def kill_trainer(self, gpu: int) -> None: ...  # the trainer worker on that GPU dies now
    def step_in_flight(self) -> tuple[int, ...]: ...  # the GPUs of the training step running now (() if none)
    def worker_of_record(self) -> int | None: ...  # the GPU whose worker holds the latest state (None: lost)


class FaultInjector:
    """Fires a run's faults at their moments (`tick`, from the run loop); sync faults wait for a sync."""

    def __init__(self, faults: tuple[Fault, ...], seed: int) -> None:
        self.rng = np.random.default_rng([seed, 0xFA17])
        self.pending = [self._resolve(f) for f in faults]
        self.due_at: dict[int, float] = {}  # index in pending -> time a progress fault fires
        self.total = 1
        self.finished = 0
        self._seen = 0

    def _resolve(self, f: Fault) -> Fault:
        if f.at_progress is None:
            return f
        return Fault(kind=f.kind, spec=f.spec, at_progress=float(self.rng.uniform(0.0, LAST_PROGRESS)),
                     delay_s=float(self.rng.uniform(0.0, 1.0)))

    def start(self, total_executions: int) -> None:
        self.total = max(1, total_executions)

    @property
    def active(self) -> bool:
        return bool(self.pending)

    def _due(self, i: int, f: Fault, cluster) -> bool:
        if f.at_s is not None:
            return cluster.now >= f.at_s
        if i not in self.due_at and self.finished / self.total >= f.at_progress:  # delay_s: a share of the gap
            self.due_at[i] = cluster.now + f.delay_s * cluster.now / max(1, self.finished)
        return i in self.due_at and cluster.now >= self.due_at[i]

    def wake_at(self, now: float) -> float:
        """When `tick` must next run for a kill fault to fire on time: `now` if one is due (it may wait for a
        target), else the earliest known moment (inf: none known; a progress fault waits for finishes)."""
        t = math.inf
        for i, f in enumerate(self.pending):
            if f.kind in KILLS:
                due = f.at_s if f.at_s is not None else self.due_at.get(i)
                if due is not None:
                    t = min(t, max(due, now))
        return t

    def tick(self, cluster) -> None:
        """Fire every kill fault that is due and has a target now."""
        if not self.pending:
            return
        log = cluster.log
        self.finished += sum(1 for x in log[self._seen:] if x[0] == "finish")
        self._seen = len(log)
        keep = []
        for i, f in enumerate(self.pending):
            if f.kind in KILLS and self._due(i, f, cluster) and self._fire(f, cluster):
                continue
            keep.append((i, f))
        self.due_at = {j: self.due_at[i] for j, (i, _) in enumerate(keep) if i in self.due_at}
        self.pending = [f for _, f in keep]

    def _fire(self, f: Fault, cluster) -> bool:
        if f.kind == "kill-engine":
            up = sorted((e for e in cluster.engines() if e.ready), key=lambda e: e.id)
            if not up:
                return False
            target = up[int(self.rng.integers(len(up)))].id
            self._note(cluster, f, engine=target)
            cluster.kill_engine(target)
            return True
        step = cluster.step_in_flight()
        if step:
            target = step[int(self.rng.integers(len(step)))]
        elif cluster.worker_of_record() is not None:
            target = cluster.worker_of_record()
        else:
            return False
        self._note(cluster, f, worker=target, in_step=bool(step))
        cluster.kill_trainer(target)
        return True

    def take_sync_fault(self, cluster, engines: list) -> tuple[str, float | int] | None:
        """A sync fault due now, as ("delay", seconds) or ("drop", engine id), or None."""
        for i, f in enumerate(self.pending):
            if f.kind in ("delay-sync", "drop-sync") and cluster.now >= f.at_s:
                del self.pending[i]
                self.due_at = {(j - 1 if j > i else j): t for j, t in self.due_at.items() if j != i}
                if f.kind == "delay-sync":
                    self._note(cluster, f, delay_s=f.sync_delay_s)
                    return ("delay", f.sync_delay_s)
                target = sorted(e.id for e in engines)[int(self.rng.integers(len(engines)))]
                self._note(cluster, f, engine=target)
                return ("drop", target)
        return None

    @staticmethod
    def _note(cluster, f: Fault, **fields) -> None:
        cluster.note("fault", fault=f.kind, spec=f.spec, **fields)


def fault_summary(log: list[tuple]) -> dict[str, float | int]:
    """What a run survived, counted from its log (the summary.csv columns)."""
    notes = [x for x in log if x[0] == "note"]
    kinds = Counter(x[2] for x in notes)
    recov = [x[3]["recovery_s"] for x in notes if x[2] in ("engine_restarted", "trainer_recovered")]
    admitted = Counter(x[2] for x in log if x[0] == "admit")
    counts = [Counter(x[2] for x in log if x[0] == k) for k in ("start", "finish", "trained")]
    done = set(counts[1]) & set(counts[2])
    dup = {i for c in [admitted, *counts] for i, n in c.items() if n > 1}
    return {
        "faults": kinds["fault"],
        "executions_moved": sum(x[3].get("moved", 0) for x in notes if x[2] == "engine_fault"),
        "respawns": kinds["engine_fault"] + kinds["trainer_fault"],
        "recovery_s_max": max(recov, default=0.0),
        "executions_lost": sum(1 for i in admitted if i not in done),
        "executions_duplicated": len(dup),
    }
