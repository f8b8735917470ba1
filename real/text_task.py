"""Text environments behind the token-level contract: messages in, the model's text out, token ids once.

What it models: most agent environments speak chat messages, not token ids. A text task makes, per task
of the sequence, `TextEnv`s (one per episode of the group) with:

- `messages()`: the prompt, as chat messages (the same for every episode of a group);
- `act(reply)`: the model's reply text -> `Call(tool_call)` (run it on the tool service), `Reply(text)` (an
  immediate observation, shown as a tool message) or `Final(reward)` (the episode ends);
- `result(output)`: a tool call's output (or a gyre.real.task_api.ToolError) -> `Reply(text)` or `Final`;
- `partial_credit()`: the score of a truncated episode, on the state it reached.

`TextEpisode` adapts one to gyre.real.task_api.Episode: it renders the prompt and every observation with
the model folder's chat template (gyre.real.chat.ChatTokenizer), decodes the model's tokens for the env,
and records into the group's TaskRecorder exactly what the model saw: the tokens it generated as trained
tokens (never re-tokenized), everything else (prompt, tool output, markers) as context. An observation is
cut to `max_tool_tokens`. The episode is truncated (partial credit) at `max_turns` replies, at its deadline,
or when the next segment would not fit in `max_context` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gyre.real.task_api import Done, Generate, Tool, ToolError
from gyre.trajectory import Score, TaskRecorder, score_group


@dataclass(frozen=True)
class Call:
    call: Any


@dataclass(frozen=True)
class Reply:
    text: str


@dataclass(frozen=True)
class Final:
    reward: float


class TextEnv(Protocol):
    def messages(self) -> list[dict]: ...

    def act(self, reply: str) -> Call | Reply | Final: ...

    def result(self, output: Any) -> Reply | Final: ...

    def partial_credit(self) -> float: ...


@dataclass(kw_only=True, frozen=True)
class TextLimits:
    max_new_tokens: int = 64
    max_turns: int = 4
    max_context: int = 2048
    max_tool_tokens: int = 256
    deadline_s: float = 120.0


class TextGroup:
    def __init__(self, task_id: int, envs: list, chat, limits: TextLimits) -> None:
        self.messages = envs[0].messages()
        self.prompt = chat.prompt(self.messages)
        self.recorder = TaskRecorder(f"task{task_id}", np.asarray(self.prompt, np.int64))
        self.episodes = [TextEpisode(self, env, chat, limits) for env in envs]


class TextEpisode:
    """One episode of a text env (see the module docstring)."""

    def __init__(self, group: TextGroup, env, chat, limits: TextLimits) -> None:
        self.group, self.env, self.chat, self.lim = group, env, chat, limits
        self.cursor = None
        self.ctx: list[int] = []
        self.history: list[dict] = []
        self.turns = 0
        self.deadline_at = float("inf")
        self.reward: float | None = None

    def start(self, now: float) -> Generate:
        self.cursor = self.group.recorder.start()
        self.ctx = list(self.group.prompt)
        self.history = list(self.group.messages)
        self.deadline_at = now + self.lim.deadline_s
        return self._next(now)

    def on_generated(self, tokens: list[int], logprobs: list[float], version: int, now: float):
        self.cursor.append_model(np.asarray(tokens, np.int64), np.asarray(logprobs), version)
        self.ctx += tokens
        self.turns += 1
        text = self.chat.decode(tokens)
        self.history.append({"role": "assistant", "content": text})
        return self._after(self.env.act(text), now)

    def on_tool(self, result, now: float):
        return self._after(self.env.result(result), now)

    def _after(self, step, now: float):
        if isinstance(step, Final):
            self.reward = float(step.reward)
            self.cursor.finish(self.reward)
            return Done(truncated=False, reward=self.reward)
        if isinstance(step, Call):
            return Tool(step.call)
        if not isinstance(step, Reply):
            raise TypeError(f"a text env returned {type(step).__name__}; expected Call, Reply or Final")
        msg = {"role": "tool", "content": step.text}
        ids = self.chat.turn(self.history, msg, self.lim.max_tool_tokens)
        self.cursor.append_env(np.asarray(ids, np.int64))
        self.ctx += ids
        self.history.append(msg)
        return self._next(now)

    def _next(self, now: float):
        over = len(self.ctx) + self.lim.max_new_tokens > self.lim.max_context
        if self.turns >= self.lim.max_turns or now >= self.deadline_at or over:
            self.reward = float(self.env.partial_credit())
            self.cursor.hit_deadline()
            return Done(truncated=True, end=2 if now >= self.deadline_at else 1, reward=self.reward)
        return Generate(list(self.ctx), self.lim.max_new_tokens)


def score_text_group(group: TextGroup) -> list[Score]:
    """Scores of a finished group (recorder order): finished episodes by their final reward, truncated ones
    by the partial credit their env gave when they were cut."""
    by_id = {e.cursor.id: e for e in group.episodes}
    return score_group(group.recorder, lambda st: by_id[st.execution].reward)


def tool_text(output: Any) -> str:
    """A tool's output as text the model may see: bytes decoded (invalid UTF-8 replaced), errors named."""
    if isinstance(output, ToolError):
        return f"tool error: {output.message}"
    if isinstance(output, (bytes, bytearray)):
        return bytes(output).decode("utf-8", "replace")
    return str(output)
