"""The run harness: one policy on one simulated workload (runner), the scheduler-caused deadline cuts of a run,
policies compared and tuned (compare), and where a sweep's runs execute (sweep, workers)."""
