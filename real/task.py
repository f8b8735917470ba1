"""The built-in long-horizon agent task: find a hidden digit with tools, then answer it.

What it models: a tool-using agent over a tiny vocabulary (token ids, no text). A task shows a key
digit k; its secret s = table(task seed, k) is only revealed by tools. Each model turn is one short
segment (an action token, an optional argument, SEP). Actions:

- LOOKUP: calls the `lookup` tool (variable latency: mostly fast, some slow calls, and transient
  failures that the agent retries from the point before the call: a retry branch in the trajectory);
- DELEGATE: opens a sub-agent (a forked context ending in SUB) that gets one turn; if it emits LOOKUP
  the tool runs on its behalf and its result is returned to the parent as the tool output;
- ANSWER d: ends the execution. Reward 1.0 if d == s, 0.5 if wrong after seeing s, 0.1 if wrong blind;
- anything else: an immediate ERR observation (no tool runs).

Past `context_limit` tokens the context is compacted into a fresh root [BOS SUM k (RES s) SEP]. An
execution that reaches `max_turns` or its wall-clock deadline is truncated and scored on the state it
reached (partial credit 0.1 if s is in its context). A random model almost never scores; the optimum
(LOOKUP, then ANSWER s) is a copy a 2-layer model learns in a few hundred rollouts.

Simplifications: one tool; the secret is a hash of (task seed, key), so tools are pure functions;
tool latency is drawn by the driver from a seeded generator and slept by a tool worker (gyre.real.tools).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

PAD, BOS, SEP, LOOKUP, DELEGATE, ANSWER, RES, ERR, SUM, SUB = range(10)
DIGIT0 = 10
VOCAB_SIZE = 20
ACTIONS = {LOOKUP: "lookup", DELEGATE: "delegate", ANSWER: "answer"}


def digit(d: int) -> int:
    return DIGIT0 + int(d)


def as_digit(tok: int) -> int | None:
    return tok - DIGIT0 if DIGIT0 <= tok < DIGIT0 + 10 else None


@dataclass(kw_only=True, frozen=True)
class TaskConfig:
    """Shape of the agent task and its tools' latency distribution."""

    max_new_tokens: int = 3
    max_turns: int = 6
    context_limit: int = 28
    deadline_s: float = 6.0
    fast_tool_s: float = 0.03  # median of the fast lookups (lognormal, sigma 0.5)
    slow_tool_p: float = 0.15
    slow_tool_s: tuple[float, float] = (0.4, 1.5)  # uniform range of slow calls
    fail_p: float = 0.1  # transient tool failure
    max_retries: int = 2
    reward_correct: float = 1.0
    reward_wrong_seen: float = 0.5
    reward_wrong_blind: float = 0.1
    partial_seen: float = 0.1

    def __post_init__(self) -> None:
        if self.max_new_tokens < 2:
            raise ValueError(f"TaskConfig.max_new_tokens must be >= 2 (action + argument), got {self.max_new_tokens}")
        d = self.deadline_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 0:  # NaN fails too
            raise ValueError(f"TaskConfig.deadline_s must be a positive number of seconds, got {d!r}")
        if self.context_limit < 8:
            raise ValueError(f"TaskConfig.context_limit must be >= 8, got {self.context_limit}")


def secret_of(task_seed: int, key: int) -> int:
    """The hidden table: a fixed hash of (task seed, key) -> digit."""
    return int(np.random.default_rng([int(task_seed), int(key)]).integers(10))


@dataclass(kw_only=True, frozen=True)
class TaskSpec:
    task_id: int
    seed: int
    key: int

    @property
    def secret(self) -> int:
        return secret_of(self.seed, self.key)

    @property
    def prompt(self) -> list[int]:
        return [BOS, digit(self.key), SEP]


def make_task(task_id: int, rng: np.random.Generator) -> TaskSpec:
    return TaskSpec(task_id=task_id, seed=int(rng.integers(2**31)), key=int(rng.integers(10)))


@dataclass(kw_only=True, frozen=True)
class ToolCall:
    """One tool invocation as the driver plans it: what to run, how long it takes, whether it fails."""

    name: str
    task_seed: int
    key: int
    latency_s: float
    fails: bool

    def run(self) -> list[int]:
        return run_tool(self)

    async def arun(self) -> list[int]:
        """On a tool worker: wait the planned latency, then answer."""
        await asyncio.sleep(self.latency_s)
        return run_tool(self)


def plan_lookup(task: TaskSpec, cfg: TaskConfig, rng: np.random.Generator) -> ToolCall:
    if rng.random() < cfg.slow_tool_p:
        lat = float(rng.uniform(*cfg.slow_tool_s))
    else:
        lat = float(cfg.fast_tool_s * np.exp(0.5 * rng.standard_normal()))
    return ToolCall(name="lookup", task_seed=task.seed, key=task.key, latency_s=lat, fails=bool(rng.random() < cfg.fail_p))


def run_tool(call: ToolCall) -> list[int]:
    """The tool's result tokens (pure: the same call always gives the same output)."""
    if call.name != "lookup":
        raise ValueError(f"unknown tool {call.name!r}")
    if call.fails:
        return [ERR, SEP]
    return [RES, digit(secret_of(call.task_seed, call.key)), SEP]


def parse_action(tokens: list[int]) -> tuple[str, int | None]:
    """(action, digit argument) of a segment; 'invalid' when its first token is no action."""
    if not tokens or tokens[0] not in ACTIONS:
        return "invalid", None
    arg = as_digit(tokens[1]) if len(tokens) > 1 else None
    return ACTIONS[tokens[0]], arg


def seen_secret(context: list[int] | np.ndarray, secret: int) -> bool:
    """Whether a successful lookup result for `secret` is in the context."""
    ctx = np.asarray(context)
    hits = np.flatnonzero(ctx[:-1] == RES)
    return bool(np.any(ctx[hits + 1] == digit(secret)))


def answer_reward(answer: int | None, secret: int, seen: bool, cfg: TaskConfig) -> float:
    if answer == secret:
        return cfg.reward_correct
    return cfg.reward_wrong_seen if seen else cfg.reward_wrong_blind


def partial_credit(context: list[int] | np.ndarray, secret: int, cfg: TaskConfig) -> float:
    """Score of a truncated execution from the context it reached."""
    return cfg.partial_seen if seen_secret(context, secret) else 0.0


def compacted(task: TaskSpec, seen: bool) -> list[int]:
    """The fresh root after compaction: summary marker, the key, and the lookup result if known."""
    out = [BOS, SUM, digit(task.key)]
    if seen:
        out += [RES, digit(task.secret)]
    return out + [SEP]
