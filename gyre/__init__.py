"""Gyre: scheduling RL training of LLM agents on long-horizon tasks.

The core (this package) holds the cluster interface, the workload and trajectory models, hardware
cost derivations, configs and metrics. It imports no simpy, ray, vllm or torch: policies
(gyre.policies) build on it, and two backends run them (gyre.sim, gyre.real).
"""

__version__ = "0.1.0"

from gyre import compiled as _compiled

_compiled.install()  # the hot path's C build, when one of these sources exists (gyre.compiled)
