"""The simulated cluster: the fluid engine model and its KV books, executions, injected faults, the SimCluster
that implements gyre.cluster.Cluster on its own event loop, and the lower bound no policy on it can beat."""
