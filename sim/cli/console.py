"""The console every `gyre-sim` command prints to, its one-line failure, its progress bar and its result table.

Shared by sim/cli/app.py and the command modules it registers (sim/cli/calibrate_engine.py, sim/cli/traces.py),
which import this module and never the CLI that registers them.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gyre.policies import baselines

console = Console(width=None if sys.stdout.isatty() else 140)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 140)


def fail(msg: str) -> None:
    """The one-line error, on stderr, and exit code 2."""
    err_console.print(f"[red]error:[/red] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def tokens(n: float) -> str:
    """A token count with its unit: '812', '200.5K', '3.2M', '1.05B' (never '0M')."""
    if n != n:
        return "-"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            v = n / div
            return f"{v:.2f}{unit}" if v < 10 else f"{v:.1f}{unit}" if v < 1000 else f"{v:.0f}{unit}"
    return f"{n:.0f}"


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def report_infeasible(cfg, policies) -> None:
    """Say which policies this cluster cannot run (they are left out); fail if that is all of them."""
    from gyre.policies import REGISTRY
    from gyre.sim.harness.compare import infeasible

    skip = infeasible(cfg, policies)
    for name, why in skip.items():
        console.print(f"skipped {name}: {why}")
    if skip and len(skip) == len(policies or REGISTRY):
        fail(f"no policy can run on this cluster ({', '.join(skip)})")


def _duration(s: float) -> str:
    """'2.31 h', '12.4 min' or '41.0 s' (a sub-hour run does not print as 0.00 h)."""
    return f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def _ratio(r, key: str, digits: int = 2) -> str:
    v = r.get(key, float("nan"))
    return "-" if v != v else f"{v:.{digits}f}x"  # NaN: that policy was not run


def _count(r, key: str) -> str:
    v = r.get(key, float("nan"))
    return "-" if v != v else f"{int(v):,}"


def print_table(table, title: str) -> None:
    """The result table, every cell in full: figures never wrap or elide (their columns are as wide as their
    widest cell), headers break at spaces, and a row's config breaks after its commas when the console is narrow."""
    bases = baselines()
    same = [b for b in bases if f"speedup_vs_{b}_same_eta" in table]
    others = [b for b in bases if b not in same]  # a baseline with no eta (colocate: eta 0)
    cols = ["policy", "per engine", "time", *(f"vs {b} @eta" for b in same),
            *(f"vs {b}" for b in others), "vs best", "equal work", "cut", "sched cut", "tokens", "preempt",
            "stale"]
    rows = [(
        r["policy"], _count(r, "engine_limit"), _duration(r["makespan_s"]),
        *(_ratio(r, f"speedup_vs_{b}_same_eta", 3) for b in same), *(_ratio(r, f"speedup_vs_{b}", 3) for b in others),
        _ratio(r, "speedup_vs_best", 3), "yes" if r.get("equal_work", True) else "NO",
        _count(r, "deadline_hit"), _count(r, "sched_cuts"), tokens(r["tokens_generated"]),
        _count(r, "preemptions"), str(r["staleness_max"]),
    ) for _, r in table.iterrows()]
    t = Table(title=title)
    for i, c in enumerate(cols):
        widest = max((len(row[i]) for row in rows), default=1)
        head = c if c == "policy" else c.replace(" ", "\n")  # a header never widens a figure's column
        t.add_column(head, justify="left" if i < 1 else "right", no_wrap=True, min_width=widest)
    for row in rows:
        t.add_row(*row)
    console.print(t)
    # settings one line each below the table (a config in a column wraps to several lines)
    for _, r in table.iterrows():
        console.print(f"  {r['policy']}: {r['config']} ({r.get('tuned', 'as configured')})", highlight=False,
                      soft_wrap=True)
    n = int(table["executions"].max()) if "executions" in table else 0
    console.print(f"lower bound: {_duration(table['bound_s'].iloc[0])} (max of GPU-work / N and critical path; "
                  "each row's vs_bound and vs_eta_bound are in summary.csv); "
                  "vs <baseline> same eta: speedup over that baseline's best at the row's eta; "
                  "vs best: over the fastest equal-work baseline tuned with hindsight; "
                  f"cut: executions cut by their deadline, sched cuts: those that would have finished in time "
                  f"alone on an idle engine. Equal work: rows ranked only among those whose sched cuts exceed "
                  f"the least by at most 1% of the run's {n:,} executions; a row marked NO is never the best.",
                  highlight=False)
