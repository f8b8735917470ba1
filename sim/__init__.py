"""The simulator backend, in four rooms: the simulated cluster (cluster/), its check against real vLLM runs
(vllm_check/), the run harness that runs and compares policies on it (harness/), and the gyre-sim CLI (cli/)."""
