"""The cluster interface: everything a scheduling policy may see and do.

Why exactly this surface: a scheduling policy for agent RL decides (1) which GPUs host inference
engines and which train, (2) which engine runs each execution, and when to move a live execution
(only at a tool-call boundary, never interrupting it) or park it off every engine and resume it later
on any engine (partial rollouts: its KV is freed and re-prefilled on resume; nothing is lost), and (3) when to train on which groups, on
which GPUs, and when engines receive the new weights. Training is either one step on a fixed GPU set once its
batch has finished (`train`) or a streaming step on cells (`open_step`, `join_step`, `leave_step`: the batch
trains in micro-steps as its groups finish, and cells join or leave while it runs). Those are the verbs below; each returns a Handle
that completes later. Observations are the pool's roles, the engines and their load, the live
executions' observable progress (never their future length), the trainer's version, the clock, and a
cost estimate (gyre.estimate.CostEstimate: what a training step of a batch and an engine step cost here,
from the hardware and model, never from the workload's future) and `trained_share`: what the latest finished step
trained (tokens, attention-context sum) over what exact training of its batch would have trained, (1.0, 1.0)
before any step and while every path trains (role-bounded path sampling, gyre.trajectory.sample, trains fewer).
An engine's `admit_limit` is how many executions it may be handed at once (gyre.hardware.admission_limit);
the backends report it and do not enforce it: policies.admit_queue is the admission path that does.

A policy is a generator `run(cluster, steps)` that yields handles. It must not import a backend:
the simulator (gyre.sim) and the Ray executor (gyre.real) both implement `Cluster`.
"""

from __future__ import annotations

import enum
from collections.abc import Generator, Sequence
from typing import Any, Protocol, runtime_checkable

from gyre.estimate import CostEstimate
from gyre.handles import Handle


class ClusterError(RuntimeError):
    """A verb was used in a way the cluster cannot honour (a policy bug, reported in one line)."""


class Role(enum.IntEnum):
    IDLE = 0
    ROLLOUT = 1
    TRAIN = 2
    SWITCHING = 3


class Phase(enum.IntEnum):
    QUEUED = 0  # admitted, waiting for engine memory
    PREFILL = 1  # prompt or tool output (or a migrated context) being prefilled
    DECODE = 2  # generating a segment
    TOOL = 3  # waiting for a tool call (a tool-call boundary: migratable)
    DONE = 4
    PARKED = 5  # off every engine (KV freed) until resumed; its tool call, if any, keeps running


@runtime_checkable
class EngineView(Protocol):
    """One inference engine as a policy sees it; both backends give every member the meaning stated here
    (tests/test_contracts.py checks their members against this Protocol)."""

    id: int  # its engine id, unique in the run
    gpus: tuple[int, ...]  # the GPUs it holds

    @property
    def version(self) -> int: ...  # policy version of the weights it serves (starting, restarting: will serve)
    @property
    def ready(self) -> bool: ...  # started and not stopping or restarting: it generates, takes syncs and migrations
    @property
    def n_live(self) -> int: ...  # executions it holds (any phase but DONE)
    @property
    def n_decoding(self) -> int: ...  # executions generating tokens now (phase DECODE); prefills are not counted
    @property
    def n_queued(self) -> int: ...  # executions waiting for its KV memory to start (phase QUEUED)
    @property
    def kv_used(self) -> float: ...  # KV tokens its memory holds now: the contexts of the members holding KV
    # (decoding, prefilling, or cached between turns) and, where the backend models them, a hybrid model's
    # per-sequence states in KV-token units; never more than kv_capacity
    @property
    def kv_capacity(self) -> int: ...  # KV tokens its memory holds at most
    @property
    def admit_limit(self) -> int: ...  # executions it may hold at once (gyre.hardware.admission_limit)


@runtime_checkable
class ExecutionView(Protocol):
    id: int
    group_id: int
    task_id: int

    @property
    def engine_id(self) -> int | None: ...
    @property
    def phase(self) -> Phase: ...
    @property
    def first_version(self) -> int | None: ...  # version that produced its oldest token
    @property
    def started_at(self) -> float | None: ...
    @property
    def turns_done(self) -> int: ...
    @property
    def deadline_at(self) -> float: ...  # when its wall-clock budget ends (inf until it first runs, or with none)
    @property
    def context_tokens(self) -> int: ...  # KV tokens it holds (its current context)
    @property
    def trajectory_tokens(self) -> int: ...  # prompt, generated and tool-output tokens so far (what training trains)


@runtime_checkable
class Group(Protocol):
    """One task's GRPO group as a policy sees it."""

    id: int  # its group id, in issue order
    task_id: int  # the task its executions attempt
    executions: Sequence[ExecutionView]  # its rollouts, in id order

    @property
    def done(self) -> bool: ...  # every execution finished (trainable)


@runtime_checkable
class StepView(Protocol):
    """A streaming training step (`Cluster.open_step`) as a policy sees it.

    The step trains one batch on the weights of `version`, fixed while it runs (gradients accumulate), in
    micro-steps: each finished group of the batch becomes trainable micro-steps (one per execution: its
    trajectory's packed tree), queued in finish order; each cell trains one micro-step at a time, taking
    the next from the queue as it frees up. The first cell is the core (it holds the optimizer state);
    satellites join with a pull of the core's weight snapshot and may leave between micro-steps. The step
    ends once every micro-step is trained and the cells' gradients are reduced into the core, which steps
    the optimizer: the version moves then. A batch may open with fewer than `groups_per_step` groups and
    grow (`extend_step`, up to `groups_per_step`) while it trains; the step ends only once its batch holds at
    least `groups_per_step`."""

    @property
    def version(self) -> int: ...  # the weights it trains on; it produces version + 1
    @property
    def groups(self) -> Sequence[Group]: ...  # its batch
    @property
    def cells(self) -> list[tuple[int, ...]]: ...  # GPU sets in the step (joining ones too), the core first
    @property
    def n_queued(self) -> int: ...  # micro-steps trainable and not taken by a cell
    @property
    def n_untrained(self) -> int: ...  # micro-steps not trained yet, those of unfinished groups included
    @property
    def done(self) -> bool: ...  # the version has moved


@runtime_checkable
class Cluster(Protocol):
    # --- observations ---
    @property
    def now(self) -> float: ...
    @property
    def n_gpus(self) -> int: ...
    @property
    def gpus_per_engine(self) -> int: ...
    @property
    def min_train_gpus(self) -> int: ...
    @property
    def version(self) -> int: ...  # trainer's latest policy version (steps done)
    @property
    def groups_per_step(self) -> int: ...
    @property
    def cell_gpus(self) -> int: ...  # GPUs in one training cell (a cluster setting; gyre.config.ClusterConfig)
    @property
    def standalone_gpus(self) -> int: ...  # GPUs of the standalone rollout pool: the last ones, never training
    def cells(self) -> list[tuple[int, ...]]: ...  # the cells in order (cell 0 first), the pool excluded
    @property
    def training(self) -> StepView | None: ...  # the open streaming step, if any
    @property
    def steps_per_burst(self) -> int: ...  # mu: training steps per weight publication
    @property
    def published_version(self) -> int: ...  # the latest version engines may serve (every mu steps: a burst)
    def role(self, gpu: int) -> Role: ...
    def free_gpus(self) -> list[int]: ...  # IDLE and not held by an engine or a training step
    def engines(self) -> list[EngineView]: ...
    def live(self) -> list[ExecutionView]: ...  # on an engine
    def parked(self) -> list[ExecutionView]: ...  # parked, not yet resumed
    @property
    def estimate(self) -> CostEstimate: ...  # what a training step and an engine step cost (gyre.estimate)
    @property
    def trained_share(self) -> tuple[float, float]: ...  # latest finished step: trained / exact (tokens, attention)

    # --- verbs (each returns a Handle) ---
    def next_group(self) -> Group: ...
    def start_engine(self, gpus: Sequence[int]) -> Handle: ...  # -> EngineView, serving the latest weights
    def stop_engine(self, engine: EngineView) -> Handle: ...  # engine must hold no execution
    def admit(self, execution: ExecutionView, engine: EngineView) -> Handle: ...  # -> finished ExecutionView
    def migrate(self, execution: ExecutionView, engine: EngineView) -> Handle: ...  # -> bool (moved)
    def park(self, execution: ExecutionView) -> Handle: ...  # -> bool (parked at its next tool-call boundary)
    def resume(self, execution: ExecutionView, engine: EngineView) -> Handle: ...  # -> True (re-prefills there)
    def train(self, gpus: Sequence[int], groups: Sequence[Group]) -> Handle: ...  # -> new version
    def open_step(self, gpus: Sequence[int], groups: Sequence[Group]) -> Handle: ...  # -> new version (streaming)
    def extend_step(self, groups: Sequence[Group]) -> Handle: ...  # -> None at once: groups join the open batch
    def join_step(self, gpus: Sequence[int]) -> Handle: ...  # -> True once the cell trains (switched, weights pulled)
    def leave_step(self, gpus: Sequence[int]) -> Handle: ...  # -> None once the cell is free (between micro-steps)
    def sync(self, engines: Sequence[EngineView]) -> Handle: ...  # engines serve the latest published version
    def timeout(self, seconds: float) -> Handle: ...
    def spawn(self, gen: Generator[Handle, Any, Any], label: str = "") -> Handle: ...
    def note(self, kind: str, **fields: Any) -> None: ...  # a policy's own annotation in the event log


class Policy(Protocol):
    """A scheduling policy: `run` drives the cluster until `steps` training steps are done."""

    name: str

    def run(self, cluster: Cluster, steps: int) -> Generator[Handle, Any, Any]: ...
