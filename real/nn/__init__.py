"""Small neural-network stand-ins (a tiny Llama-style decoder) for tests and CPU benchmarks."""
