"""Every maintained experiment (experiments/README.md's index) runs its one command at its smallest flags and
writes its results files with the columns its README reads.

Each run writes into a temporary folder (`--out`), never into the committed results. paper_table and streaming
have no `--out`: their script is copied into the temporary folder and writes the `results/` beside it there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
DATA = Path("/work/shared/data")


def run(script: Path, *args: str, timeout: float = 60) -> str:
    """Runs `script` with `args` in the repository root; fails with its output unless it exits 0."""
    p = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script.relative_to(ROOT) if script.is_relative_to(ROOT) else script} {' '.join(args)}:\n" \
                              f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def columns(path: Path, *want: str, rows: int = 1) -> pd.DataFrame:
    """The CSV at `path`, asserted to exist, to hold at least `rows` rows and every column of `want`."""
    assert path.exists(), f"{path.name} not written (folder holds {sorted(p.name for p in path.parent.iterdir())})"
    d = pd.read_csv(path)
    missing = [c for c in want if c not in d.columns]
    assert not missing, f"{path.name}: no column {missing} (has {list(d.columns)})"
    assert len(d) >= rows, f"{path.name}: {len(d)} rows, expected >= {rows}"
    return d


def test_elastic_vs_baselines_run(tmp_path):
    """run.py --smoke: the selection, the three finals plus the bound row, and both figures."""
    run(EXP / "elastic_vs_baselines/run.py", "--preset", "short-math", "--steps", "1", "--select-steps", "1",
        "--jobs", "1", "--smoke", "--out", str(tmp_path))
    t = columns(tmp_path / "short-math_table.csv", "policy", "makespan_s", "speedup_vs_colocate",
                "speedup_vs_best_async", "makespan_over_bound", rows=4)
    assert list(t["policy"]) == ["colocate", "async", "elastic", "lower bound"], list(t["policy"])
    assert (t["makespan_s"].iloc[:3] >= t["makespan_s"].iloc[3] - 1e-6).all(), "a policy beat its lower bound"
    columns(tmp_path / "short-math_selection.csv", "policy", "makespan_s", "params", rows=2)
    for fig in ("short-math_timeline.png", "short-math_breakdown.png"):
        assert (tmp_path / fig).stat().st_size > 0, fig


def test_elastic_vs_baselines_run48_and_table48(tmp_path):
    """run48.py appends one row per call to its seed's file; table48.py reads them into the summary."""
    script = EXP / "elastic_vs_baselines/run48.py"
    common = ["--preset", "short-math", "--steps", "1", "--out", str(tmp_path)]
    run(script, "--policy", "colocate", *common)
    run(script, "--policy", "async", "--split", "32", "--cap", "2", *common)
    run(script, "--policy", "elastic", "--cap", "2", *common)
    rows = columns(tmp_path / "run48_short-math_s1_seed0.csv", "policy", "makespan_s", "sched_cuts", "executions",
                   "max_running", "rollout_gpus", rows=3)
    assert list(rows["policy"]) == ["colocate", "async", "elastic"], list(rows["policy"])
    run(EXP / "elastic_vs_baselines/table48.py", "--caps", "2", "--steps", "1", "--results", str(tmp_path))
    s = columns(tmp_path / "run48_summary.csv", "preset", "gpus", "seed", "elastic_vs_async", "elastic_vs_colocate",
                "elastic_vs_best")
    r = rows.set_index("policy")["makespan_s"]
    assert s["elastic_vs_async"].iloc[0] == pytest.approx(r["async"] / r["elastic"]), "summary ratio != row ratio"
    assert int(s["gpus"].iloc[0]) == 64, "short-math's preset cluster is 64 GPUs"


def test_equal_work(tmp_path):
    """run.py --smoke: one seed's compare rows and its headline pairs (every eta, and eta 0 against colocate)."""
    run(EXP / "equal_work/run.py", "--preset", "short-math", "--steps", "1", "--seeds", "0", "--smoke",
        "--out", str(tmp_path))
    pairs = columns(tmp_path / "short-math_1steps.csv", "pair", "speedup", "equal_work", "elastic_makespan_s",
                    "other_makespan_s", rows=5)
    assert pairs["speedup"].to_numpy() == pytest.approx((pairs["other_makespan_s"] / pairs["elastic_makespan_s"]).to_numpy())
    columns(tmp_path / "short-math_1steps_rows.csv", "policy", "makespan_s", "sched_cuts", "equal_work", "seed")


def test_regime_map(tmp_path):
    """run.py --cells one --steps 1: one cell's map row (with its seed) and its compare rows, and the figure."""
    run(EXP / "regime_map/run.py", "--cells", "one", "--steps", "1", "--jobs", "1", "--seed", "1", "--name", "m",
        "--out", str(tmp_path))
    m = columns(tmp_path / "m.csv", "window", "gpus", "seed", "colocate_s", "async_best_s", "elastic_s",
                "elastic_vs_best", "elastic_equal_work")
    assert int(m["seed"].iloc[0]) == 1, "--seed not carried into the map row"
    columns(tmp_path / "m_rows.csv", "policy", "makespan_s", "seed", rows=3)
    assert (tmp_path / "m.png").exists()


def test_sweep_tail(tmp_path):
    """run.py --steps 1: every (knob, value, policy) row with elastic's ratios, and the figure."""
    run(EXP / "sweep_tail/run.py", "--steps", "1", "--jobs", "1", "--out", str(tmp_path))
    d = columns(tmp_path / "sweep.csv", "knob", "value", "policy", "makespan_s", "equal_work", "elastic_vs_colocate",
                "elastic_vs_async", rows=3)
    assert set(d["knob"]) == {"tail", "tool"}, set(d["knob"])
    assert (tmp_path / "speedup.png").exists()


def test_sim_faults(tmp_path):
    """run.py --steps 1 --seeds 1: a row per policy and fault level, none lost or duplicated."""
    run(EXP / "sim_faults/run.py", "--steps", "1", "--seeds", "1", "--jobs", "1", "--out", str(tmp_path))
    d = columns(tmp_path / "runs.csv", "policy", "faults", "makespan_s", "slowdown", "executions_lost",
                "executions_duplicated", rows=6)
    assert (d["executions_lost"] == 0).all() and (d["executions_duplicated"] == 0).all()
    columns(tmp_path / "table.csv", "policy", "faults", "slowdown_median", "slowdown_max", "lost", "duplicated")


def test_trajectory_sampling_sim(tmp_path):
    """run.py sim --groups 2: the training work per preset and sampling mode."""
    run(EXP / "trajectory_sampling/run.py", "sim", "--groups", "2", "--out", str(tmp_path))
    d = columns(tmp_path / "sim_work.csv", "preset", "mode", "tokens", "paths", "train_s_per_gpu", rows=4)
    assert {"exact", "J1", "J5"} <= set(d["mode"]), set(d["mode"])


@pytest.mark.skipif(not (DATA / "vllm_timings").exists(), reason="needs shared/data/vllm_timings")
def test_engine_calibration(tmp_path):
    """run.py --grid 0.5: each serving run at its defaults, the data sheets and the one grid point."""
    run(EXP / "engine_calibration/run.py", "--grid", "0.5", "--out", str(tmp_path))
    d = columns(tmp_path / "uniform.csv", "run", "coefficients", "e2e_median_rel_err", "e2e_median_signed",
                "makespan_rel_err", rows=3)
    assert {"defaults", "data sheets", "x=0.5"} <= set(d["coefficients"]), set(d["coefficients"])


@pytest.mark.skipif(not DATA.exists(), reason="needs shared/data")
def test_trace_calibration(tmp_path):
    """run.py --traces 1 --draws 2000: both `--recent` modes on the first trace."""
    run(EXP / "trace_calibration/run.py", "--traces", "1", "--draws", "2000", "--out", str(tmp_path))
    d = columns(tmp_path / "recent_default.csv", "trace", "mode", "chosen", "quantity", "ks_d", "marks_met", rows=2)
    assert set(d["mode"]) == {"all", "auto"}, set(d["mode"])


@pytest.mark.parametrize("name, args, outputs", [
    ("paper_table", ["--gpus", "1024", "--steps", "1", "--no-hindsight"],
     {"paper_table_1024gpus_1steps_seed0.csv": ["row", "makespan_h", "executions", "sched_cuts", "busy_share"]}),
    ("streaming", ["--presets", "xlong-swe-small", "--seeds", "0", "--steps", "1", "--no-own-search"],
     {"streaming_1steps.csv": ["preset", "seed", "baseline", "with streaming", "saving", "equal_work"],
      "streaming_1steps_rows.csv": ["preset", "seed", "row", "makespan_h", "sched_cuts", "equal_work"]}),
])
def test_copied_runner(tmp_path, name, args, outputs):
    """paper_table and streaming (no --out): their run.py, copied, writes results/ beside the copy."""
    (tmp_path / name).mkdir()
    script = shutil.copy(EXP / name / "run.py", tmp_path / name / "run.py")
    run(Path(script), *args)
    for fname, cols in outputs.items():
        columns(tmp_path / name / "results" / fname, *cols)


@pytest.mark.xdist_group("ray")  # with the other local-Ray tests, in one worker
def test_real_stability(tmp_path, local_ray, monkeypatch):
    """run.py on tiny-test at its own lr, one seed, one step, in this process on the suite's local Ray node: one
    run's row. Its pool is the tiny-test pool the other Ray tests of this worker share (ActorPool.shared): ~2 s
    when warm; the first Ray test of a worker pays the actors' start (~20 s) whichever test it is."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["run.py", "--preset", "tiny-test", "--seeds", "1", "--steps", "1", "--lrs", "3e-3",
                                      "--out", str(tmp_path)])
    runpy.run_path(str(EXP / "real_stability/run.py"), run_name="__main__")
    columns(tmp_path / "runs.csv", "policy", "lr", "seed", "makespan_s", "reward_last5", "stalled_since")


def test_trajectory_sampling_elastic(tmp_path):
    """run.py elastic --seeds 1 --steps 2: a row per step and variant, both variants alike on step 1."""
    run(EXP / "trajectory_sampling/run.py", "elastic", "--seeds", "1", "--steps", "2", "--out", str(tmp_path))
    d = columns(tmp_path / "elastic_prediction.csv", "seed", "variant", "step", "predicted_end_s", "end_s", "error_s",
                rows=4)
    first = d[d["step"] == 1].set_index("variant")["predicted_end_s"]
    assert first["observed"] == first["blind"], "step 1 has no finished step to observe: the same prediction"
