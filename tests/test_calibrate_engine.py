"""gyre-sim calibrate-engine: a fit recovers known coefficients, the report's exact keys, one-line bad input."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gyre.roofline import Coefficients
from gyre.sim.cli.app import app
from gyre.sim.vllm_check.engine_fit import fit_report, errors, load_engine, simulate
from gyre.sim.vllm_check.serving_run import read_run, split_by_arrival

runner = CliRunner()
TRUE = replace(Coefficients(), eff_bw=0.7, eff_flops=0.5, step_overhead_s=0.003)
META = {"model": "meta-llama/Llama-3.1-8B", "hardware": {"device_name": "NVIDIA GeForce RTX 4090"},
        "engine_kwargs": {"tensor_parallel_size": 1, "data_parallel_size": 1, "max_num_seqs": 8,
                          "max_num_batched_tokens": 256},
        "kv_cache": {"num_gpu_blocks": 64, "block_size": 16, "gpu_memory_utilization": 0.9}}


def write_run(folder: Path, n: int = 40, coef: Coefficients = TRUE, meta: dict = META, t0: float = 5000.0) -> Path:
    """A run directory whose timestamps are the replay's own under `coef` (what a perfect model would log)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(json.dumps(meta))
    rng = np.random.default_rng(7)
    arrival = np.cumsum(rng.exponential(0.05, n))
    prompt = rng.integers(20, 300, n)
    out = rng.integers(5, 80, n)
    lines = [json.dumps({"request_id": f"r{i}", "input_toks": int(prompt[i]), "output_toks": int(out[i]),
                         "queued_ts": t0 + arrival[i], "scheduled_ts": t0 + arrival[i],
                         "first_token_ts": t0 + arrival[i] + 1, "last_token_ts": t0 + arrival[i] + 2})
             for i in range(n)]
    (folder / "requests.jsonl").write_text("\n".join(lines) + "\n")
    res = simulate(read_run(folder), coef)  # times from the first arrival
    b = t0 + arrival[0]
    lines = [json.dumps({"request_id": f"r{i}", "input_toks": int(prompt[i]), "output_toks": int(out[i]),
                         "queued_ts": t0 + arrival[i], "scheduled_ts": b + res.scheduled[i],
                         "first_token_ts": b + res.first_token[i], "last_token_ts": b + res.last_token[i]})
             for i in range(n)]
    (folder / "requests.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "timeseries.csv").write_text("t,running,waiting\n1.0,3,0\n2.0,1,0\n")
    return folder


def test_errors_match_a_naive_computation(tmp_path):
    """The four errors equal a plain-Python recomputation from the timestamps (makespan: whole run)."""
    run = read_run(write_run(tmp_path / "run"))
    res = simulate(run, replace(TRUE, eff_bw=0.9))
    r = run.requests
    idx = np.arange(10, 40)
    e2e = [abs((res.last_token[i] - r.queued[i]) / (r.last_token[i] - r.queued[i]) - 1) for i in idx]
    ttft = [abs((res.first_token[i] - r.queued[i]) / (r.first_token[i] - r.queued[i]) - 1) for i in idx]
    mk = (max(res.last_token) - min(r.queued)) / (max(r.last_token) - min(r.queued))
    got = errors(r, res, idx)
    assert got["e2e_median_rel_err"] == pytest.approx(statistics.median(e2e)), got
    assert got["ttft_median_rel_err"] == pytest.approx(statistics.median(ttft)), got
    assert got["makespan_rel_err"] == pytest.approx(abs(mk - 1)), got
    assert got["e2e_median_rel_err"] > 0.01, "a 0.9 / 0.7 bandwidth change shows in the errors"


def test_fit_recovers_the_model_that_made_the_run(tmp_path):
    """On a run its own model produced, the fit's held-out errors are near zero, and far below the defaults'."""
    run = read_run(write_run(tmp_path / "run"))
    rep = fit_report(run, 0.7)
    assert rep["calibrated"]["e2e_median_rel_err"] < 0.01, rep["calibrated"]
    assert rep["calibrated"]["makespan_rel_err"] < 0.01, rep["calibrated"]
    assert rep["uncalibrated"]["e2e_median_rel_err"] > 0.05, rep["uncalibrated"]
    assert rep["test_requests"] == 12 and rep["fit_requests"] == 28


def test_split_by_arrival():
    """The first round(n * frac) requests fit, the rest are held out; both sides keep at least one."""
    a, b = split_by_arrival(10, 0.7)
    assert a.tolist() == list(range(7)) and b.tolist() == [7, 8, 9]
    a, b = split_by_arrival(3, 0.99)
    assert len(a) == 2 and len(b) == 1


def test_cli_fit_then_apply(tmp_path):
    """calibrate-engine writes engine.json, a report with exactly the issue's keys, and two figures; applying
    the true coefficients with --engine reports (near) zero error on the whole run."""
    run = write_run(tmp_path / "run")
    eng, rep, figs = tmp_path / "engine.json", tmp_path / "report.json", tmp_path / "figs"
    r = runner.invoke(app, ["calibrate-engine", str(run), "-o", str(eng), "--report", str(rep), "--figures", str(figs)])
    assert r.exit_code == 0, r.output
    report = json.loads(rep.read_text())
    keys = {"e2e_median_rel_err", "e2e_p90_rel_err", "ttft_median_rel_err", "makespan_rel_err"}
    assert set(report) == {"calibrated", "uncalibrated"} and all(set(v) == keys for v in report.values()), report
    assert load_engine(eng).eff_bw > 0
    assert {p.name for p in figs.iterdir()} == {"latency.png", "running.png"}
    truth = tmp_path / "true.json"
    coeffs = {"eff_bw": 0.7, "eff_flops": 0.5, "step_overhead_s": 0.003}
    truth.write_text(json.dumps({"gyre_engine": 1, "coeffs": coeffs}))
    r = runner.invoke(app, ["calibrate-engine", str(run), "--engine", str(truth), "--report", str(rep)])
    assert r.exit_code == 0, r.output
    cal = json.loads(rep.read_text())["calibrated"]
    assert cal["e2e_p90_rel_err"] < 1e-9 and cal["makespan_rel_err"] < 1e-9, cal


def _bad_meta(meta: dict, **kw) -> dict:
    m = json.loads(json.dumps(meta))
    for k, v in kw.items():
        m[k] = v
    return m


def _line(path: Path, n: int, **changes) -> None:
    lines = path.read_text().splitlines()
    rec = json.loads(lines[n - 1])
    for k, v in changes.items():
        if v is None:
            del rec[k]
        else:
            rec[k] = v
    lines[n - 1] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")


BAD = {
    "no meta": (lambda d: (d / "meta.json").unlink(), "meta.json: missing"),
    "meta not JSON": (lambda d: (d / "meta.json").write_text("{\n oops"), "meta.json:2: not JSON"),
    "meta without max_num_seqs": (
        lambda d: (d / "meta.json").write_text(json.dumps(_bad_meta(META, engine_kwargs={
            "tensor_parallel_size": 1, "max_num_batched_tokens": 256}))), "field 'max_num_seqs' is missing"),
    "non-numeric field": (lambda d: _line(d / "requests.jsonl", 3, output_toks="many"),
                          "requests.jsonl:3: field 'output_toks' is not a number"),
    "missing field": (lambda d: _line(d / "requests.jsonl", 2, first_token_ts=None),
                      "requests.jsonl:2: field 'first_token_ts' is missing"),
    "first token before scheduling": (lambda d: _line(d / "requests.jsonl", 4, first_token_ts=1.0),
                                      "requests.jsonl:4: first_token_ts 1.0 is before scheduled_ts"),
    "unknown model": (lambda d: (d / "meta.json").write_text(json.dumps(_bad_meta(META, model="acme/Foo-7B"))),
                      "unknown model 'acme/Foo-7B'; known: "),
    "unknown GPU": (lambda d: (d / "meta.json").write_text(json.dumps(_bad_meta(META, hardware={"device_name": "TPU"}))),
                    "unknown GPU 'TPU'; known: "),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2(tmp_path, case):
    """Each bad input: exit 2, one error line naming the file and line or field, no traceback."""
    d = write_run(tmp_path / "run", n=6)
    breaker, needle = BAD[case]
    breaker(d)
    r = runner.invoke(app, ["calibrate-engine", str(d), "-o", str(tmp_path / "e.json")])
    out = " ".join(r.output.split())
    assert r.exit_code == 2, (case, r.exit_code, r.output)
    assert needle in out and "Traceback" not in r.output, (case, r.output)
    assert r.output.strip().count("error:") == 1, r.output


def test_unknown_preset_says_how_to_add_one(tmp_path):
    """An unknown GPU lists the presets and names where to add one."""
    d = write_run(tmp_path / "run", n=6)
    (d / "meta.json").write_text(json.dumps(_bad_meta(META, hardware={"device_name": "TPU v5"})))
    r = runner.invoke(app, ["calibrate-engine", str(d)])
    out = " ".join(r.output.split())
    assert "rtx4090" in out and "rtxpro6000" in out and "gyre/presets.py" in out, out


def test_bad_engine_file(tmp_path):
    """--engine with an efficiency above 1 names the field."""
    d = write_run(tmp_path / "run", n=6)
    bad = tmp_path / "e.json"
    bad.write_text(json.dumps({"gyre_engine": 1, "coeffs": {"eff_bw": 1.5}}))
    r = runner.invoke(app, ["calibrate-engine", str(d), "--engine", str(bad)])
    assert r.exit_code == 2 and "coeffs.eff_bw must be in (0, 1]" in " ".join(r.output.split()), r.output


def test_run_uses_engine_coefficients(tmp_path):
    """`gyre-sim run --engine` simulates with the file's coefficients: halving both efficiencies slows the run,
    exactly as setting them on the preset does, and `replay --engine` of the run's trace agrees; a bad file is
    one line, exit 2."""
    from gyre.config import override
    from gyre.presets import get_preset
    from gyre.sim.harness.runner import simulate as sim_run

    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"gyre_engine": 1, "coeffs": {"eff_bw": 0.4, "eff_flops": 0.3}}))
    makespans = []
    trace = tmp_path / "trace.jsonl"
    for extra in (["--trace-out", str(trace)], ["--engine", str(slow)]):
        out = tmp_path / f"out{len(makespans)}"
        r = runner.invoke(app, ["run", "--preset", "short-math", "--steps", "1", "--out", str(out), *extra])
        assert r.exit_code == 0, r.output
        makespans.append(json.loads((out / "summary.json").read_text())["results"][0]["makespan_s"])
    r = runner.invoke(app, ["replay", str(trace), "--policy", "colocate", "--out", str(tmp_path / "rep"),
                            "--engine", str(slow)])
    assert r.exit_code == 0, r.output
    replayed = json.loads((tmp_path / "rep" / "summary.json").read_text())["results"][0]["makespan_s"]
    assert replayed == pytest.approx(makespans[1]), "replay --engine runs the same slower engine as run --engine"
    cfg = get_preset("short-math")
    coef = replace(cfg.cluster.cost.engine, eff_bw=0.4, eff_flops=0.3)
    direct = sim_run(override(cfg, steps=1, **{"cluster.cost.engine": coef}), "colocate")
    assert makespans[1] > makespans[0], makespans
    assert makespans[1] == pytest.approx(direct.makespan_s), (makespans, direct.makespan_s)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = runner.invoke(app, ["run", "--preset", "short-math", "--steps", "1", "--out", str(tmp_path / "o"),
                            "--engine", str(bad)])
    assert r.exit_code == 2 and "bad.json:1: not JSON" in " ".join(r.output.split()), r.output


def test_simulator_engine_agrees_with_the_step_loop_when_limits_do_not_bind(tmp_path):
    """With max_num_seqs and KV far from binding, the simulator's fluid engine (gyre.sim.cluster.engine) finishes each
    request where the step-by-step scheduler does, up to the fluid approximation (median within 2%)."""
    from gyre.sim.vllm_check.sim_replay import sim_engine_replay

    meta = json.loads(json.dumps(META))
    meta["engine_kwargs"]["max_num_seqs"] = 256
    meta["kv_cache"]["num_gpu_blocks"] = 10_000
    for n in (1, 40):
        run = read_run(write_run(tmp_path / f"r{n}", n=n, meta=meta))
        steps = simulate(run, TRUE).last_token
        start, finish, _ = sim_engine_replay(run, TRUE)
        assert np.median(np.abs(finish / steps - 1)) < 0.02, (n, finish, steps)
        assert (start >= run.requests.queued - 1e-9).all() and (finish > start).all()


SHARED = Path("/work/shared/data/vllm_timings")


@pytest.mark.skipif(not SHARED.exists(), reason="the shared vLLM runs are not on this machine")
def test_simulator_engine_replays_the_shared_runs():
    """Both real runs go through the simulator's engine to the end (every request finishes, none early), at the
    defaults and at coefficients near each run's fit (a float residue of the prefill queue once crashed it)."""
    from gyre.sim.vllm_check.sim_replay import sim_engine_replay

    fits = [Coefficients(), replace(Coefficients(), eff_bw=0.9608855201739136, eff_flops=0.9257711313018345,
                    step_overhead_s=0.001701417108466772),
            replace(Coefficients(), eff_bw=0.5182, eff_flops=0.3854, step_overhead_s=0.0061, allreduce_s=1.9e-5)]
    for d in sorted(p for p in SHARED.iterdir() if (p / "meta.json").exists()):
        run = read_run(d)
        for coef in fits:
            start, finish, _ = sim_engine_replay(run, coef)
            assert np.isfinite(finish).all() and (finish > run.requests.queued).all(), (d.name, coef)


def test_moe_tensor_and_data_parallel_run(tmp_path):
    """An MoE model (Qwen3-30B-A3B by its Hugging Face id) on 2 replicas of 2 GPUs, KV capacity derived from
    memory (no logged blocks): applying the coefficients that made the run reproduces it exactly, and one
    replica alone would finish later."""
    meta = {"model": "Qwen/Qwen3-30B-A3B", "hardware": {"device_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition"},
            "engine_kwargs": {"tensor_parallel_size": 2, "data_parallel_size": 2, "max_num_seqs": 16,
                              "max_num_batched_tokens": 512}}
    coef = replace(TRUE, allreduce_s=2e-5)
    run = read_run(write_run(tmp_path / "moe", n=30, coef=coef, meta=meta))
    rep = fit_report(run, None, coef)
    assert rep["calibrated"]["e2e_p90_rel_err"] < 1e-9 and rep["calibrated"]["makespan_rel_err"] < 1e-9, rep
    one = replace(run, engine=replace(run.engine, data_parallel=1))
    assert simulate(one, coef).last_token.max() > simulate(run, coef).last_token.max(), "two replicas finish sooner"


def test_simulator_engine_follows_the_step_loop_when_max_num_seqs_binds(tmp_path):
    """40 requests arriving in 2 s through an engine that runs at most 4 (KV far from binding): the simulator's
    engine queues them as the step loop does, so each request finishes where the step loop says (median
    within 3%), and a run without the cap would finish the median request much sooner."""
    from gyre.sim.vllm_check.sim_replay import sim_engine_replay

    meta = json.loads(json.dumps(META))
    meta["engine_kwargs"]["max_num_seqs"] = 4
    meta["kv_cache"]["num_gpu_blocks"] = 10_000
    run = read_run(write_run(tmp_path / "capped", n=40, meta=meta))
    steps = simulate(run, TRUE).last_token
    start, finish, _ = sim_engine_replay(run, TRUE)
    assert np.median(np.abs(finish / steps - 1)) < 0.03, np.median(np.abs(finish / steps - 1))
    meta["engine_kwargs"]["max_num_seqs"] = 256
    free = read_run(write_run(tmp_path / "free", n=40, meta=meta))
    _, uncapped, _ = sim_engine_replay(free, TRUE)
    assert np.median(uncapped) < 0.8 * np.median(finish), (np.median(uncapped), np.median(finish))
