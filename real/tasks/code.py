"""A sandboxed coding task: the model writes Python, the tests of the problem score it.

What it models: the second built-in task of the real backend, a text environment (gyre.real.text_task)
behind the environment contract. Problems come from a JSONL file, one per line:
`{"id": str, "prompt": str, "tests": [str, ...]}` (each test a Python statement, e.g. an assert, run after
the model's code). The `index`-th task of the run is problem `index % len(problems)`. Each reply of the model
is code (its first ```python fenced block, else the whole reply); a tool call runs it with the problem's
tests in the sandbox (gyre.real.sandbox) on a tool worker, off the driver, in parallel with the other
rollouts, and its report (tests passed, the first failure or error, what the code printed) is the next
observation. All tests passing ends the episode with reward 1; otherwise, at `max_turns` replies (or the
deadline) the episode is truncated and scored by partial credit: the largest share of tests any of its
runs passed. A sandbox error (a refused connect, a write outside its folder, a fork, a limit) is part of
the report and the episode goes on.

Simplifications: the tests are shown to no one (the prompt states the function to write); a tool error
(the call timed out, its worker died) is an observation like any other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gyre.jsonl import json_objects
from gyre.real.chat import ChatTokenizer
from gyre.real.sandbox import Limits, arun_python
from gyre.real.task_api import ToolError
from gyre.real.text_task import Call, Final, Reply, TextGroup, TextLimits, score_text_group, tool_text

SYSTEM = "You write Python. Answer with one ```python code block; it is run against hidden tests."
FENCE = re.compile(r"```(?:python)?\n(.*?)(?:```|$)", re.S)


@dataclass(kw_only=True, frozen=True)
class CodeTaskConfig:
    problems: str = "configs/code_problems.jsonl"
    model_dir: str = "configs/tiny_chat"  # the tokenizer and chat template (a Hugging Face model folder)
    max_new_tokens: int = 64
    max_turns: int = 2
    max_context: int = 1024
    max_tool_tokens: int = 160
    deadline_s: float = 120.0
    cpu_s: int = 2
    wall_s: float = 10.0
    memory_mb: int = 512


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str
    tests: tuple[str, ...]


def read_problems(path: str | Path) -> list[Problem]:
    """The problems of a JSONL file; a bad line is a ValueError naming `file:line: reason`."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{p}: {exc.strerror or exc}") from None
    out = []

    def bad(n: int, reason: str) -> None:
        raise ValueError(f"{p}:{n}: {reason}")

    for n, rec in json_objects(lines, bad):
        for key, kind in (("id", str), ("prompt", str), ("tests", list)):
            if not isinstance(rec.get(key), kind):
                raise ValueError(f"{p}:{n}: field {key!r} missing or not a {kind.__name__}")
        if not rec["tests"] or not all(isinstance(t, str) for t in rec["tests"]):
            raise ValueError(f"{p}:{n}: 'tests' must be a non-empty list of strings")
        out.append(Problem(rec["id"], rec["prompt"], tuple(rec["tests"])))
    if not out:
        raise ValueError(f"{p}: no problems")
    return out


def extract_code(reply: str) -> str:
    m = FENCE.search(reply)
    return m.group(1) if m else reply


@dataclass(frozen=True)
class SandboxCall:
    """The tool call: run `code` against `tests` in the sandbox (a coroutine on the tool worker)."""

    code: str
    tests: tuple[str, ...]
    limits: Limits

    async def arun(self) -> dict:
        return await arun_python(self.code, list(self.tests), self.limits)


def report(res: dict) -> str:
    """What the model is shown of a sandbox run."""
    head = f"passed {res['passed']}/{res['total']} tests"
    if res["status"] == "timeout":
        head += "; killed at the wall limit"
    elif res["status"] == "killed":
        head += f"; killed by {res['signal']} (a resource limit)"
    if res["code_error"]:
        head += f"; error: {res['code_error']}"
    elif res["failures"]:
        head += f"; test {res['failures'][0][0]} failed: {res['failures'][0][1]}"
    return head + (f"\noutput:\n{res['output']}" if res["output"] else "")


class CodeEnv:
    """One episode's environment: a problem and the best share of its tests passed so far."""

    def __init__(self, problem: Problem, limits: Limits) -> None:
        self.problem, self.limits = problem, limits
        self.best = 0.0
        self.reports: list[str] = []

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.problem.prompt}]

    def act(self, reply: str):
        return Call(SandboxCall(extract_code(reply), self.problem.tests, self.limits))

    def result(self, output):
        if isinstance(output, ToolError):
            text = tool_text(output)
        else:
            self.best = max(self.best, output["passed"] / output["total"])
            if output["passed"] == output["total"]:
                return Final(1.0)
            text = report(output)
        self.reports.append(text)
        return Reply(text)

    def partial_credit(self) -> float:
        return self.best


class CodeTask:
    """The sandboxed coding task behind the contract (gyre.real.task_api.Task)."""

    config_class = CodeTaskConfig

    def __init__(self, config: CodeTaskConfig, seed: int) -> None:
        self.cfg = config
        self.seed = seed
        self.problems = read_problems(config.problems)
        self.chat = ChatTokenizer(config.model_dir)
        self.stop = self.chat.stop
        self.max_context = config.max_context
        self.vocab_size = self.chat.vocab_size
        self.limits = Limits(cpu_s=config.cpu_s, wall_s=config.wall_s, memory_mb=config.memory_mb)
        self.text = TextLimits(max_new_tokens=config.max_new_tokens, max_turns=config.max_turns,
                               max_context=config.max_context, max_tool_tokens=config.max_tool_tokens,
                               deadline_s=config.deadline_s)

    def new_group(self, index: int, size: int) -> TextGroup:
        problem = self.problems[index % len(self.problems)]
        return TextGroup(index, [CodeEnv(problem, self.limits) for _ in range(size)], self.chat, self.text)

    def score(self, group: TextGroup):
        return score_text_group(group)
