"""Fingerprints of the simulator's behaviour: sha256 of what `gyre-sim compare` writes and of faulted runs' logs.

A refactor of the simulator's core must move no number. This script records, for one code tree:
- `gyre-sim compare` on xlong-swe-small (8 steps), short-math (4 steps) and xlong-swe-kv (2 steps): the sha256
  of every steps_*.csv and staleness_*.csv, and of summary.csv less its wall-time columns (any column whose
  name holds "wall": the simulator's own run time);
- five faulted runs (gyre.faults specs, carried out by gyre.sim.cluster.faults): the sha256 of their full event logs
  (the repr of every record, one per line; floats repr exactly), with the simulator's checks on.
It prints one line per hash and writes them all as JSON (`--out`). Two JSON files compare with `--against`.

`--root DIR` runs another checkout's code (e.g. `git worktree add /tmp/kvbase main`) with this venv: the
gyre packages are mapped to DIR's folders ahead of the installed editable mapping (forked workers inherit it).
The runs take minutes on two cores: run it in the background.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from importlib.util import spec_from_file_location
from pathlib import Path

PACKAGES = {"gyre": "gyre", "gyre.policies": "policies", "gyre.sim": "sim", "gyre.real": "real",
            "gyre.bridge": "bridge"}
COMPARES = (("xlong-swe-small", 8), ("short-math", 4), ("xlong-swe-kv", 2))
# (name, preset, GPUs, steps, policy, its params, fault specs, checkpoint every N steps)
FAULTED = (
    ("crash-async", "xlong-swe-small", 64, 2, "async", {"eta": 1}, ("random-engines:3",), 0),
    ("crash-hybrid-kv-elastic", "xlong-swe-kv", 384, 1, "elastic", {}, ("random-engines:2",), 0),
    ("trainer-colocate", "xlong-swe-small", 64, 2, "colocate", {}, ("random-trainers:2",), 1),
    ("slow-sync-async", "short-math", 64, 3, "async", {"eta": 1}, ("delay-sync:20@0", "drop-sync@100"), 0),
    ("mixed-elastic", "xlong-swe-small", 64, 2, "elastic", {}, ("kill-engine@200", "kill-trainer@400",
                                                                 "delay-sync:5@300"), 2),
)


class _TreeFinder:
    """Find the gyre packages in another checkout (its folders, as pyproject's package-dir names them)."""

    root: Path

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname not in PACKAGES:
            return None  # submodules: PathFinder, along the package's __path__
        folder = cls.root / PACKAGES[fullname]
        return spec_from_file_location(fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def use_tree(root: Path) -> None:
    for name in list(sys.modules):
        if name == "gyre" or name.startswith("gyre."):
            del sys.modules[name]
    _TreeFinder.root = root.resolve()
    sys.meta_path.insert(0, _TreeFinder)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def compare_hashes(preset: str, steps: int, out: Path) -> dict[str, str]:
    import pandas as pd
    from typer.testing import CliRunner

    from gyre.sim.cli.app import app

    res = CliRunner().invoke(app, ["compare", "--preset", preset, "--steps", str(steps), "--out", str(out)])
    if res.exit_code != 0:
        raise SystemExit(f"gyre-sim compare --preset {preset} failed: {res.output}{res.exception!r}")
    got = {}
    for f in sorted(out.glob("steps_*.csv")) + sorted(out.glob("staleness_*.csv")):
        got[f"{preset}/{f.name}"] = sha(f.read_bytes())
    summary = pd.read_csv(out / "summary.csv")
    kept = summary[[c for c in summary.columns if "wall" not in c]]
    got[f"{preset}/summary.csv"] = sha(kept.to_csv(index=False).encode())
    return got


def faulted_hash(name, preset, gpus, steps, policy, params, faults, every) -> tuple[str, dict]:
    """(sha256 of the run's log, what it survived: gyre.faults.fault_summary)."""
    from gyre.config import override
    from gyre.faults import fault_summary
    from gyre.presets import get_preset
    from gyre.sim.harness.runner import simulate

    cfg = override(get_preset(preset), **{"cluster.gpus": gpus, "steps": steps, "faults": faults,
                                          "checkpoint_every": every})
    r = simulate(cfg, policy, params, check=True)
    return sha("\n".join(repr(rec) for rec in r.log).encode()), fault_summary(r.log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, help="run this checkout's code instead of the installed one")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/behaviour_hashes.json"))
    ap.add_argument("--against", type=Path, help="compare with this JSON of hashes (exit 1 on any difference)")
    ap.add_argument("--only", choices=["compare", "faults"], help="record one half only")
    a = ap.parse_args()
    if a.root:
        use_tree(a.root)
    import gyre

    got: dict[str, str] = {"_code": str(Path(gyre.__file__).parent.parent)}
    if a.only != "faults":
        for preset, steps in COMPARES:
            with tempfile.TemporaryDirectory() as tmp:
                for k, v in compare_hashes(preset, steps, Path(tmp)).items():
                    got[k] = v
                    print(k, v, flush=True)
    if a.only != "compare":
        for spec in FAULTED:
            got[f"faulted/{spec[0]}"], survived = faulted_hash(*spec)
            print(f"faulted/{spec[0]}", got[f"faulted/{spec[0]}"], survived, flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(got, indent=1) + "\n")
    print("wrote", a.out)
    if a.against:
        ref = json.loads(a.against.read_text())
        keys = sorted((set(ref) | set(got)) - {"_code"})
        diff = [k for k in keys if ref.get(k) != got.get(k)]
        for k in diff:
            print(f"DIFFERS {k}: {ref.get(k)} vs {got.get(k)}")
        print(f"{len(keys) - len(diff)}/{len(keys)} identical")
        if diff:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
