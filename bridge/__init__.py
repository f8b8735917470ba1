"""The sim-to-real bridge: runs the simulator to predict real runs; the one place both backends meet."""
