"""The environment contract of the real backend: what a user brings to train an agent on their own task.

The backend touches a task through these three Protocols and nothing else (tests/test_real_contract.py runs
a real run with proxies that fail on any other attribute):

- `Task`: built as `cls(config, seed)`, its `config` an instance of the class's `config_class` dataclass
  (the run's `[cluster.task]` table sets any field it declares). `stop` are the token ids that end a model
  segment; `max_context` the most tokens an episode's context holds (an engine is handed only as many
  executions as its KV memory holds at that size). `new_group(index, size)` is the `index`-th task of the run's
  task sequence as a GRPO group of `size` episodes; a resumed run continues the sequence (the indexes the
  checkpointed run drew but never trained again first, then the one after the last it drew: gyre.real.run_state),
  so a group must depend on (seed, index) only. `score(group)` is one Score per episode once all are done:
  truncated ones scored on the state they reached (partial credit). It runs on a tool worker, on a copy of the
  task and the group, as soon as the group's last episode ends (gyre.real.verify), so it must be pure. Optional:
  `score_failed(group, message)`, the scores of the episodes whose evaluation still failed (raised, hung, lost its
  worker, or scored `outcome="failed"`) after its retries (default: they leave training; raise to end the run).
  A Score's `outcome` (gyre.trajectory.credit) also says "placeholder" (nothing was evaluable: reward 0, kept)
  or "overall_timeout" (dropped).
- `TaskGroup`: `prompt` (the shared prompt's token ids, the prefix tree's root), `recorder` (the
  gyre.trajectory.TaskRecorder its episodes record into: the tokens the model generated are trained, the
  tool and environment tokens are context only) and `episodes`.
- `Episode`: a state machine that performs no I/O. `start(now)` (reset: the first request, for the prompt),
  `on_generated(tokens, logprobs, version, now)` (a model segment) and `on_tool(result, now)` (a tool call's
  output, or a `ToolError` when the call failed, hung past its timeout or lost its worker) each return the
  next request: `Generate` (a segment to the episode's engine), `Tool` (a call to the tool service) or `Done`
  (a final answer, or a truncation: turn cap or deadline). Optional: `deadline_at`, when its wall-clock budget
  ends (the backend's clock; inf before it starts), which policies see (gyre.cluster.ExecutionView);
  `on_generated_all(results, now)`, needed by an episode that returns a `Generate` with `parallel` segments:
  `results` holds (tokens, logprobs, version, done) per segment, the Generate's own first, then its parallel
  ones in order, `done` the backend's clock when that segment came back.

Why exactly this: the backend owns scheduling (engines, migrations, faults, training) and must be able to
move an episode at any tool-call boundary by resending its context, so an episode states every request in
full and never calls out itself; rewards that need work (running tests) are a `Tool` call like any other or
the work of `score`, and both run off the driver on the tool workers, in parallel with the rollouts.

Text tasks (chat messages in, the model's text out) implement this through gyre.real.text_task.TextTask,
which holds the tokenizer and chat template and turns text into token ids once. The built-in tasks:
gyre.real.agent:AgentTask (token ids, the default) and gyre.real.tasks.code:CodeTask (sandboxed Python).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Union, runtime_checkable

from gyre.trajectory import Score, TaskRecorder

DEFAULT_TASK = "gyre.real.agent:AgentTask"


@dataclass(frozen=True)
class Generate:
    """A model segment after `context` (the episode's full context), at most `max_new` tokens. `seq` names
    the context within the episode (its KV cache: "main", or a sub-agent's); `branch` says the segment opens
    a branch of the trajectory ("subagent", "retry" or "compact"), for the rollout trace. `parallel`: more
    segments generated at the same time on the same engine, each in its own `seq` (all names distinct), as one
    request (moved, re-issued and cancelled together); an episode that asks for them gets their results through
    its `on_generated_all` instead of `on_generated`."""

    context: list[int]
    max_new: int
    seq: str = "main"
    branch: str | None = None
    parallel: tuple[Generate, ...] = ()


@dataclass(frozen=True)
class Tool:
    """A tool call: a picklable object with `run()` (blocking; run in a worker thread) or `async arun()`."""

    call: Any


@dataclass(frozen=True)
class Done:
    """The episode ended: `end` is the log's finish code (0 done, 1 capped by max_turns, 2 deadline hit)."""

    truncated: bool
    end: int = 0
    reward: float | None = None  # known at the end (None: only `score` knows)


@dataclass(frozen=True)
class ToolError:
    """What a failed tool call returns to its episode: the call raised, hung past its timeout, or its worker
    died on every attempt. The run goes on."""

    message: str


Request = Union[Generate, Tool, Done]


@runtime_checkable
class Episode(Protocol):
    def start(self, now: float) -> Request: ...

    def on_generated(self, tokens: list[int], logprobs: list[float], version: int, now: float) -> Request: ...

    def on_tool(self, result: Any, now: float) -> Request: ...


@runtime_checkable
class TaskGroup(Protocol):
    prompt: Sequence[int]
    recorder: TaskRecorder
    episodes: Sequence[Episode]


@runtime_checkable
class Task(Protocol):
    config_class: type
    stop: list[int]
    max_context: int

    def new_group(self, index: int, size: int) -> TaskGroup: ...

    def score(self, group: Any) -> list[Score]: ...


CONTRACT = {"Task": ("config_class", "stop", "max_context", "new_group", "score"), "TaskGroup": ("prompt", "recorder", "episodes"),
            "Episode": ("start", "on_generated", "on_tool")}
OPTIONAL = {"Task": ("score_failed",), "TaskGroup": (), "Episode": ("deadline_at", "on_generated_all")}  # read if present


class TaskError(ValueError):
    """A task class that cannot be loaded, built, or does not satisfy the contract (one line)."""


def task_class(path: str) -> type:
    """The class at `path` ('pkg.mod:Class' or 'pkg.mod.Class'), with a dataclass `config_class`."""
    mod, _, attr = path.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise TaskError(f"cannot load task {path!r}: {exc}") from None
    conf = getattr(cls, "config_class", None)
    if not (isinstance(conf, type) and dataclasses.is_dataclass(conf)):
        raise TaskError(f"task {path!r} has no dataclass config_class (see gyre.real.task_api.Task)")
    return cls


def _missing(obj: Any, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not hasattr(obj, n)]


def load_task(path: str, config, seed: int, *, check: bool = True) -> Task:
    """The task at `path` built with (config, seed); with `check`, one group of it is made and checked too."""
    cls = task_class(path)
    if not isinstance(config, cls.config_class):
        raise TaskError(f"task {path!r} takes a {cls.config_class.__name__} config, got {type(config).__name__}")
    try:
        task = cls(config, seed)
    except (TypeError, ValueError, OSError) as exc:
        raise TaskError(f"task {path!r}: {exc}") from None
    bad = _missing(task, CONTRACT["Task"])
    if bad:
        raise TaskError(f"task {path!r} lacks {', '.join(bad)} (see gyre.real.task_api.Task)")
    if check:
        group = task.new_group(0, 1)
        bad = _missing(group, CONTRACT["TaskGroup"])
        if bad:
            raise TaskError(f"task {path!r}: its groups lack {', '.join(bad)} (see gyre.real.task_api.TaskGroup)")
        bad = [n for e in group.episodes[:1] for n in _missing(e, CONTRACT["Episode"])]
        if bad or not group.episodes:
            raise TaskError(f"task {path!r}: its episodes lack {', '.join(bad) or 'everything'} "
                            f"(see gyre.real.task_api.Episode)")
        task = cls(config, seed)  # a fresh one: checking drew nothing from its generators
    return task
