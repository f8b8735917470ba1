"""SimPy backend: the simulated cluster, its fluid engine model, and the gyre-sim CLI."""
