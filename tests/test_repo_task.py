"""Repository repair with the own stdlib harness, without Ray: the task's episodes run through the proxy (the test plays
the backend and the model), the repository is built in each working folder at run time, its tests score the result."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("tornado")
pytest.importorskip("transformers")

from gyre.real.chat import ChatTokenizer  # noqa: E402
from gyre.real.proxy_chat import TOOLS_TEMPLATE  # noqa: E402
from gyre.real.proxy_host import ProxyActor, ProxyThread  # noqa: E402
from gyre.real.task_api import Done, Generate, Tool  # noqa: E402
from gyre.real.tasks.repo import RepoTask, RepoTaskConfig, read_repo_problems  # noqa: E402

ROOT = Path(__file__).parents[1]
OWN = ("{python}", "{harnesses}/own_agent.py", "--turns", "2", "--subagent-at", "9", "--compact-after", "99")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    for f in (ROOT / "configs" / "tiny_chat").iterdir():
        shutil.copyfile(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(folder)


class Handle:
    """What the episode's tool calls see as the proxy actor's handle: `method.remote(*args)` awaits the method of a
    ProxyActor around the thread's proxy."""

    def __init__(self, pt: ProxyThread) -> None:
        self.pt = pt
        self.actor = ProxyActor.__new__(ProxyActor)
        self.actor.proxy = pt.proxy

    def __getattr__(self, name):
        fn = getattr(self.actor, name)
        return types.SimpleNamespace(remote=lambda *a: asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(fn(*a), self.pt.loop)))


def run_episode(ep, replies: list[str], tok) -> Done:
    """Drive one episode to its end as the backend would; the model's replies are `replies` in order."""
    action, now, k = ep.start(0.0), 0.0, 0
    while not isinstance(action, Done):
        now += 0.1
        if isinstance(action, Tool):
            action = ep.on_tool(asyncio.run(action.call.arun()), now)
        else:
            assert isinstance(action, Generate) and not action.parallel, action
            ids = tok.encode(replies[k], add_special_tokens=False) + [tok.eos_token_id]
            k += 1
            action = ep.on_generated(ids, [-1.0] * len(ids), 0, now)
    return action


def sh(cmd: str) -> str:
    return "<tool_call>" + json.dumps({"name": "sh", "arguments": {"cmd": cmd}}) + "</tool_call>"


def test_a_repository_is_built_per_execution_and_scored_by_its_restored_tests(model_dir, tmp_path):
    """calc_add (add returns a - b; its test wants a + b): a harness that fixes calc.py with its sh tool scores 1; one
    that does nothing scores 0; one that rewrites the failing test to pass scores 0 (the tests are put back before
    they run); every execution started from the repository as the problem has it."""
    cfg = RepoTaskConfig(harness=OWN, model_dir=model_dir, workdir=str(tmp_path / "work"), max_context=8192)
    task = RepoTask(cfg, 0)
    pt = ProxyThread(task.chat.tok)
    task._proxy = Handle(pt)
    group = task.new_group(0, 3)
    assert group.problem.id == "calc_add" and set(group.files) == {"calc.py", "test_calc.py"}, group.files
    scripts = [[sh("sed -i 's/a - b/a + b/' calc.py"), "fixed"],
               ["I see nothing to do.", "done"],
               [sh("printf 'import unittest\\n' > test_calc.py; cp calc.py seen.py"), "done"]]
    try:
        ends = [run_episode(ep, s, task.chat.tok) for ep, s in zip(group.episodes, scripts)]
    finally:
        pt.close()
    assert all(not d.truncated for d in ends), ends
    for ep in group.episodes:
        calls = [json.loads(x) for x in (Path(ep.cwd) / "transcript.jsonl").read_text().splitlines()]
        assert [c["status"] for c in calls] == [200, 200], f"{ep.key}: {calls}"
    cheat = Path(group.episodes[2].cwd)
    assert (cheat / "seen.py").read_text() == group.files["calc.py"], "the repository was not there at the start"
    assert (cheat / "test_calc.py").read_text() == "import unittest\n", "the harness's tool call did not run"
    scores = task.score(group)
    assert [(s.reward, s.outcome) for s in scores] == [(1.0, "valid"), (0.0, "valid"), (0.0, "valid")], scores
    assert "return a + b" in (Path(group.episodes[0].cwd) / "calc.py").read_text()


@pytest.mark.parametrize("line, field", [
    ({"id": "x", "prompt": "p", "files": {"../a.py": ""}, "tests": ["../a.py"]}, "files['../a.py']"),
    ({"id": "x", "prompt": "p", "files": {"a.py": ""}, "tests": ["b.py"]}, "tests"),
    ({"id": "x", "prompt": "p", "files": {"a.py": ""}, "tests": ["a.py"], "command": "pytest"}, "command"),
    ({"id": "x", "prompt": "p", "tests": ["a.py"]}, "field 'files'")])
def test_a_bad_problem_line_is_refused_naming_file_line_and_field(tmp_path, line, field):
    """A problem whose files leave the repository, whose tests are not among its files, or whose command is not an
    argv is a one-line ValueError naming file:line and the field."""
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError) as err:
        read_repo_problems(p)
    assert str(err.value).startswith(f"{p}:1: {field}") and "\n" not in str(err.value), str(err.value)


def test_the_shipped_repositories_fail_until_fixed(tmp_path):
    """Each shipped problem's tests fail on the repository as given (there is something to repair)."""
    from gyre.real.proxy import write_files
    from gyre.real.tasks.repo import run_tests

    for prob in read_repo_problems(ROOT / "configs" / "repo_problems.jsonl"):
        folder = tmp_path / prob.id
        write_files(str(folder), prob.files)
        ok, out = run_tests(folder, prob, 20.0)
        assert not ok and "FAILED" in out, f"{prob.id}: {out}"
