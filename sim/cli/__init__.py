"""`gyre-sim`, the simulator's command line: the app (app), its console (console) and the commands it registers
(calibrate_engine, traces). `main` is re-exported so the `gyre-sim = "gyre.sim.cli:main"` entry point stays."""

from gyre.sim.cli.app import main

__all__ = ["main"]
