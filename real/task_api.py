"""The task contract of the real backend: what a user brings to train an agent on their own environment.

A task makes GRPO groups of agent executions and scores them. The backend never looks inside: it admits a
group's executions, drives each one's state machine (`start`, `on_generated`, `on_tool` return the next
request: gyre.real.agent.Generate to the execution's engine, Tool to the tool server, or Done) and, when a
group is trained, asks the task for its executions' rewards (partial credit for truncated ones, as
gyre.trajectory.score_group does). Its tool calls go to the tool server actor, which sleeps a call's
`latency_s` and returns `call.run()` (the tool's output tokens).

The task is chosen by dotted path (`RealClusterConfig.task_class`, TOML `[cluster] task_class =
"pkg.mod:MyTask"`) and built as `cls(config, seed)` with the run's `[cluster.task]` gyre.real.task.TaskConfig
(turn limit, token budget per turn, deadline, tool latencies) and seed. The built-in agent task,
gyre.real.agent.AgentTask, is the default and the reference implementation (its groups are
gyre.real.agent.RealGroup).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

from gyre.trajectory import Score

DEFAULT_TASK = "gyre.real.agent:AgentTask"


@runtime_checkable
class Task(Protocol):
    stop: list[int]  # token ids that end a model segment

    def new_group(self, group_id: int, first_exec_id: int, size: int) -> Any:
        """Group `group_id` of `size` executions numbered from `first_exec_id`, with a `recorder`
        (gyre.trajectory.TaskRecorder), `executions` and `done`, as gyre.real.agent.RealGroup."""
        ...

    def score(self, group: Any) -> list[Score]:
        """One outcome (reward, truncated) per execution of a finished group, in execution order."""
        ...


class TaskError(ValueError):
    """A task class that cannot be loaded or built (one line)."""


def load_task(path: str, config, seed: int) -> Task:
    """The task class at `path` ('pkg.mod:Class' or 'pkg.mod.Class'), built with (config, seed)."""
    mod, _, attr = path.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise TaskError(f"cannot load task {path!r}: {exc}") from None
    task = cls(config, seed)
    if not isinstance(task, Task):
        raise TaskError(f"task {path!r} lacks stop, new_group or score (see gyre.real.task_api.Task)")
    return task
