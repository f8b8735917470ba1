"""A run a person can watch and resume: metrics streamed per step, live progress, logs, partial outputs.

What it models: the observable side of a real run, all of it read from the cluster's event log (the gyre.metrics
schema) as the run goes, never from the trainer's own counters. `RunWatch(out, policy, ...)` is called on every
turn of the run loop (`tick(cluster)`) and:

- appends one row per training step to `metrics_<policy>.csv` and `metrics_<policy>.jsonl` (flushed at once, so a
  run killed mid-way leaves every finished step on disk) and writes the same scalars as TensorBoard event files
  under `tb/<policy>/` (torch.utils.tensorboard.SummaryWriter, which the `tensorboard` package backs);
- prints a progress line per step, one per group whose scoring failed (gyre.real.verify) and, every `every_s`
  seconds, one with the rollouts in flight, the executions finished and their recent mean reward, and the tool
  calls (scorings included) and tool errors so far;
- a resumed run (resume=True) appends to the metrics files it finds, its versions continuing the trainer's.

`finish(cluster, error)` closes the writers and keeps the Ray workers' logs (engines, trainers, tool workers)
under `logs/` of the run folder; `write_partial` writes the raw event log and the error of a failed run.

Simplifications: the Ray logs are the local node's (a multi-node cluster keeps the others' on their nodes).
"""

from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path
from typing import Callable

from gyre.cluster import Phase

COLUMNS = ["step", "version", "t_s", "reward_mean", "loss", "tokens", "groups_with_signal", "finished", "in_flight",
           "tool_calls", "tool_errors", "wall_s"]


class RunWatch:
    def __init__(self, out: str | Path, policy: str, steps: int, *, print_fn: Callable[[str], None] | None = None, every_s: float = 5.0,
                 resume: bool = False) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.policy, self.steps = policy, steps
        self.print = print_fn or (lambda s: None)
        self.every_s = every_s
        path = self.out / f"metrics_{policy}.csv"
        append = resume and path.exists()  # a resumed run continues its metrics
        self._csv_f = open(path, "a" if append else "w", newline="")
        self._csv = csv.DictWriter(self._csv_f, COLUMNS)
        if not append:
            self._csv.writeheader()
        self._csv_f.flush()
        self._jsonl = open(self.out / f"metrics_{policy}.jsonl", "a" if append else "w")
        self._tb = SummaryWriter(str(self.out / "tb" / policy))
        self._seen = 0  # log records read so far
        self._finished, self._rewards, self._step = 0, [], 0
        self._tool_errors = 0
        self._t0 = time.perf_counter()
        self._last_print = 0.0

    def tick(self, cluster) -> None:
        log = cluster.log
        for rec in log[self._seen:]:
            if rec[0] == "finish":
                self._finished += 1
            elif rec[0] == "note" and rec[2] == "reward" and rec[3]["reward"] is not None:
                self._rewards.append(rec[3]["reward"])
            elif rec[0] == "note" and rec[2] == "tool_error":
                self._tool_errors += 1
            elif rec[0] == "note" and rec[2] == "score_error":
                i = rec[3]
                self.print(f"{self.policy}: scoring group {i['group']} (task {i['task']}) failed for executions "
                           f"{i.get('failed')} after its retries: {i['message']}")
            elif rec[0] == "note" and rec[2] == "train":
                self._step_row(cluster, rec)
        self._seen = len(log)
        now = time.perf_counter() - self._t0
        if now - self._last_print >= self.every_s:
            self._last_print = now
            recent = self._rewards[-32:]
            mean = sum(recent) / len(recent) if recent else float("nan")
            self.print(f"{self.policy}: step {self._step}/{self.steps}, {self._in_flight(cluster)} rollouts in flight, "
                       f"{self._finished} finished (recent reward {mean:.3f}), tool calls "
                       f"{cluster.tools.counts['calls']} ({self._tool_errors} errors), {now:.0f}s")

    @staticmethod
    def _in_flight(cluster) -> int:
        return sum(x.phase in (Phase.DECODE, Phase.PREFILL, Phase.TOOL) for x in cluster.live())

    def _step_row(self, cluster, rec) -> None:
        self._step += 1
        info = rec[3]
        version = cluster.base_version + info["version"]  # the trainer's: a resumed run continues the count
        row = {"step": self._step, "version": version, "t_s": rec[1], "reward_mean": info["reward_mean"],
               "loss": info.get("loss"), "tokens": info.get("tokens"), "groups_with_signal": info.get("groups_with_signal"),
               "finished": self._finished, "in_flight": self._in_flight(cluster),
               "tool_calls": cluster.tools.counts["calls"], "tool_errors": self._tool_errors,
               "wall_s": time.perf_counter() - self._t0}
        self._csv.writerow(row)
        self._csv_f.flush()
        self._jsonl.write(json.dumps(row, default=float) + "\n")
        self._jsonl.flush()
        for k in ("reward_mean", "loss", "tokens", "groups_with_signal", "in_flight", "tool_errors"):
            if isinstance(row[k], (int, float)):
                self._tb.add_scalar(f"{self.policy}/{k}", row[k], version)
        self._tb.flush()
        self.print(f"{self.policy}: step {self._step}/{self.steps} -> version {version} at {rec[1]:.1f}s, "
                   f"reward {info['reward_mean']:.3f}, loss {info.get('loss', float('nan')):.4f}")

    def finish(self) -> None:
        self._csv_f.close()
        self._jsonl.close()
        self._tb.close()
        keep_ray_logs(self.out / "logs")


def keep_ray_logs(dest: Path) -> list[Path]:
    """Copy the local Ray session's worker logs (stdout and stderr of every actor) into `dest`."""
    import ray

    node = getattr(getattr(ray, "_private", None) and ray._private.worker, "_global_node", None)
    if node is None:
        return []
    src = Path(node.get_logs_dir_path())
    dest.mkdir(parents=True, exist_ok=True)
    kept = []
    for f in sorted(src.glob("worker-*")):
        if f.suffix in (".out", ".err") and f.stat().st_size:
            shutil.copyfile(f, dest / f.name)
            kept.append(dest / f.name)
    return kept


def write_partial(out: str | Path, policy: str, log: list, error: BaseException) -> None:
    """What a failed run leaves: its raw event log so far and the error."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"log_{policy}.jsonl", "w") as f:
        for rec in log:
            f.write(json.dumps(list(rec), default=float) + "\n")
    (out / f"failed_{policy}.txt").write_text(f"{type(error).__name__}: {error}\n")
