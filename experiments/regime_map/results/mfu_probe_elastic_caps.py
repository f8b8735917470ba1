import sys
sys.path.insert(0, ".")
from run import cell_config
from gyre.sim.harness.runner import simulate
for cell in [(1 << 20, 640, True, True, "hybrid"), (1 << 20, 1024, True, True, "hybrid")]:
    for mfu in (0.35, 0.21):
        cfg = cell_config(*cell, steps=8, seed=0, sets={"cluster.cost.train_mfu": mfu})
        for cap in (1, 2, 4, 8):
            r = simulate(cfg, "elastic", {"eta": 4, "max_running": cap})
            print(cell[1], mfu, "elastic cap", cap, f"{r.makespan_s/3600:.2f} h", "cuts", int(r.metrics.extra.get("sched_cuts", 0)), flush=True)
