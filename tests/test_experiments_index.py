"""experiments/README.md: it fits on two screens, indexes every experiment folder, and each headline figure in its
table is what the experiment's results files give (recomputed here from the CSVs, formatted as the README does)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

EXP = Path(__file__).resolve().parents[1] / "experiments"
README = EXP / "README.md"


def index_cells() -> list[list[str]]:
    """The five cells of every row of the README's index table."""
    rows = []
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("["):
            rows.append(cells)
    return rows


def index_rows() -> list[tuple[str, str]]:
    """(experiment column, headline column) of every row of the README's index table."""
    return [(c[0], c[3]) for c in index_cells()]


def headline(name: str, qualifier: str = "") -> str:
    """The headline cell of the row whose experiment column links `name` and is followed by `qualifier` alone."""
    hits = [h for e, h in index_rows() if e == f"[{name}]({name}/README.md)" + (f" ({qualifier})" if qualifier else "")]
    assert len(hits) == 1, f"experiments/README.md: {len(hits)} index rows for {name!r} {qualifier!r}"
    return hits[0]


def rng(values, fmt="{:.3f}") -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def expect(cell: str, *figures: str) -> None:
    missing = [f for f in figures if f not in cell]
    assert not missing, f"README headline {cell!r} lacks {missing} (the results files give them)"


def test_index_fits_two_screens_and_lists_every_experiment():
    """At most 100 lines; every folder with a run.py is in the index, and every indexed folder exists."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 100, f"experiments/README.md is {len(lines)} lines"
    folders = {p.parent.name for p in EXP.glob("*/run.py")}
    indexed = {re.match(r"\[([^\]]+)\]", e).group(1) for e, _ in index_rows()}
    assert folders == indexed, f"folders not indexed {folders - indexed}, indexed without a folder {indexed - folders}"


def test_index_results_files_exist():
    """Each file the results column names by its full name (no pattern) is committed under results/."""
    missing = []
    for cells in index_cells():
        name = re.match(r"\[([^\]]+)\]", cells[0]).group(1)
        first = cells[4].split("(")[0]  # names in parentheses are written by other modes of the command
        for f in re.findall(r"`([^`{}*]+\.(?:csv|png|json))`", first):
            if not f.startswith("..") and not (EXP / name / "results" / f).exists():
                missing.append(f"{name}/results/{f}")
    assert not missing, f"experiments/README.md names results files that do not exist: {missing}"


def test_no_experiment_patches_internals_or_imports_private_names():
    """No experiment script imports a private name from gyre, or assigns to a class's attribute or calls setattr
    (replacing an engine's method at run time, which the compiled build refuses)."""
    bad = []
    for path in EXP.glob("*/*.py"):
        text = path.read_text()
        private = re.search(r"from gyre[\w.]* import [^\n]*\b_[a-z]", text)
        patch = re.search(r"\b[A-Z]\w*\.\w+\s*=[^=]", text) or "setattr(" in text
        if private or patch:
            bad.append(path.name)
    assert not bad, f"experiments patching internals or importing private names: {bad}"


def test_elastic_vs_baselines_headlines():
    rows = {}
    for preset in ("xlong-swe", "short-math"):
        t = pd.read_csv(EXP / f"elastic_vs_baselines/results/{preset}_table.csv").set_index("policy")
        rows[preset] = t.loc["elastic"]
    expect(headline("elastic_vs_baselines"),
           f"xlong-swe: elastic {rows['xlong-swe']['speedup_vs_best_async']:.3f}x async",
           f"{rows['xlong-swe']['speedup_vs_colocate']:.2f}x colocate",
           f"short-math: {rows['short-math']['speedup_vs_best_async']:.3f}x async")


def test_run48_headline():
    s = pd.read_csv(EXP / "elastic_vs_baselines/results/run48_summary.csv")
    s = s[s["gpus"] == 1024]
    assert sorted(s["seed"]) == [0, 1, 2]
    expect(headline("elastic_vs_baselines", "48 steps at equal work"),
           f"elastic {rng(s['elastic_vs_async'])}x the best async", f"{rng(s['elastic_vs_colocate'])}x colocate")


def test_equal_work_headline():
    pairs = pd.concat([pd.read_csv(p) for p in sorted((EXP / "equal_work/results").glob("*steps.csv"))])
    assert pairs["equal_work"].all(), "a headline pair not at equal work"
    assert pairs["preset"].nunique() == 5
    kv = pairs[pairs["preset"] == "xlong-swe-kv"]
    med = [kv[kv["pair"] == f"eta {e}: elastic / async"]["speedup"].median() for e in (1, 2, 4)]
    async_pairs = pairs[pairs["pair"].str.endswith("/ async")]
    expect(headline("equal_work"), " / ".join(f"{m:.3f}x" for m in med), f">= {async_pairs['speedup'].min():.3f}x")


def test_regime_map_headline():
    maps = [pd.read_csv(EXP / f"regime_map/results/map_seed{s}.csv") for s in (0, 1, 2)]
    assert [len(m) for m in maps] == [16, 16, 16], "16 core cells per seed"
    meds = " / ".join(f"{m['elastic_vs_best'].median():.3f}x" for m in maps)
    n = sum(int((m["elastic_vs_best"] >= 0.99).sum()) for m in maps)
    expect(headline("regime_map"), f"medians {meds}", f"{n} of 48 cells >= 0.99x")


def test_sweep_tail_headline():
    s = pd.read_csv(EXP / "sweep_tail/results/sweep.csv")
    el = s[s["policy"] == "elastic"]
    c = pd.read_csv(EXP / "sweep_tail/results/cluster.csv")
    at1024 = c[(c["policy"] == "elastic") & (c["value"] == 1024)]["elastic_vs_async"].iloc[0]
    expect(headline("sweep_tail"), f"{rng(el['elastic_vs_colocate'], '{:.2f}')}x colocate",
           f"{rng(el['elastic_vs_async'], '{:.2f}')}x the largest-split async", f"1,024 GPUs {at1024:.3f}x async")


def test_paper_table_headline():
    d = pd.read_csv(EXP / "paper_table/results/paper_table_1024gpus_8steps_seed0.csv").set_index("row")
    paper_async = d.loc["async (paper's: pilot-balanced split)", "makespan_h"]
    vs = {k: paper_async / d.loc[r, "makespan_h"] for k, r in (
        ("elastic", "elastic (forecasting, defaults)"), ("async + streaming", "async + streaming (same split)"),
        ("waterlevel", "waterlevel (cells of 512, pool 0)"))}
    expect(headline("paper_table"), *(f"{k} {v:.2f}x" for k, v in vs.items()))
    cited = ["elastic (forecasting, defaults)", "async + streaming (same split)", "waterlevel (cells of 512, pool 0)"]
    assert d.loc[cited, "equal_work"].all(), "the headline's rows do equal work"


def test_streaming_headline():
    d = pd.read_csv(EXP / "streaming/results/streaming_8steps.csv")
    same = d[d["with streaming"] == "async + streaming (same split)"]
    med = {p: same[same["preset"] == p]["saving"].median() for p in ("xlong-swe-small", "xlong-swe-kv")}
    expect(headline("streaming"), f"{pct(med['xlong-swe-small'])} (xlong-swe-small)", f"{pct(med['xlong-swe-kv'])} (xlong-swe-kv)",
           pct(float(same["paper_saving"].iloc[0])))


def test_sim_faults_headline():
    r = pd.read_csv(EXP / "sim_faults/results/runs.csv")
    engines = r[r["faults"].str.contains("engine")]
    trainer = r[(r["policy"] == "async") & (r["faults"] == "1 trainer")]
    expect(headline("sim_faults"), f"{len(r)} runs, {int(r['executions_lost'].sum() + r['executions_duplicated'].sum())} lost",
           f"at most {pct(engines['slowdown'].max() - 1)}", f"async {trainer['slowdown'].max():.2f}x without checkpoints")


def test_engine_calibration_headline():
    b = json.loads((EXP / "engine_calibration/results/bench.json").read_text())
    runs = ("RTX4090_Llama-3.1-8B", "RTXPRO6000_Qwen3-32B")
    cal = " / ".join(pct(b[r]["calibrated"]["e2e_median_rel_err"]) for r in runs)
    unc = " / ".join(pct(b[r]["uncalibrated"]["e2e_median_rel_err"]) for r in runs)
    expect(headline("engine_calibration"), f"calibrated e2e median error {cal}", f"uncalibrated {unc}")


def test_trace_calibration_headline():
    t = pd.read_csv(EXP / "trace_calibration/results/recent_default.csv")
    g = t.groupby("mode").agg(marks=("marks_met", "sum"), ks=("ks_d", "mean"))
    assert g.loc["all", "marks"] == g.loc["auto", "marks"]
    expect(headline("trace_calibration"), f"both meet {int(g.loc['all', 'marks'])} marks",
           f"{g.loc['all', 'ks']:.3f} (all) vs {g.loc['auto', 'ks']:.3f} (auto)")


def test_real_stability_headline():
    r = pd.read_csv(EXP / "real_stability/results/runs.csv")
    med = r.groupby("lr")["reward_last5"].median()
    expect(headline("real_stability"), f"{int(r['stalled_since'].notna().sum())} of {len(r)} runs collapsed",
           f"{med[3e-3]:.3f} at lr 3e-3", f"{med[1e-2]:.3f} at 1e-2")


@pytest.mark.parametrize("preset", ["xlong-swe", "xlong-swe-kv"])
def test_trajectory_sampling_headline(preset):
    w = pd.read_csv(EXP / "trajectory_sampling/results/sim_work.csv")
    work = w[w["preset"] == preset].groupby("mode")["train_s_per_gpu"].sum()
    expect(headline("trajectory_sampling"),
           f"{work['J1'] / work['exact']:.3f} / {work['J5'] / work['exact']:.3f}{' of exact' if preset == 'xlong-swe' else ''} ({preset})")
