"""Benchmark: the engine cost model against real vLLM runs (the targets of `gyre-sim calibrate-engine`).

For every run directory (default: all of shared/data/vllm_timings; data: LLMServingSim's vLLM 0.19
validation runs, MIT licence):

1. fit on the first 70% of requests by arrival, report the held-out 30%: calibrated median end-to-end
   error (target <= 10%) and makespan error (<= 5%); uncalibrated (Coefficients' cited defaults)
   median end-to-end error (<= 25%), also read as "data sheets alone" (efficiencies 1, no overheads);
   and the simulator's own engine (gyre.sim.cluster.engine, what `gyre-sim
   run` uses) on the same held-out requests with the calibrated coefficients;
2. cross-hardware: each run's fitted coefficients applied to every other run with that run's own GPU
   and model presets (errors on the whole run), and the fitted efficiencies side by side as the rates
   they stand for (eff_flops x the GPU's compute peak, which is its measured large-GEMM rate where the
   preset cites one, `GpuConfig.bf16_tflops_gemm`; eff_bw x its bandwidth). The issue's target (<= 15%)
   is for the same model on another GPU; the shared runs are not such a pair (Llama-3.1-8B TP1 on an
   RTX 4090 vs Qwen3-32B TP2 on RTX PRO 6000s), so this shows how far the coefficients travel across
   model, GPU and TP at once;
3. why, in numbers: step times measured from timeseries.csv (seconds with no prompt throughput:
   mean running / generation throughput; seconds of prefill-only saturation: tokens/s) against the
   roofline at the defaults and at the fit. The decode context is approximated by the mean over
   requests of input + output / 2 (the timeseries does not log it).

4. one table of every target against its figure: per run the calibrated and uncalibrated errors, and
   per pair of runs of the same model on different GPUs the cross-GPU error (target <= 15%).

    .venv/bin/python benchmarks/bench_calibrate_engine.py [RUN_DIR ...] [--runs DIR ...] [--split 0.7] [--json OUT]

RUN_DIR ... replaces the default set; --runs DIR ... adds folders to it (e.g. held-out runs fetched by
hand, see docs/calibrate-engine.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from gyre.roofline import Coefficients
from gyre.sim.vllm_check.engine_fit import fit_report, coef_dict, errors, setup, simulate
from gyre.sim.vllm_check.serving_run import read_run

DATA = Path("/work/shared/data/vllm_timings")
IDEAL = Coefficients(eff_bw=1.0, eff_kv=1.0, eff_flops=1.0, step_overhead_s=0.0, allreduce_s=0.0, eff_link=1.0)


def measured_steps(run) -> dict[str, float]:
    """Decode step time at the largest and smallest running counts (pure-decode seconds) and prefill tokens/s."""
    ts = run.timeseries
    out: dict[str, float] = {}
    if ts is None or "gen_throughput" not in ts or "prompt_throughput" not in ts:
        return out
    run_avg = 0.5 * (ts["running"][1:] + ts["running"][:-1])
    gen, prm = ts["gen_throughput"][1:], ts["prompt_throughput"][1:]
    dec = (prm == 0) & (gen > 0) & (run_avg >= 1)
    if dec.any():
        full = dec & (run_avg >= 0.95 * run_avg[dec].max())
        small = dec & (run_avg <= 4)
        out["decode_full_batch"] = float(np.median(run_avg[full]))
        out["decode_full_step_s"] = float(np.median(run_avg[full] / gen[full]))
        if small.any():
            out["decode_small_batch"] = float(np.median(run_avg[small]))
            out["decode_small_step_s"] = float(np.median(run_avg[small] / gen[small]))
    pre = prm > 0.8 * prm.max()
    out["prefill_tok_s"] = float(np.median(prm[pre]))
    return out


def predicted_steps(run, coef: Coefficients, meas: dict[str, float]) -> dict[str, float]:
    roof, args = setup(run, coef)
    r = run.requests
    ctx = float(np.mean(r.input_toks + r.output_toks / 2))
    out = {}
    for k in ("full", "small"):
        if f"decode_{k}_batch" in meas:
            n = round(meas[f"decode_{k}_batch"])
            out[f"decode_{k}_step_s"] = roof.step_time(n, n * ctx)
    b = args.max_num_batched_tokens
    out["prefill_tok_s"] = b / roof.step_time(0, 0.0, b, float(np.mean(r.input_toks)) / 2)
    return out


def print_targets(rows: dict) -> None:
    """One table: every target of the engine model against its measured figure."""
    print("\ntargets vs measured (held-out 30% unless marked; cross-GPU on the whole run)")
    print(f"  {'run':<44} {'target':<34} {'limit':>6} {'measured':>9}  ")
    lines = []
    for name, r in rows.items():
        if name == "cross":
            continue
        c, u = r["calibrated"], r["uncalibrated"]
        lines += [(name, "calibrated e2e median", 0.10, c["e2e_median_rel_err"]),
                  (name, "calibrated makespan", 0.05, c["makespan_rel_err"]),
                  (name, "calibrated TTFT median", 0.20, c["ttft_median_rel_err"]),
                  (name, "uncalibrated e2e median", 0.25, u["e2e_median_rel_err"])]
    for pair, e in rows.get("cross", {}).items():
        if e["same_model"]:
            lines.append((pair, "cross-GPU e2e median (same model)", 0.15, e["e2e_median_rel_err"]))
    for name, what, lim, got in lines:
        print(f"  {name:<44} {what:<34} {lim:>6.0%} {got:>9.1%}  {'PASS' if got <= lim else 'MISS'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--split", type=float, default=0.7)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--runs", nargs="+", type=Path, default=[], dest="extra",
                    help="run folders to add to the default set (or to RUN_DIR ...)")
    a = ap.parse_args()
    dirs = (a.runs or sorted(p for p in DATA.iterdir() if (p / "meta.json").exists())) + a.extra
    runs = {d.name: read_run(d) for d in dirs}
    fits, rows = {}, {}
    print(f"# engine calibration against real vLLM runs (data: LLMServingSim, MIT); split {a.split}")
    for name, run in runs.items():
        t = time.time()
        rep = fit_report(run, a.split)
        fits[name] = rep["coef"]
        c, u = rep["calibrated"], rep["uncalibrated"]
        ok = (c["e2e_median_rel_err"] <= 0.10, c["makespan_rel_err"] <= 0.05, u["e2e_median_rel_err"] <= 0.25)
        rows[name] = {"calibrated": c, "uncalibrated": u, "coeffs": coef_dict(rep["coef"]), "fitted": rep["fitted"]}
        e = run.engine
        ep = f", expert parallel over {e.tensor_parallel * e.data_parallel} GPUs" if e.expert_parallel else ""
        print(f"\n{name}: {run.model} ({run.model_cfg.name}) on DP {e.data_parallel} x TP {e.tensor_parallel} x "
              f"{run.gpu} ({run.gpu_cfg.name}){ep}; {len(run.requests)} requests, fit {time.time() - t:.0f} s, "
              f"{rep['fit_evaluations']} replays")
        fitted = {k: v for k, v in coef_dict(rep["coef"]).items() if k in rep["fitted"]}
        print("  fitted: " + ", ".join(f"{k} = {v:.4g}" for k, v in fitted.items()))
        mark = ["PASS" if x else "MISS" for x in ok]
        print(f"  calibrated, held out : e2e median {c['e2e_median_rel_err']:.1%} (<= 10%: {mark[0]}), "
              f"p90 {c['e2e_p90_rel_err']:.1%}, ttft median {c['ttft_median_rel_err']:.1%}, "
              f"makespan {c['makespan_rel_err']:.1%} (<= 5%: {mark[1]})")
        sim = rep["simulator"]
        rows[name]["simulator"] = sim
        print(f"  simulator's engine   : e2e median {sim['e2e_median_rel_err']:.1%}, p90 {sim['e2e_p90_rel_err']:.1%}, "
              f"makespan {sim['makespan_rel_err']:.1%} (gyre.sim.cluster.engine, calibrated coefficients, held out)")
        print(f"  uncalibrated         : e2e median {u['e2e_median_rel_err']:.1%} (<= 25%: {mark[2]}), "
              f"p90 {u['e2e_p90_rel_err']:.1%}, ttft median {u['ttft_median_rel_err']:.1%}, "
              f"makespan {u['makespan_rel_err']:.1%}")
        ideal = errors(run.requests, simulate(run, IDEAL), rep["_test"])
        rows[name]["specs_only"] = ideal
        print(f"  specs only           : e2e median {ideal['e2e_median_rel_err']:.1%} (<= 25%: "
              f"{'PASS' if ideal['e2e_median_rel_err'] <= 0.25 else 'MISS'}), makespan {ideal['makespan_rel_err']:.1%} "
              "(efficiencies 1, no overheads: the data sheets alone)")
        meas = measured_steps(run)
        if meas:
            pd_, pf = predicted_steps(run, Coefficients(), meas), predicted_steps(run, rep["coef"], meas)
            rows[name]["steps"] = {"measured": meas, "defaults": pd_, "fit": pf}
            for k, label in (("decode_full_step_s", f"decode step, {meas.get('decode_full_batch', 0):.0f} running"),
                             ("decode_small_step_s", f"decode step, {meas.get('decode_small_batch', 0):.1f} running"),
                             ("prefill_tok_s", "prefill tokens/s, saturated")):
                if k in meas:
                    print(f"  why: {label:<32} measured {meas[k]:.4g}  defaults {pd_[k]:.4g}  fit {pf[k]:.4g}")
    if len(runs) > 1:
        print("\nwhat the fits stand for, per GPU (compute peak: the measured GEMM rate where the preset cites one)")
        for name, run in runs.items():
            g, c = run.gpu_cfg, fits[name]
            peak = g.bf16_tflops_gemm or g.bf16_tflops
            rows[name]["rates"] = {"compute_tflops": c.eff_flops * peak, "weights_tb_s": c.eff_bw * g.hbm_tb_s,
                                   "kv_tb_s": c.eff_kv * g.hbm_tb_s}
            print(f"  {name}: compute {c.eff_flops * peak:.0f} TFLOP/s = {c.eff_flops:.0%} of {peak:g} "
                  f"({'measured GEMM' if g.bf16_tflops_gemm else 'data sheet'}; {c.eff_flops * peak / g.bf16_tflops:.0%}"
                  f" of the data sheet's {g.bf16_tflops:g}), weights {c.eff_bw * g.hbm_tb_s:.2f} TB/s = "
                  f"{c.eff_bw:.0%}, KV {c.eff_kv * g.hbm_tb_s:.2f} TB/s = {c.eff_kv:.0%} of {g.hbm_tb_s:g} TB/s")
        print("\ncross-hardware, fitted on -> applied to (whole run; 'same model' pairs carry the <= 15% target)")
        cross = {}
        for src, coef in fits.items():
            for dst, run in runs.items():
                if src == dst:
                    continue
                rep = fit_report(run, None, coef)
                e = rep["calibrated"]
                same = runs[src].model_cfg.name == run.model_cfg.name and runs[src].gpu_cfg.name != run.gpu_cfg.name
                cross[f"{src} -> {dst}"] = {**e, "same_model": same}
                print(f"  {src} -> {dst}: e2e median {e['e2e_median_rel_err']:.1%}, "
                      f"makespan {e['makespan_rel_err']:.1%} "
                      f"(uncalibrated: {rep['uncalibrated']['e2e_median_rel_err']:.1%})"
                      f"{' [same model, other GPU]' if same else ''}")
        rows["cross"] = cross
    print_targets(rows)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2, default=list) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    sys.exit(main())
