"""Repository repair by a black-box harness: a tiny repository with a failing test, built at run time, scored by its tests.

What it models: the small repository-repair tasks of issue 45 (the SWE-style work the system Gyre follows trains
on), at toy scale and offline. Problems come from a JSONL file, one per line:
`{"id": str, "prompt": str, "files": {relative path: text}, "tests": [paths among files]}`, optionally `"command"`
(the test command's argv, `{python}` this interpreter; default `{python} -m unittest discover -q`). Each
execution's working folder is built at run time from `files` (written by the proxy before its harness starts,
gyre.real.proxy.write_files) and the harness, any program on an OpenAI client (gyre.real.tasks.harness), is asked
(`GYRE_TASK` = the prompt) to make the tests pass; Gyre's own stdlib harness does it with its `sh` tool.

Scoring (`score`, on a tool worker): a copy of the folder the harness left, with the test files put back as the
problem has them (editing or deleting a test does not pass it), runs `command` there under the harness's resource
limits and `score_wall_s`: reward 1 if it exits 0, else 0. The harness task's endings hold: a crash or a harness
timeout is still scored (truncated), an execution past the overall timeout is dropped (outcome "overall_timeout").

Simplifications: the test command runs with the harness's limits but not in its sandbox (the repository's tests are
the task's, not the agent's; what the agent wrote runs inside them, as in SWE-style graders); no git history.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gyre.jsonl import json_objects
from gyre.real.harness_sandbox import limited
from gyre.real.tasks.harness import HarnessGroup, HarnessTask, HarnessTaskConfig
from gyre.trajectory import Score

DEFAULT_COMMAND = ("{python}", "-m", "unittest", "discover", "-q")


@dataclass(kw_only=True, frozen=True)
class RepoTaskConfig(HarnessTaskConfig):
    problems: str = "configs/repo_problems.jsonl"


@dataclass(frozen=True)
class RepoProblem:
    id: str
    prompt: str
    files: dict
    tests: tuple[str, ...]
    command: tuple[str, ...] = DEFAULT_COMMAND


def read_repo_problems(path: str | Path) -> list[RepoProblem]:
    """The problems of a JSONL file; a bad line is a ValueError naming `file:line: field`."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{p}: {exc.strerror or exc}") from None
    out = []

    def bad(n: int, reason: str) -> None:
        raise ValueError(f"{p}:{n}: {reason}")

    for n, rec in json_objects(lines, bad):
        for key, kind in (("id", str), ("prompt", str), ("files", dict), ("tests", list)):
            if not isinstance(rec.get(key), kind):
                bad(n, f"field {key!r} missing or not a {kind.__name__}")
        files = rec["files"]
        for rel, text in files.items():
            parts = PurePosixPath(rel).parts
            if not rel or rel.startswith("/") or ".." in parts or not isinstance(text, str):
                bad(n, f"files[{rel!r}]: expected a relative path inside the repository and its text")
        tests = rec["tests"]
        if not tests or not all(isinstance(t, str) and t in files for t in tests):
            bad(n, "tests: expected a non-empty list of paths among 'files'")
        cmd = rec.get("command", list(DEFAULT_COMMAND))
        if not (isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd)):
            bad(n, "command: expected a non-empty list of strings (argv)")
        out.append(RepoProblem(rec["id"], rec["prompt"], dict(files), tuple(tests), tuple(cmd)))
    if not out:
        raise ValueError(f"{p}: no problems")
    return out


def run_tests(folder: str | Path, problem: RepoProblem, wall_s: float, memory_mb: int = 4096,
              file_mb: int = 256) -> tuple[bool, str]:
    """Run the problem's tests on a copy of `folder` with its test files restored: (passed, the output's tail)."""
    with tempfile.TemporaryDirectory(prefix="gyre-repo-score-") as tmp:
        work = Path(tmp) / "repo"
        if Path(folder).is_dir():
            shutil.copytree(folder, work, symlinks=True, ignore=shutil.ignore_patterns(".harness.stderr"))
        work.mkdir(exist_ok=True)
        for rel in problem.tests:
            target = work / rel
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.is_symlink() or target.exists():
                target.unlink()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(problem.files[rel])
        argv = [a.replace("{python}", sys.executable) for a in problem.command]
        argv, pre = limited(argv, memory_mb, file_mb)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            res = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=wall_s,
                                 preexec_fn=pre, start_new_session=True)
        except subprocess.TimeoutExpired:
            return False, f"the tests ran past {wall_s} s"
        return res.returncode == 0, (res.stdout + res.stderr)[-400:]


class RepoTask(HarnessTask):
    """Repository repair behind the harness task (see the module docstring)."""

    config_class = RepoTaskConfig

    def __init__(self, config: RepoTaskConfig, seed: int) -> None:
        super().__init__(config, seed, problems=read_repo_problems(config.problems))

    def score(self, group: HarnessGroup) -> list[Score]:
        """Per execution (recorder order): 1 if the problem's tests pass on what it left, else 0; dropped ones
        (past the overall timeout) are not scored."""
        cfg = self.cfg
        out = []
        for ep in sorted(group.episodes, key=lambda e: e.cursor.id):
            truncated = ep.cursor.status == "truncated"
            if ep.dropped:
                out.append(Score(execution=ep.cursor.id, reward=0.0, truncated=truncated, outcome="overall_timeout"))
                continue
            ok, _ = run_tests(ep.cwd, group.problem, cfg.score_wall_s, cfg.memory_mb, cfg.file_mb)
            out.append(Score(execution=ep.cursor.id, reward=1.0 if ok else 0.0, truncated=truncated))
        return out
