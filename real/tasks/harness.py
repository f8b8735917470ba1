"""Black-box agent harnesses as a task: one harness process per execution, its model calls served by the proxy.

What it models: the setting of the system Gyre follows, where the agent is a program Gyre cannot rewrite. Each
episode launches the task's harness (`harness`, an argv; `{python}` is this interpreter, `{harnesses}` gyre's
folder of harness programs, gyre/real/harnesses, `{repo}` gyre's source root) in its own working folder through
the run's model proxy (gyre.real.proxy), pointed at it by OPENAI_BASE_URL and a per-execution OPENAI_API_KEY, with
the problem's statement in GYRE_TASK, fenced as `sandbox` says (gyre.real.harness_sandbox: bubblewrap namespaces
with the proxy as its only network, or resource limits only). The episode is then a relay between the harness and
the backend, within the environment contract (gyre.real.task_api): waiting for the harness's next model call is a
`Tool` call (run on the tool workers; the harness's own work between two calls is its tool time), the call itself
a `Generate` of the ids the proxy rendered, sent to whichever engine serves the execution now, and its answer goes
back to the harness with the next wait. Calls of the harness outstanding at once come as one round (gyre.real.proxy):
one `Generate` with a `parallel` segment per further call, each in its own KV sequence, answered together. Every
call is recorded TITO (gyre.trajectory.tito.TitoRecord), and at the end the execution's records become its
branches of the group's prefix tree (gyre.trajectory.tito.TitoTree).

Endings: the harness exits (any code: a crash still leaves its work), is killed at `harness_timeout_s` (its
work is scored, flagged truncated), or the execution outlives `overall_timeout_s` (its deadline: the harness is
stopped and the execution dropped, the paper's rule: `score` gives it the outcome "overall_timeout", so it leaves
training and its group's advantages are computed over the members left; a group left with fewer than 2 leaves
training, gyre.trajectory.credit). Anything that comes back for an execution past its deadline (a request, an
answer, the harness's exit, a failed wait) drops it. A failed wait (the tool call timed out or lost its worker)
stops the harness and scores what it left. Scoring (`score`, on a tool worker) runs the problem's tests
(gyre.real.tasks.code's problem file) against the `solution.py` the harness left in its folder, in the sandbox
(gyre.real.sandbox): the share of tests passed.

Simplifications: the proxy and the harness processes run on the driver's node; working folders stay on disk
after the run (under `workdir`, or a temporary folder) for inspection.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gyre.real.chat import ChatTokenizer
from gyre.real.harness_sandbox import SANDBOXES, check_sandbox
from gyre.real.proxy import ProxyConfig
from gyre.real.sandbox import Limits, run_python
from gyre.real.task_api import Done, Generate, Tool, ToolError
from gyre.real.tasks.code import read_problems
from gyre.trajectory import Score, TaskRecorder
from gyre.trajectory.tito import TitoRecord, TitoTree

HARNESSES = Path(__file__).resolve().parents[1] / "harnesses"


def expand(arg: str) -> str:
    """`{python}`: this interpreter; `{harnesses}`: gyre's folder of harness programs; `{repo}`: gyre's source root."""
    return (arg.replace("{python}", sys.executable).replace("{harnesses}", str(HARNESSES))
            .replace("{repo}", str(HARNESSES.parents[1])))


@dataclass(kw_only=True, frozen=True)
class HarnessTaskConfig:
    # argv of the harness program; `{python}`, `{harnesses}` and `{repo}` are expanded here and in `env` (`expand`)
    harness: tuple[str, ...] = ("{python}", "{harnesses}/own_agent.py")
    problems: str = "configs/code_problems.jsonl"
    model_dir: str = "configs/tiny_chat"  # the served model's tokenizer and chat template
    max_new_tokens: int = 32  # cap of a call's max_tokens
    max_context: int = 2048  # a call whose prompt and max_tokens exceed it is refused (HTTP 400)
    harness_timeout_s: float = 60.0  # the harness is killed then; its work is scored
    overall_timeout_s: float = 120.0  # the execution's deadline: stopped and dropped (outcome "overall_timeout")
    workdir: str = ""  # working folders go under it ("": a temporary folder)
    env: tuple[tuple[str, str], ...] = ()  # more environment variables for the harness
    sandbox: str = "none"  # or "bwrap": namespaces, the proxy as the only network (gyre.real.harness_sandbox)
    memory_mb: int = 4096  # the harness's address-space limit
    file_mb: int = 256  # the largest file it may write
    proxy_host: str = "127.0.0.1"
    proxy_port: int = 0
    score_wall_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", tuple((str(k), str(v)) for k, v in self.env))  # TOML gives lists
        if not self.harness or not all(isinstance(a, str) for a in self.harness):
            raise ValueError("HarnessTaskConfig.harness must be a non-empty list of strings (the program's argv)")
        for name in ("harness_timeout_s", "overall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HarnessTaskConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_new_tokens < 1 or self.max_context <= self.max_new_tokens:
            raise ValueError(f"HarnessTaskConfig: max_new_tokens = {self.max_new_tokens} must be >= 1 and below "
                             f"max_context = {self.max_context}")
        ProxyConfig(host=self.proxy_host, port=self.proxy_port)
        if self.sandbox not in SANDBOXES:
            raise ValueError(f"HarnessTaskConfig.sandbox must be one of {SANDBOXES}, got {self.sandbox!r}")


@dataclass(frozen=True)
class ProxyCall:
    """A tool call that is one method of the run's proxy actor (awaited on a tool worker)."""

    proxy: Any
    method: str
    args: tuple

    async def arun(self) -> dict:
        return await getattr(self.proxy, self.method).remote(*self.args)


class HarnessGroup:
    def __init__(self, task: HarnessTask, index: int, serial: int, size: int) -> None:
        self.problem = task.problems[index % len(task.problems)]
        self.prompt = task.chat.prompt([{"role": "user", "content": self.problem.prompt}])
        self.recorder = TaskRecorder(f"task{index}", np.asarray(self.prompt, np.int64))
        self.files: dict[str, str] = dict(getattr(self.problem, "files", {}))  # written into each working folder
        self.episodes = [HarnessEpisode(task, self, f"g{serial}e{i}") for i in range(size)]


class HarnessEpisode:
    """One execution of the harness (see the module docstring)."""

    def __init__(self, task: HarnessTask, group: HarnessGroup, key: str) -> None:
        self.task, self.group, self.key = task, group, key
        self.token = secrets.token_hex(16)
        self.cwd = str(Path(task.root) / key)
        self.deadline_at = float("inf")
        self.cursor = None
        self.tito: TitoTree | None = None
        self.records: list[TitoRecord] = []
        self.reqs: list[dict] = []  # the requests of the round being generated (one, or several served at once)
        self.issued = 0.0
        self.exit: dict | None = None
        self.fault: str | None = None
        self.dropped = False
        self._stopping = False

    def _call(self, method: str, *args) -> Tool:
        return Tool(ProxyCall(self.task.proxy(), method, (self.key, *args)))

    def start(self, now: float) -> Tool:
        cfg = self.task.cfg
        self.cursor = self.group.recorder.start()
        self.tito = TitoTree(self.group.recorder.tree, self.cursor.id)
        self.deadline_at = now + cfg.overall_timeout_s
        env = {"GYRE_TASK": self.group.problem.prompt, **self.task.env}
        return self._call("launch", self.token, cfg.max_new_tokens, cfg.max_context, self.task.argv, env, self.cwd,
                          cfg.harness_timeout_s, cfg.sandbox, cfg.memory_mb, cfg.file_mb, dict(self.group.files))

    def on_tool(self, ev, now: float):
        if now >= self.deadline_at:  # whatever came back, the execution is past its overall timeout: dropped
            self.dropped = True
        if isinstance(ev, ToolError):
            self.fault = ev.message
            return self._stop() if not self._stopping else self._done(None)
        if ev["kind"] == "exit":
            return self._done(ev)
        if self.dropped:
            return self._stop()
        self.reqs, self.issued = (ev["requests"] if ev["kind"] == "requests" else [ev]), now
        gens, used = [], set()
        for r in self.reqs:  # a KV sequence per call: main or sub, numbered when a round holds several of a kind
            base = "main" if r["role"].startswith("main") else "sub"
            seq = next(f"{base}{k or ''}" for k in range(len(self.reqs) + 1) if f"{base}{k or ''}" not in used)
            used.add(seq)
            gens.append(Generate(list(r["ids"]), int(r["max_new"]), seq=seq))
        return gens[0] if len(gens) == 1 else dataclasses.replace(gens[0], parallel=tuple(gens[1:]))

    def on_generated(self, tokens: list[int], logprobs: list[float], version: int, now: float):
        return self.on_generated_all([(tokens, logprobs, version, now)], now)

    def on_generated_all(self, results: list[tuple], now: float):
        """A round's answers, (tokens, logprobs, version, done) per request in the round's order: a TITO record
        each (its own completion time), then one answer to the proxy for all."""
        answers = []
        for ev, (tokens, logprobs, version, done) in zip(self.reqs, results):
            rec = TitoRecord(execution=self.key, n=ev["n"], role=ev["role"], input_ids=tuple(ev["ids"]),
                             output_ids=tuple(int(t) for t in tokens), logprobs=tuple(float(x) for x in logprobs),
                             version=int(version), received_s=ev["received"], issued_s=self.issued, done_s=done)
            self.records.append(rec)
            self.tito.add(rec)
            answers.append((ev["n"], list(rec.output_ids), list(rec.logprobs)))
        if now >= self.deadline_at:
            self.dropped = True
            return self._stop()
        if len(answers) == 1:
            return self._call("respond", *answers[0])
        return self._call("respond_all", answers)

    def _stop(self) -> Tool:
        self._stopping = True
        return self._call("stop")

    def _done(self, ev: dict | None) -> Done:
        self.exit = ev
        self.tito.close(self.cursor)
        timed_out = bool(ev and ev["timed_out"]) or self.dropped or self.fault is not None
        self.cursor.status = "truncated" if timed_out else "finished"
        return Done(truncated=timed_out, end=2 if timed_out else 0)


class HarnessTask:
    """Black-box harnesses behind the environment contract (gyre.real.task_api.Task)."""

    config_class = HarnessTaskConfig

    def __init__(self, config: HarnessTaskConfig, seed: int, problems: list | None = None) -> None:
        check_sandbox(config.sandbox)  # a host that cannot fence as asked is refused here, in one line
        self.cfg = config
        self.seed = seed
        self.problems = problems if problems is not None else read_problems(config.problems)  # (a subclass's own)
        self.chat = ChatTokenizer(config.model_dir)
        self.stop = self.chat.stop
        self.max_context = config.max_context
        self.vocab_size = self.chat.vocab_size  # the CLI checks the model's vocabulary covers it
        self.argv = [expand(a) for a in config.harness]
        self.env = {k: expand(v) for k, v in config.env}
        self.root = config.workdir or tempfile.mkdtemp(prefix="gyre-harness-")
        self._proxy = None
        self.url = ""
        self._serial = 0

    def proxy(self):
        """The run's proxy actor, started on first use on the driver's node."""
        if self._proxy is None:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            from gyre.real.proxy_host import ProxyActor

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            actor = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=0)(ProxyActor).options(
                scheduling_strategy=here).remote(self.chat.folder, ProxyConfig(host=self.cfg.proxy_host,
                                                                               port=self.cfg.proxy_port))
            self.url = ray.get(actor.start.remote())
            self._proxy = actor
        return self._proxy

    def new_group(self, index: int, size: int) -> HarnessGroup:
        self._serial += 1
        return HarnessGroup(self, index, self._serial, size)

    def score(self, group: HarnessGroup) -> list[Score]:
        """Per execution (recorder order): the share of the problem's tests its `solution.py` passes (0 without
        one); an execution past the overall timeout is not scored: outcome "overall_timeout" (it leaves training,
        its group's advantages are over the members left, gyre.trajectory.credit.group_advantages)."""
        limits = Limits(wall_s=self.cfg.score_wall_s)
        out = []
        for ep in sorted(group.episodes, key=lambda e: e.cursor.id):
            truncated = ep.cursor.status == "truncated"
            if ep.dropped:
                out.append(Score(execution=ep.cursor.id, reward=0.0, truncated=truncated, outcome="overall_timeout"))
                continue
            sol = Path(ep.cwd) / "solution.py"
            reward = 0.0
            if sol.is_file():
                res = run_python(sol.read_text(errors="replace"), list(group.problem.tests), limits)
                reward = res["passed"] / res["total"]
            out.append(Score(execution=ep.cursor.id, reward=float(reward), truncated=truncated))
        return out

