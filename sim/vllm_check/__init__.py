"""The engine model checked against real vLLM serving runs: a run read, vLLM's scheduler replayed step by step,
the same requests through the simulator's own engine, and the step-cost coefficients fitted to the run."""
