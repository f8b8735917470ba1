"""Where does a policy's time go against a fixed split? Per seed: the policy and async at a given split run
on the same workload; the policy's run log gives the trainer's time waiting for a batch and gathering GPUs
(from the end of one step to the start of the next training), its training time, drains, grows,
migrations, GPU reallocations, KV preemptions and how many steps trained on how many GPUs.

The policy is a registered name or a dotted path, so an earlier version of elastic can be measured the
same way, e.g. `git show 6920633:policies/elastic.py > /tmp/prev_elastic.py` and
`PYTHONPATH=/tmp python experiments/elastic_vs_baselines/diagnose.py --policy prev_elastic.Elastic --label previous`.

Output: results/{preset}_diagnosis.csv (one row per label and seed; rows of an earlier run with the same
label are replaced).

Usage: python experiments/elastic_vs_baselines/diagnose.py [--preset short-math] [--steps 48] [--seeds 0,1,2]
       [--async-rollout-gpus 32] [--eta 4] [--policy elastic] [--label current]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import pandas as pd

from gyre.config import override
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate
from gyre.sim.harness.workers import process_pool

HERE = Path(__file__).resolve().parent


def trainer_times(log: list[tuple]) -> tuple[float, float]:
    """(waiting + gathering, training) seconds summed over steps, from each `elastic_train` note (a
    training starts) and `step` record (it ends); NaN for a log without those notes."""
    starts = [r[1] for r in log if r[0] == "note" and r[2] == "elastic_train"]
    ends = [r[1] for r in log if r[0] == "step"]
    if len(starts) != len(ends):
        return float("nan"), float("nan")
    prev, wait, train = 0.0, 0.0, 0.0
    for s, e in zip(starts, ends):
        wait += s - prev
        train += e - s
        prev = e
    return wait, train


def run_pair(job: tuple[str, int, int, str, int, int]) -> dict:
    preset, steps, seed, policy, rollout_gpus, eta = job
    cfg = override(get_preset(preset), steps=steps, seed=seed)
    base = simulate(cfg, "async", {"rollout_gpus": rollout_gpus, "eta": eta})
    r = simulate(cfg, policy, {"eta": eta})
    s = r.metrics.summary()
    wait, train = trainer_times(r.log)
    notes = Counter(rec[2] for rec in r.log if rec[0] == "note")
    by_gpus = Counter(rec[3] for rec in r.log if rec[0] == "step")
    return {
        "seed": seed, "makespan_s": r.makespan_s, "async_s": base.makespan_s,
        "vs_async": base.makespan_s / r.makespan_s, "trainer_wait_gather_s": wait, "training_s": train,
        "drains": notes.get("elastic_drain", 0), "grows": notes.get("elastic_grow", 0),
        "migrations": s["migrations"], "reallocations": s["reallocations"], "preemptions": s.get("preemptions", 0),
        "steps_by_trainer_gpus": " ".join(f"{g}:{n}" for g, n in sorted(by_gpus.items())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="short-math")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--async-rollout-gpus", type=int, default=32)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--policy", default="elastic")
    ap.add_argument("--label", default="current")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    jobs = [(a.preset, a.steps, int(s), a.policy, a.async_rollout_gpus, a.eta) for s in a.seeds.split(",")]
    with process_pool(a.jobs) as ex:
        rows = list(ex.map(run_pair, jobs))
    df = pd.DataFrame([{"label": a.label, "preset": a.preset, "steps": a.steps, "policy": a.policy,
                        "async_rollout_gpus": a.async_rollout_gpus, "eta": a.eta, **r} for r in rows])
    out = HERE / "results" / f"{a.preset}_diagnosis.csv"
    if out.exists():
        old = pd.read_csv(out)
        df = pd.concat([old[old["label"] != a.label], df], ignore_index=True)
    df.to_csv(out, index=False)
    print(df.to_string(index=False))


if __name__ == "__main__":
    main()
