"""A policy defined outside gyre, named by dotted path, works in `run`, `compare` and `replay`, and is
configured through its own typed config; a wrong dotted path is one line, exit 2."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

from gyre.handles import all_of
from gyre.policies import UnknownPolicy, make_policy
from gyre.policies.common import ClusterShape, engine_slots, spread
from gyre.sim.cli.app import app

runner = CliRunner()
PATH = f"{__name__}:HalfPool"


@dataclass(frozen=True, kw_only=True)
class HalfPoolConfig:
    engines: int = 1  # engines per step

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")


class HalfPool:
    """Colocate on `engines` engines only: a user's policy with its own config and sweep grid."""

    name = "halfpool"
    Config = HalfPoolConfig

    def __init__(self, config: HalfPoolConfig | None = None) -> None:
        self.config = config or HalfPoolConfig()

    @staticmethod
    def grid(shape: ClusterShape, etas: tuple[int, ...]) -> list[dict]:
        return [{"engines": 1}, {"engines": 2}]

    def run(self, cluster, steps: int):
        slots = engine_slots(range(cluster.n_gpus), cluster.gpus_per_engine)[: self.config.engines]
        for _ in range(steps):
            engines = yield all_of([cluster.start_engine(s) for s in slots])
            groups = [cluster.next_group() for _ in range(cluster.groups_per_step)]
            yield all_of(spread(cluster, [x for g in groups for x in g.executions], engines))
            yield all_of([cluster.stop_engine(e) for e in engines])
            yield cluster.train(cluster.free_gpus(), groups)


def test_make_policy_builds_the_typed_config():
    """Parameters become the policy's config; an unknown one or a refused value is one line naming it."""
    p = make_policy(PATH, engines=2)
    assert p.config == HalfPoolConfig(engines=2), p.config
    with pytest.raises(UnknownPolicy, match="no parameter 'eta'"):
        make_policy(PATH, eta=1)
    with pytest.raises(UnknownPolicy, match="engines must be >= 1"):
        make_policy(PATH, engines=0)


def test_run_and_compare_take_a_dotted_path(tmp_path):
    """`run` and `compare` simulate a policy named by dotted path; compare sweeps the policy's own grid."""
    res = runner.invoke(app, ["run", "--policy", PATH, "--preset", "short-math", "--steps", "1",
                              "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "run" / f"steps_{PATH}.csv").stat().st_size > 0, "no steps file for the user's policy"
    res = runner.invoke(app, ["compare", "--policy", PATH, "--preset", "short-math", "--steps", "1",
                              "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 0, res.output
    sweep = (tmp_path / "cmp" / "sweep.csv").read_text().splitlines()[1:]
    assert [ln.split(",")[0] for ln in sweep] == [f"{PATH}(engines=1)", f"{PATH}(engines=2)"], sweep


def test_replay_takes_a_dotted_path(tmp_path):
    """`replay TRACE --policy pkg.mod:Cls` replays through the user's policy; a wrong path is one line, exit 2."""
    trace = tmp_path / "run.jsonl"
    res = runner.invoke(app, ["run", "--policy", "colocate", "--preset", "short-math", "--steps", "1",
                              "--out", str(tmp_path / "run"), "--trace-out", str(trace)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["replay", str(trace), "--policy", PATH, "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "rep" / "summary.json").read_text())["results"]
    assert [r["policy"] for r in rows] == [PATH], rows
    for bad in (f"{__name__}:NoSuchPolicy", "no_such_module.sub:Policy"):
        res = runner.invoke(app, ["replay", str(trace), "--policy", bad, "--out", str(tmp_path / "bad")])
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and "cannot load policy" in lines[0], res.output
        assert "Traceback" not in res.output
