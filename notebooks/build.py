"""Write the notebooks from the cells below and run them: `python notebooks/build.py` (`--no-execute`: cells only).

The notebooks are generated so that a review reads plain Python, and they are committed with their
outputs (run top to bottom on this interpreter, notebooks/ as the working folder, data from
notebooks/data/): tests/test_notebooks.py checks that each committed notebook's cells equal what this
script writes and that every code cell ran. Edit the cells here, never the .ipynb files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

# ----------------------------------------------------------------------------------------------- 01
POLICIES = [
    ("md", """
# Scheduling policies: colocate, async, elastic, and your own

Gyre decides, moment by moment, which GPUs generate rollouts and which train. This notebook runs the
three built-in policies on one small simulated workload, shows *where the GPU time goes*, turns one knob
to see the ranking change, and then writes a new policy in ~30 lines against the cluster interface and
runs it beside the others. Everything here runs in seconds on a laptop CPU (the SimPy simulator).
"""),
    ("code", """
import os

import pandas as pd

import gyre.notebook as nb
from gyre.config import override
from gyre.presets import MODELS, get_preset
from gyre.sim.harness.runner import simulate
from gyre.workload import LogNormal

%matplotlib inline
pd.set_option("display.precision", 3)
"""),
    ("md", """
## A small long-horizon workload

`xlong-swe-small` is a software-engineering agent workload (median 120 turns per rollout, a tail ten
times longer, tool calls between turns) on a 30B-A3B MoE and 64 H200s. A preset is a plain function
returning a `RunConfig`; `override` changes fields by dotted name (exactly what `gyre-sim run --gpus ...`
does). We shrink it to 32 GPUs, 8 GRPO groups of 8 executions per step and 4 steps.
"""),
    ("code", """
cfg = override(get_preset("xlong-swe-small"), steps=4, **{"cluster.gpus": 32, "workload.groups_per_step": 8})
costs = cfg.costs()  # derived from the model and GPU: never free knobs
print(f"{cfg.name}: {cfg.cluster.gpus} x {cfg.cluster.gpu.name}, model {cfg.cluster.model.name}, "
      f"{cfg.workload.groups_per_step} groups x {cfg.workload.group_size} executions per step, {cfg.steps} steps")
print(f"an engine takes {costs.engine_gpus} GPU and holds {costs.kv_capacity_tokens:,} KV tokens; "
      f"training needs >= {costs.min_train_gpus} GPUs; a weight sync takes {costs.sync_s:.1f} s")
"""),
    ("md", """
## Three policies, same workload, same seed

- **colocate**: every GPU generates the step's rollouts, then every GPU trains. On-policy.
- **async**: a fixed split; rollout never stops, the trainer takes a batch when one is ready
  (staleness bounded by `eta`). Here it runs at its defaults (`eta=1`, trainer = the minimum it needs);
  `gyre-sim compare` sweeps the split and `eta` for a fair baseline.
- **elastic**: GPUs move between roles as demand shifts: engines are drained for training by migrating
  executions at tool-call boundaries, and GPUs reserved for the trainer generate while engines queue.

`vs_bound` is the makespan over the work-conserving lower bound no policy can beat.
"""),
    ("code", """
results = {name: simulate(cfg, name) for name in ["colocate", "async", "elastic"]}
nb.summary(results, baseline="colocate")
"""),
    ("md", """
### GPU-role timeline

Each row is a GPU, each column a moment. Dark blue: an engine decoding; light blue: an engine holding
executions that all wait on tools (or none); red: training; orange: switching roles; grey: idle. Look
for the light-blue tail at the end of each colocate step: most GPUs wait for the slowest rollouts.
"""),
    ("code", "nb.timeline(results);"),
    ("md", "### Utilization over time: the share of GPUs generating and training"),
    ("code", "nb.utilization(results);"),
    ("md", """
### Step-time breakdown

Left: where the GPU-hours went. Right: how long each training step took (time between consecutive
new policy versions).
"""),
    ("code", "nb.breakdown(results);"),
    ("md", """
## Turn one knob, watch the ranking

Every knob is a config field. Here: the cluster size (`cluster.gpus`). The trainer needs 8 GPUs whatever
the cluster, so on 16 GPUs it is half the pool: async leaves it idle between steps while elastic lends it
to generation; on 64 GPUs it is an eighth, and that edge fades. Other one-line changes to try:

```python
override(cfg, **{"workload.turns": LogNormal(median=120, p99_ratio=30)})  # heavier rollout tail
override(cfg, **{"workload.tool_s": LogNormal(median=5.0, p99_ratio=3.5)})  # slower tools
override(cfg, **{"cluster.model": MODELS["dense-7b"]})                    # another model size
```
"""),
    ("code", """
knob, values = "cluster.gpus", [16, cfg.cluster.gpus, 64]
rows = {}
for value in values:
    runs = results if value == cfg.cluster.gpus else {p: simulate(override(cfg, **{knob: value}), p) for p in results}
    rows[value] = {p: r.makespan_s / 3600 for p, r in runs.items()}
ranking = pd.DataFrame(rows).T.rename_axis(knob)
ranking["elastic vs async"] = ranking["async"] / ranking["elastic"]
ranking["ranking (fastest first)"] = [" < ".join(row[list(results)].sort_values().index) for _, row in ranking.iterrows()]
ranking
"""),
    ("md", """
Colocate stays last on this workload whatever the knob: every step waits for its slowest rollout while
the other GPUs sit on finished work. The knob moves async and elastic relative to each other, and where
the edge is small they swap places. Tail heaviness and tool latency move all three together here; the
full sweeps are in `experiments/sweep_tail`.
"""),
    ("md", """
## Write your own policy

A policy sees the cluster only through `gyre.cluster.Cluster` (observations: roles, engines and their
load, live executions, the trainer's version, the clock) and acts through verbs that return handles:
`start_engine`, `stop_engine`, `admit`, `migrate`, `train`, `sync`, `timeout`, `spawn`. `run(cluster,
steps)` is a generator that *yields* a handle to wait for it and receives its value, SimPy style.
`gyre.handles.all_of` waits for many. The policy never learns which backend runs it.

Below, **pipeline**: a fixed split like async, but batch-synchronous and exactly one step off-policy.
Batch k+1 is admitted the moment batch k is complete, so its generation overlaps batch k's training and
weight sync; nothing new starts while a batch's tail is still running. Admission uses its own
load-balancing rule (fewest live executions). It imports nothing but `gyre.cluster` and `gyre.handles`.
"""),
    ("code", """
from gyre.cluster import Cluster
from gyre.handles import all_of


class Pipeline:
    \"\"\"Fixed split; batch k+1 generates (weights one step old) while batch k trains. Staleness 1.\"\"\"

    name = "pipeline"

    def pick(self, engines):
        \"\"\"Load balancing: the engine holding the fewest live executions (ties: lowest id).\"\"\"
        return min(engines, key=lambda e: (e.n_live, e.id))

    def run(self, cluster: Cluster, steps: int):
        per, n = cluster.gpus_per_engine, cluster.n_gpus
        n_roll = (n - cluster.min_train_gpus) // per * per  # the trainer keeps just what it needs
        slots = [tuple(range(i, i + per)) for i in range(0, n_roll, per)]
        engines = yield all_of([cluster.start_engine(s) for s in slots])

        def admit_batch():
            groups = [cluster.next_group() for _ in range(cluster.groups_per_step)]
            return groups, all_of([cluster.admit(x, self.pick(engines)) for g in groups for x in g.executions])

        batch = admit_batch()
        for step in range(steps):
            groups, done = batch
            yield done  # every execution of this batch has finished
            if step + 1 < steps:
                batch = admit_batch()  # generates while this batch trains
            yield cluster.train(range(n_roll, n), groups)
            yield cluster.sync(engines)  # engines serve the new weights from here on
"""),
    ("md", """
Run it exactly like the built-ins: `simulate` takes a registered name, a dotted path
(`gyre-sim run --policy mypkg.mymodule:Pipeline`), or a policy object.
"""),
    ("code", """
results["pipeline"] = simulate(cfg, Pipeline())
assert results["pipeline"].metrics.summary()["staleness_max"] <= 1, "pipeline is one step off-policy at most"
assert len(results["pipeline"].metrics.steps) == cfg.steps
nb.summary(results, baseline="colocate")
"""),
    ("code", "nb.timeline(results);"),
    ("md", """
Compare the pipeline's timeline with async's: both keep a trainer busy beside the engines, but the
pipeline's engines wait for each batch's slowest execution before they get new work, so the rollout
tail still sets the pace. Hiding training behind generation pays only once the tail is handled.
Try `pick` rules (most free KV: `max(engines, key=lambda e: e.kv_capacity - e.kv_used)`), or a larger
trainer, and re-run the two cells above.

## The same object on the real backend

`gyre.real.runner.run_real` runs the very same policy object on Ray (local logical GPUs on a laptop, a
real cluster via an address). Starting Ray and the torch engine actors takes about a minute on a CPU,
so this cell runs only when `GYRE_NOTEBOOK_REAL=1` and `gyre.real` imports (it needs the `real` extra:
ray and torch); otherwise it says so and the notebook goes on. `tests/test_notebooks.py` runs this
notebook's `Pipeline` class on the real backend whenever Ray is installed.
"""),
    ("code", """
if os.environ.get("GYRE_NOTEBOOK_REAL") != "1":
    print("skipped: set GYRE_NOTEBOOK_REAL=1 to run Pipeline on local Ray (about a minute on a CPU)")
else:
    try:
        from gyre.real.config import get_preset as real_preset
        from gyre.real.runner import run_real
    except ImportError as exc:
        print(f"skipped: the real backend does not import here ({exc})")
    else:
        real = run_real(real_preset("tiny-test"), Pipeline())
        print(f"real run: {len(real.metrics.steps)} steps in {real.makespan_s:.1f} s of wall-clock time")
        display(nb.summary({"pipeline (real, tiny-test)": real}))
        nb.timeline({"pipeline (real, tiny-test)": real})
"""),
]

# ----------------------------------------------------------------------------------------------- 02
TRACES = [
    ("md", """
# Traces: calibrate a workload, inspect the fit, replay

Heavy tails decide makespan, so Gyre's workloads come from traces. This notebook reads a real request
trace (Azure LLM inference 2023, code completions: one row per request with its context and generated
tokens), fits a tail-aware distribution on the first 70% of it (by time), judges the fit on the held-out
30%, and replays the trace through the policies, both exactly and resampled from the fit.
The command-line equivalents are `gyre-sim calibrate` and `gyre-sim replay` (docs/cli.md, docs/traces.md).
"""),
    ("code", """
import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

import gyre.notebook as nb
from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate
from gyre.traces.heldout import quantities, split_groups
from gyre.traces.workload_fit import WorkloadFitOptions, fit_workload
from gyre.traces.calibrated import CalibratedSource, load_workload, sample_quantities
from gyre.traces.readers import Grouping, read_request_csv
from gyre.workload import ReplaySource

%matplotlib inline
pd.set_option("display.precision", 3)
"""),
    ("md", """
## Read the trace

The file ships with the repository in `notebooks/data/` (CC-BY 4.0, see its README);
`GYRE_TRACE` overrides the path. Requests carry no task or GRPO group, so groups are windows of 8
consecutive requests and a step is 16 groups.
"""),
    ("code", """
def find_trace(name="azure_llm_inference_2023_code.csv"):
    if os.environ.get("GYRE_TRACE"):
        return Path(os.environ["GYRE_TRACE"])
    for folder in [Path.cwd(), *Path.cwd().parents]:  # notebooks/data/, from the notebook's folder or above
        for data in (folder / "data", folder / "notebooks" / "data"):
            if (data / name).exists():
                return data / name
    raise FileNotFoundError(f"{name} not found in notebooks/data/ at or above {Path.cwd()}; set GYRE_TRACE")


trace = read_request_csv(find_trace(), grouping=Grouping(group_size=8, groups_per_step=16))
first = trace.groups[0].executions[0]
print(f"{trace.n_executions} requests in {len(trace.groups)} groups; "
      f"the first: context {first.prompt} tokens, generated {first.gen[0]}")
"""),
    ("md", """
## Calibrate

`calibrate` fits each quantity with a `TailDist`: the empirical body below a threshold `u`, a
generalized Pareto tail above it (shape `xi`; `xi > 0` is a heavy, power-law tail), and a point mass at
the length cap if the trace has one; when the Pareto tail predicts the end of the fitted data worse
than the data's own tail (or has no finite mean), the empirical tail is kept instead. It also looks for drift across steps and per-task difficulty (none
here: requests are not tasks). The fit is judged against many draws from the calibrated workload.
"""),
    ("code", """
opts = WorkloadFitOptions(split=0.7, seed=0)
cw = fit_workload(trace, opts)
r = cw.report
length = cw.dists["length"]
print(f"fitted {r['fitted']} executions, held out {r['held_out']}; length = {r['scale_target']} tokens, "
      f"cap {r['cap']}, drift/step {r['drift_per_step']:+.4f}")
print(f"drift: {r['drift']['chosen']} ({r['drift']['why']})")
for name, t in r["tails"].items():
    print(f"{name} tail:", t.get("note") or f"GPD above u = {t['u']:g}, shape xi = {t['xi']:.3f}", f"(clamped at {t['clamp']:.0f})")
"""),
    ("md", """
### Fit quality on the held-out 30%

KS distance and Wasserstein (relative to the mean) judge the whole distribution; the p99 error and the
errors of the median and the mean of the *maximum over K* draws (K = one batch, at most the held-out
count) judge the tail, which is what a batch waits for.
"""),
    ("code", """
cols = ["n_test", "k", "ks_d", "wasserstein_rel", "p50_err", "p99_err", "maxk_err", "maxk_mean_model", "maxk_mean_test",
        "maxk_mean_err"]
pd.DataFrame(r["quality"]).T[cols]
"""),
    ("md", """
### CDF, QQ and tail

Held-out data against draws from the calibrated workload for the same steps. A QQ plot on the diagonal
and matching survival curves at the right edge of the tail plot are what the makespan needs.
"""),
    ("code", """
_, held_groups = split_groups(trace.groups, opts.split)
steps = np.array([g.step for g in held_groups], dtype=float)
model = sample_quantities(cw, np.tile(steps, 20), seed=0)
held = quantities(held_groups, cw.scale_target)
nb.fit_plots({"generated tokens": model["length"], "context tokens": model["prompt"]},
             {"generated tokens": held["length"], "context tokens": held["prompt"]},
             ["generated tokens", "context tokens"]);
"""),
    ("md", """
The calibrated workload is a JSON file (what `gyre-sim calibrate --out workload.json` writes and
`gyre-sim run --workload workload.json` reads):
"""),
    ("code", """
with tempfile.TemporaryDirectory() as tmp:
    cw.save(Path(tmp) / "workload.json")
    again = load_workload(Path(tmp) / "workload.json")
print(again.base.name, again.scale_target, sorted(again.dists))
"""),
    ("md", """
## Replay

Two ways to drive the simulator with the trace, on the `short-math` cluster (a dense 7B model) cut to
16 GPUs and 4 steps, with the trace's own workload shape (`cw.base`: group size, groups per step):

- **exact replay** (`gyre.workload.ReplaySource`, what `gyre-sim replay` does): the recorded requests,
  unchanged, in their recorded order;
- **calibrated** (`gyre.traces.calibrated.CalibratedSource`, what `gyre-sim run --workload` does): fresh
  draws from the fit, so longer runs and other seeds are possible.

A good fit gives makespans of the same size and the same ranking; four steps of 128 short requests are a
small sample, so expect differences of tens of percent from the draws alone.
"""),
    ("code", """
cfg = override(dataclasses.replace(get_preset("short-math"), workload=cw.base), steps=4, **{"cluster.gpus": 16})
exact = {p: simulate(cfg, p, source=ReplaySource(trace.groups, cw.base)) for p in ["colocate", "async", "elastic"]}
fitted = {p: simulate(cfg, p, source=CalibratedSource(cw, seed=0)) for p in exact}
pd.DataFrame({"exact replay (s)": {p: x.makespan_s for p, x in exact.items()},
              "calibrated (s)": {p: x.makespan_s for p, x in fitted.items()}})
"""),
    ("code", "nb.timeline(exact);"),
    ("md", """
These requests generate a dozen tokens each, so a step is dominated by prefill, role switches and
training rather than by a decode tail: a very different regime from the long-horizon agent workloads in
`01_policies.ipynb`. Agentic session traces (`gyre.traces.readers.read_sessions`) and Gyre's own rollout
traces (`gyre-sim run --trace-out`) go through the same calibrate and replay steps.
"""),
    ("md", """
## The engine against a real vLLM run

Workload traces say *what* the engines serve; the engine cost model says *how fast*. A real vLLM 0.19
run (an RTX 4090 serving Llama-3.1-8B, 300 ShareGPT requests at ~10/s; data from LLMServingSim's
validation runs, MIT licence) logs each request's queued, first-token and last-token times. Replaying its
arrivals and token counts through a step-by-step model of vLLM's scheduler, with the simulator's roofline
step time (`gyre.roofline`), and comparing latencies checks the engine model. `gyre-sim calibrate-engine`
fits the roofline's efficiencies and step overhead on the first 70% of requests by arrival (a minute of
replays); below, the coefficients it fitted are applied directly (docs/calibrate-engine.md), next to the
cited defaults, and the simulator's own fluid engine (`gyre.sim.cluster.engine`) is run with them too.
"""),
    ("code", """
from gyre.roofline import Coefficients
from gyre.sim.vllm_check.engine_fit import errors, simulate as replay_run
from gyre.sim.vllm_check.serving_run import read_run, split_by_arrival
from gyre.sim.vllm_check.sim_replay import sim_engine_replay, sim_errors

def find_run(name, trace=find_trace()):  # a vLLM run directory in notebooks/data/vllm_timings, beside the trace
    path = trace.parent / "vllm_timings" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (notebooks/data/vllm_timings)")
    return path


run = read_run(find_run("RTX4090_Llama-3.1-8B"))
fitted = dataclasses.replace(Coefficients(), eff_bw=0.9022, eff_kv=0.8416, eff_flops=0.9007, step_overhead_s=0.001656)
_, held_out = split_by_arrival(len(run.requests), 0.7)
replays = {"uncalibrated": replay_run(run, Coefficients()), "calibrated": replay_run(run, fitted)}
table = pd.DataFrame({name: errors(run.requests, res, held_out) for name, res in replays.items()}).T
start, finish, _ = sim_engine_replay(run, fitted)
table.loc["simulator's engine, calibrated"] = sim_errors(run, finish, held_out)
table
"""),
    ("md", """
Running requests over time, the replay against vLLM's own per-second log (`timeseries.csv`). The run is
bound by KV memory (41,408 tokens): vLLM holds 30-45 requests and preempts when contexts grow, and so
does the replay.
"""),
    ("code", """
import matplotlib.pyplot as plt

grid = np.linspace(0, run.requests.makespan, 600)
fig, ax = plt.subplots(figsize=(9, 3.2))
ax.step(run.timeseries["t"], run.timeseries["running"], where="post", color="k", label="vLLM")
for name, res in replays.items():
    i = np.searchsorted(res.running_t, grid, side="right") - 1
    ax.step(grid, res.running_n[np.maximum(i, 0)], where="post", label=f"replay, {name}")
ax.set_xlabel("seconds since the first arrival")
ax.set_ylabel("running requests")
ax.legend();
"""),
]


def notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = new_notebook(metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })
    for i, (kind, src) in enumerate(cells):
        cell = (new_markdown_cell if kind == "md" else new_code_cell)(src.strip("\n"))
        cell["id"] = f"cell-{i:02d}"  # fixed ids: the built file is byte-for-byte reproducible
        nb.cells.append(cell)
    return nb


NOTEBOOKS = {"01_policies.ipynb": POLICIES, "02_traces.ipynb": TRACES}


def render(name: str) -> str:
    return nbformat.writes(notebook(NOTEBOOKS[name])) + "\n"


def execute(name: str) -> str:
    """The notebook run top to bottom (a kernel on this interpreter, notebooks/ as its working folder)."""
    import json
    import tempfile

    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = notebook(NOTEBOOKS[name])
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "kernels" / "gyre-build"
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "gyre build", "language": "python"}))
        km = KernelManager(kernel_name="gyre-build", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)]))
        NotebookClient(nb, km=km, timeout=600, resources={"metadata": {"path": str(HERE)}}).execute()
    nb.metadata = notebook([]).metadata  # the kernel's own metadata would name this machine's kernelspec
    return nbformat.writes(nb) + "\n"


def main() -> int:
    run = "--no-execute" not in sys.argv
    for name in NOTEBOOKS:
        (HERE / name).write_text(execute(name) if run else render(name))
        print(f"wrote notebooks/{name}" + (" (executed)" if run else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
