"""`gyre-real run`: run a scheduling policy for real on Ray (local logical GPUs or a cluster) and write the
simulator's output files plus a rollout trace and a profile. The `gyre-real` entry point is
gyre.bridge.cli, which adds `calibrate` (it runs the simulator, which this package never imports).

Flags only override fields of a named preset or of a TOML config file (docs/real.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Gyre real executor: run scheduling policies on Ray; calibrate the simulator on a run.")
console = Console()


@app.callback()
def _group() -> None:
    """Commands stay subcommands (`gyre-real run`) whichever are registered."""


def fail(msg: str) -> None:
    console.print(f"[red]error:[/red] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _config(preset: str, config: Path | None, steps: int | None, address: str | None, seed: int | None,
            faults: list[str] | None = None, checkpoint_every: int | None = None):
    import dataclasses

    from gyre.real.config import RealConfigError, get_preset
    from gyre.faults import spec_error
    from gyre.real.config_file import load_config

    try:
        cfg = load_config(config) if config else get_preset(preset)
    except RealConfigError as exc:
        fail(str(exc))
        raise
    if steps is not None:
        if steps < 1:
            fail(f"--steps must be >= 1, got {steps}")
        cfg = dataclasses.replace(cfg, steps=steps)
    if address is not None:
        cfg = dataclasses.replace(cfg, pool=dataclasses.replace(cfg.pool, address=address))
    if seed is not None:
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, seed=seed))
    bad = spec_error(faults or [])
    if bad:
        fail(bad)
    if faults:
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, faults=tuple(faults)))
    if checkpoint_every is not None:
        if checkpoint_every < 0:
            fail(f"--checkpoint-every must be >= 0, got {checkpoint_every}")
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, checkpoint_every=checkpoint_every))
    return cfg


Preset = Annotated[str, typer.Option("--preset", "-p", help="named real preset (tiny-cpu, tiny-test)")]
Config = Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML run config (overrides a preset)")]
Steps = Annotated[Optional[int], typer.Option("--steps", help="training steps")]
Address = Annotated[Optional[str], typer.Option("--address", help="Ray cluster address (default: local Ray)")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="task and sampling seed")]


@app.command()
def run(
    policy: Annotated[list[str], typer.Option("--policy", help="registered name or dotted path (repeatable)")],
    preset: Preset = "tiny-cpu",
    config: Config = None,
    steps: Steps = None,
    address: Address = None,
    seed: Seed = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="results folder")] = Path("out/real"),
    faults: Annotated[Optional[list[str]], typer.Option(
        "--faults", help="inject a fault (repeatable): kill-engine@T, kill-trainer@T, random-engines:N, "
                         "random-trainers:N, delay-sync:S@T, drop-sync@T (T, S in seconds; see docs/real.md)")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option(
        "--checkpoint-every", help="trainer checkpoint every N steps (0: none): a lost trainer state is rebuilt "
                                   "from it and the steps after it")] = None,
) -> None:
    """Run each policy for real (one after another, on warm actors) and write their outputs."""
    from gyre.cluster import ClusterError
    from gyre.policies import UnknownPolicy, check_params, policy_class
    from gyre.faults import fault_summary
    from gyre.real.pool import ActorPool, ensure_model_dir
    from gyre.real.runner import run_real, write_outputs
    from gyre.real.task_api import TaskError, load_task

    cfg = _config(preset, config, steps, address, seed, faults, checkpoint_every)
    from gyre.estimate import EstimateError

    if cfg.cluster.estimate not in ("profile", "none"):  # a calibration file: one line on a bad one, before actors
        from gyre.estimate import from_file as estimate_from_file

        try:
            estimate_from_file(cfg.cluster.estimate)
        except EstimateError as exc:
            fail(f"{config or preset}: cluster.estimate: {exc}")
            raise
    for p in policy:
        try:
            policy_class(p)
        except UnknownPolicy as exc:
            fail(str(exc))
    try:  # a parameter a policy refuses, from the config's [policy_params.<p>]
        check_params({p: cfg.policy_params[p] for p in policy if p in cfg.policy_params})
    except UnknownPolicy as exc:
        fail(f"{config or preset}: {exc}")
    if cfg.cluster.checkpoint and Path(cfg.cluster.checkpoint).exists():  # resumed from: read as data only
        from gyre.real.pool import trained_model
        from gyre.real.checkpoint import CheckpointError, read_checkpoint

        try:
            read_checkpoint(cfg.cluster.checkpoint, trained_model(cfg.pool), mmap=True)
        except CheckpointError as exc:
            fail(str(exc))
        from gyre.real.run_state import RunStateError, saved_policy_state

        try:  # the policy state beside it: data only (JSON), never a pickle
            saved_policy_state(cfg.cluster.checkpoint)
        except RunStateError as exc:
            fail(str(exc))
    try:  # a tiny model folder (and its tokenizer) written on first use: a text task may read its tokenizer there
        ensure_model_dir(cfg.pool)
    except ValueError as exc:
        fail(f"{config or preset}: {exc}")
    try:
        task = load_task(cfg.cluster.task_class, cfg.cluster.task, cfg.cluster.seed)
    except TaskError as exc:
        fail(f"{config or preset}: cluster.task_class: {exc}")
        raise
    if getattr(task, "vocab_size", 0) > cfg.pool.model.vocab_size:
        fail(f"{config or preset}: pool.model.vocab_size = {cfg.pool.model.vocab_size} is smaller than the task's "
             f"tokenizer ({task.vocab_size} tokens)")
    try:  # checks the model folders before any actor starts
        pool = ActorPool.shared(cfg.pool)
    except (ValueError, TimeoutError) as exc:
        fail(str(exc))
        raise
    from gyre.real.profile import cluster_estimate

    try:  # the cost estimate policies may read, stated in the run's output (a start-up profile runs here)
        est, _ = cluster_estimate(pool, cfg.cluster, task.max_context)
    except EstimateError as exc:
        fail(f"{config or preset}: cluster.estimate: {exc}")
        raise
    console.print(est.describe() if est is not None else "cost estimate: none (cluster.estimate = 'none')",
                  highlight=False, soft_wrap=True)
    results, failed = [], []
    for p in policy:
        try:  # metrics, TensorBoard files, logs and the exported model stream into `out` (gyre.real.watch)
            results.append(run_real(cfg, p, pool=pool, out=out,
                                    print_fn=lambda line: console.print(line, highlight=False)))
        except ClusterError as exc:  # the other policies still run and are written
            failed.append(f"{p}: {exc}")
    if not results:
        fail("; ".join(failed))
    paths = write_outputs(out, results)
    for r in results:
        lc = r.learning()
        first = lc["reward_mean"].iloc[: max(1, len(lc) // 5)].mean()
        last = lc["reward_mean"].iloc[-max(1, len(lc) // 5):].mean()
        console.print(f"{r.policy}: makespan {r.makespan_s:.1f}s, {len(lc)} steps, reward {first:.3f} -> {last:.3f}",
                      highlight=False)
        fs = fault_summary(r.log)
        if fs["faults"] or fs["respawns"]:
            console.print(f"{r.policy}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in fs.items()), highlight=False)
        stalled = r.stalled_since()
        if stalled is not None:
            console.print(f"{r.policy}: warning: from step {stalled} on no group had a reward spread (every advantage "
                          f"0, no gradient): the policy collapsed; see learning_{r.policy}.csv", highlight=False)
    console.print(f"wrote {paths['summary'].name}, {paths['timeline'].name}, traces and profiles in {out}/")
    if failed:
        fail("; ".join(failed))
