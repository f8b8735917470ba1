"""Where a sweep's configurations run: in this process, in a local process pool, or as tasks on a Ray cluster.

`run_map(fn, args, workers=..., ray=...)` returns `[fn(a) for a in args]`, in that order, whichever of the three
runs them, so a comparison's results do not depend on where it ran: each run is a pure function of its config
(gyre.sim.harness.runner), and what comes back is the very object `fn` returned, pickled. `on_done(i, result)` is called
here as each run finishes, in the order they finish (a progress bar, a log line).

- `ray=None`: `workers` processes (gyre.sim.harness.workers.process_pool, which end with this one), or this process
  when `workers` is 1.
- `ray="auto"`: the Ray session this process already has, or else a local Ray cluster started for the sweep
  (with `workers` CPUs, default the CPUs Ray detects) and shut down after it; `ray=ADDRESS`: that cluster (`ray.init(address=...)`,
  e.g. "ray://head:10001" or "head:6379"). Each run is one Ray task of one CPU. The cluster's workers must
  import gyre (installed on every node, or shipped by the cluster's runtime environment); a function defined
  in a script (`__main__`) travels by value.

An interrupt (Ctrl-C) or any error while the sweep runs cancels what is still queued or running: the pool's
workers are terminated (gyre.sim.harness.workers), Ray's tasks are cancelled (`ray.cancel(force=True)`, again until each
has ended: a cancel can be lost while a task is handed to a worker), and the error goes on to the caller. Ray is imported only when asked for.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from gyre.sim.harness.workers import process_pool

OnDone = Callable[[int, Any], None]
RAY_HELP = "run the configurations as Ray tasks: 'auto' (a local Ray cluster) or a Ray cluster's address"


def run_map(fn: Callable[[Any], Any], args: Sequence[Any], *, workers: int | None = None, ray: str | None = None,
            on_done: OnDone | None = None) -> list[Any]:
    """[fn(a) for a in args], run where the module docstring says; on_done(i, result) as each finishes."""
    args = list(args)
    if not args:
        return []
    if ray:
        return _on_ray(fn, args, ray, workers, on_done)
    workers = workers or min(len(args), os.cpu_count() or 1)
    out: list[Any] = [None] * len(args)
    if workers <= 1:
        for i, a in enumerate(args):
            out[i] = fn(a)
            if on_done:
                on_done(i, out[i])
        return out
    from concurrent.futures import as_completed

    with process_pool(workers) as pool:
        index = {pool.submit(fn, a): i for i, a in enumerate(args)}
        for f in as_completed(index):
            i = index[f]
            out[i] = f.result()
            if on_done:
                on_done(i, out[i])
    return out


def _on_ray(fn: Callable[[Any], Any], args: list[Any], address: str, workers: int | None,
            on_done: OnDone | None) -> list[Any]:
    import ray

    started = not ray.is_initialized()
    if started:
        if address == "auto":  # a local cluster for this sweep alone (not "auto"'s attach-to-a-running-one)
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)  # None: the CPUs Ray sees
        else:
            ray.init(address=address, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(fn)
        refs = [task.remote(a) for a in args]
        index = {r: i for i, r in enumerate(refs)}
        out: list[Any] = [None] * len(args)
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for r in ready:
                    out[index[r]] = ray.get(r)
                    if on_done:
                        on_done(index[r], out[index[r]])
        except BaseException:
            _cancel(ray, pending)
            raise
        return out
    finally:
        if started:
            ray.shutdown()


def _cancel(ray, refs: list, settle_s: float = 10.0) -> None:
    """Cancel Ray tasks (killing the ones running) and wait until each has ended: a cancel that reaches a task
    while it is being handed to a worker can be lost (the task then runs to its end), so a task still
    unfinished is cancelled again, every 0.2 s, for up to `settle_s` seconds."""
    deadline = time.monotonic() + settle_s
    while refs and time.monotonic() < deadline:
        for r in refs:
            ray.cancel(r, force=True)
        _, refs = ray.wait(refs, num_returns=len(refs), timeout=0.2)


def progress_lines(total: int | None, label: str = "configs", stream=None) -> OnDone:
    """An on_done that prints `label: k/total done (s elapsed)` as each run finishes (the experiments' runners;
    `total` None: a search whose size is not known ahead, `label: k done`)."""
    t0, done = time.perf_counter(), [0]

    def report(_i: int, _result: Any) -> None:
        done[0] += 1
        of = f"/{total}" if total is not None else ""
        print(f"{label}: {done[0]}{of} done ({time.perf_counter() - t0:.0f} s)", file=stream or sys.stderr, flush=True)

    return report
