"""Sweeps run anywhere with the same results (gyre.sim.harness.sweep): in this process, a local process pool, or
Ray tasks."""

from __future__ import annotations

import time
import pytest

from gyre.sim.harness.sweep import run_map
from tests.simkit import tiny_config
from tests.sweepkit import mark_after, square_after


def test_local_pool_returns_in_order_and_reports_as_runs_finish():
    """Results come back in the order of the arguments, while on_done sees each run as it finishes (the slow
    first one last)."""
    seen: list[int] = []
    got = run_map(square_after, [(0, 1.0), (1, 0.0), (2, 0.0)], workers=2, on_done=lambda i, r: seen.append(i))
    assert got == [0, 1, 4], got
    assert sorted(seen) == [0, 1, 2] and seen[-1] == 0, f"finish order {seen}"


def _summary(tuned) -> list[dict]:
    from gyre.sim.harness.compare import tuned_table

    _, table, sweep = tuned_table(tuned)
    rows = table.drop(columns=[c for c in table.columns if "wall" in c]).to_dict("records")
    return rows + sweep.drop(columns=[c for c in sweep.columns if "wall" in c]).to_dict("records")


@pytest.mark.xdist_group("ray")  # with the other local-Ray tests, in one worker
def test_compare_on_ray_equals_the_local_pool(local_ray):
    """A tiny comparison (every policy tuned over its grid) run as Ray tasks gives the summary and sweep rows, the
    settings tried with their makespans and each best run's event log of the same comparison in two local worker
    processes (wall times aside)."""
    from gyre.sim.harness.compare import tune

    cfg = tiny_config(gpus=4, steps=2, seed=3)
    done: list[str] = []
    pool = tune(cfg, workers=2)
    on_ray = tune(cfg, ray="auto", on_done=lambda c, r: done.append(c.label))
    assert _summary(on_ray) == _summary(pool), "the Ray sweep's summary differs from the process pool's"
    assert sorted(on_ray) == sorted(pool), "the same rows"
    for name, t in pool.items():
        got = on_ray[name]
        assert (got.best, got.how) == (t.best, t.how), f"{name}: chose {got.best} ({got.how}), not {t.best}"
        assert [(c.label, m) for _, c, m in got.tried] == [(c.label, m) for _, c, m in t.tried], f"{name}: tried"
        assert got.result.log == t.result.log, f"{name}: the best run's event log differs"
    assert len(done) >= 3 and "colocate" in done, f"progress saw {done}"


@pytest.mark.xdist_group("ray")  # with the other local-Ray tests, in one worker
def test_interrupting_a_ray_sweep_cancels_its_tasks(local_ray, tmp_path):
    """An interrupt while a Ray sweep runs (raised here from the progress callback, as Ctrl-C would be) cancels the
    tasks still queued or running: none of them runs to its end."""
    jobs = [(str(tmp_path / "first"), 0.0)] + [(str(tmp_path / f"slow{i}"), 3.0) for i in range(3)]

    def interrupt(i, r):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_map(mark_after, jobs, ray="auto", on_done=interrupt)
    time.sleep(4.0)
    ran = sorted(p.name for p in tmp_path.iterdir())
    assert ran == ["first"], f"tasks that ran to the end after the interrupt: {ran}"
