"""The environment contract: the backend uses a task through gyre.real.task_api's Protocols and nothing else."""

from __future__ import annotations

import dataclasses

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from gyre.real.agent import AgentTask  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.runner import run_real  # noqa: E402
from gyre.real.task_api import CONTRACT, OPTIONAL, TaskError, load_task  # noqa: E402
from gyre.real.task import TaskConfig  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")
TOUCHED: set[tuple[str, str]] = set()
# the proxies travel to the tool worker that scores a group (pickled): pickling's own dunders are no task surface
DUNDER_OK = {"__class__", "__dict__", "__getattribute__", "__repr__", "__reduce__", "__reduce_ex__", "__getstate__",
             "__setstate__", "__getnewargs_ex__", "__getnewargs__"}


class _Strict:
    """A proxy that records every attribute the backend reads and fails on any the contract does not name."""

    def __init__(self, obj, kind: str) -> None:
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_kind", kind)

    def __getattribute__(self, name: str):
        if name in ("_obj", "_kind") or name in DUNDER_OK:
            return object.__getattribute__(self, name)
        kind = object.__getattribute__(self, "_kind")
        TOUCHED.add((kind, name))
        if name not in CONTRACT[kind] + OPTIONAL[kind]:
            raise AssertionError(f"the backend read {kind}.{name}, which the contract does not name")
        val = getattr(object.__getattribute__(self, "_obj"), name)
        if kind == "TaskGroup" and name == "episodes":
            return [_Strict(e, "Episode") for e in val]
        return val


class StrictTask(_Strict):
    """The built-in agent task behind strict proxies (a task class the backend loads by dotted path)."""

    config_class = TaskConfig

    def __init__(self, config, seed: int) -> None:
        inner = AgentTask(config, seed)

        class _Face:  # the task's own surface, translated to and from proxies
            config_class = TaskConfig
            stop = inner.stop
            max_context = inner.max_context

            @staticmethod
            def new_group(index, size):
                return _Strict(inner.new_group(index, size), "TaskGroup")

            @staticmethod
            def score(group):
                return inner.score(object.__getattribute__(group, "_obj"))

        super().__init__(_Face, "Task")


def test_backend_uses_nothing_but_the_contract(pool):
    """A real run of the agent task behind proxies that fail on any other attribute completes and trains, its
    groups scored on the tool workers."""
    cfg = preset_tiny_test()
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, task_class=f"{__name__}:StrictTask"))
    TOUCHED.clear()
    r = run_real(cfg, "colocate", pool=pool)
    assert len(r.metrics.steps) == cfg.steps, f"{len(r.metrics.steps)} steps of {cfg.steps}"
    allowed = {(k, n) for k, names in CONTRACT.items() for n in names + OPTIONAL[k]}
    assert TOUCHED <= allowed, f"outside the contract: {TOUCHED - allowed}"
    need = {("Task", "new_group"), ("Task", "score"), ("Task", "stop"), ("TaskGroup", "recorder"),
            ("Episode", "start"), ("Episode", "on_generated"), ("Episode", "on_tool")}
    assert need <= TOUCHED, f"the run never used {need - TOUCHED}"
    errors = [x[3] for x in r.log if x[0] == "note" and x[2] == "score_error"]
    assert not errors, f"scoring failed: {errors[:1]}"


class NoScore:
    config_class = TaskConfig
    stop = [2]
    max_context = 64

    def __init__(self, config, seed):
        pass

    def new_group(self, index, size):
        raise AssertionError("never called")


class BadEpisodes(AgentTask):
    def new_group(self, index, size):
        g = super().new_group(index, size)
        g.episodes = [object()]
        return g


@pytest.mark.parametrize("cls, needle", [("NoScore", "lacks score"), ("BadEpisodes", "episodes lack start"),
                                         ("TaskConfig", "no dataclass config_class")])
def test_a_task_that_breaks_the_contract_is_one_line(cls, needle):
    """A task class missing a contract member (on itself, its groups or its episodes) is one TaskError line."""
    with pytest.raises(TaskError, match=needle) as err:
        load_task(f"{__name__}:{cls}", TaskConfig(), 0)
    assert "\n" not in str(err.value), str(err.value)


def test_cli_refuses_an_undeclared_task_field_and_a_broken_task(tmp_path):
    """`[cluster.task]` takes only fields the task declares, and a class breaking the contract is refused: one
    line, exit 2, before Ray starts."""
    from typer.testing import CliRunner

    from gyre.bridge.cli import app

    bad = tmp_path / "problems.jsonl"
    bad.write_text('{"id": "a", "prompt": "p", "tests": ["assert True"]}\n{"id": "b", "prompt": "p"}\n')
    code = '[cluster]\ntask_class = "gyre.real.tasks.code:CodeTask"\n[cluster.task]\n'
    for body, needle in [(code + 'max_new = 3\n', "unknown field 'cluster.task.max_new'"),
                         (code + f'problems = "{bad}"\n', f"{bad}:2: field 'tests' missing or not a list"),
                         (f'[cluster]\ntask_class = "{__name__}:NoScore"\n', "lacks score")]:
        cfg = tmp_path / "bad.toml"
        cfg.write_text(body)
        res = CliRunner().invoke(app, ["run", "--policy", "colocate", "--config", str(cfg), "--out", str(tmp_path)])
        line = res.output.strip()
        assert res.exit_code == 2 and needle in line and "\n" not in line, f"exit {res.exit_code}: {res.output}"
