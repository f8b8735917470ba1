"""Colocate: every GPU generates step k's rollouts with weights v_k; when the whole batch is done,
every GPU switches to training, trains, and switches back (engines restart with the new weights).
Strictly on-policy. The tail of each step leaves most GPUs waiting for the slowest execution.

With `streaming` (the paper's "Colocate + streaming"), engines are laid out cell by cell (gyre.cluster.cells; GPUs
beyond the last whole cell join it)
and the batch trains in a streaming step: once no execution waits for admission, a cell whose engines hold
nothing stops them and trains (the first such cell opens the step as its core, the next join it), so the
batch's finished groups train while its tail still rolls out. Only idle capacity moves: an engine with live
work is never drained (moving live work is what an elastic policy adds).

With a standalone rollout pool (`cluster.standalone_gpus`, the paper's "Colocate + standalone pool"), the pool's
engines start once and never train: they roll out with the rest, sync to each new version while the other GPUs
train, and so skip the sleep and wake a switch costs; the trainer is the GPUs outside the pool.

With steps_per_burst mu > 1 (weights published every mu steps), a burst rolls out mu batches at once on the
published weights, then trains them in mu steps: staleness up to mu - 1 (`eta`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.cluster import Cluster
from gyre.handles import all_of, any_of
from gyre.policies.admit_queue import AdmissionQueue
from gyre.policies.common import ClusterShape, cells_of, engine_slots, joins_settled, spread


@dataclass(frozen=True, kw_only=True)
class ColocateConfig:
    """Colocate has one option: `streaming` (train each batch in a streaming step as cells free up)."""

    streaming: bool = False


class Colocate:
    name = "colocate"
    Config = ColocateConfig
    baseline = True  # results are reported as speedups over it
    eta = 0  # on-policy (mu - 1 with bursts of mu steps: set by run)

    def __init__(self, config: ColocateConfig | None = None, **params) -> None:
        self.config = config if config is not None else ColocateConfig(**params)

    @staticmethod
    def grid(shape: ClusterShape, etas: tuple[int, ...]) -> list[dict]:
        return [{}]

    def run(self, cluster: Cluster, steps: int):
        mu = cluster.steps_per_burst
        self.eta = mu - 1
        n_switch = cluster.n_gpus - cluster.standalone_gpus  # the GPUs that switch; the pool's never train
        cells = cells_of(cluster, range(n_switch))  # GPUs beyond the last whole cell join it
        if self.config.streaming:
            slots = [s for cell in cells for s in engine_slots(cell, cluster.gpus_per_engine)]
        else:
            slots = engine_slots(list(range(n_switch)), cluster.gpus_per_engine)
        pool = engine_slots(list(range(n_switch, cluster.n_gpus)), cluster.gpus_per_engine)
        pool_engines: list = []
        done = 0
        while done < steps:
            burst = min(mu, steps - done)
            # the switching engines start (the pool's too, at the first step) while the pool syncs to the new version
            starts = [cluster.start_engine(s) for s in slots + (pool if not done else [])]
            started = yield all_of(starts + ([cluster.sync(pool_engines)] if pool_engines else []))
            engines, pool_engines = started[:len(slots)], pool_engines or started[len(slots):len(starts)]
            batches = [[cluster.next_group() for _ in range(cluster.groups_per_step)] for _ in range(burst)]
            executions = [x for b in batches for g in b for x in g.executions]
            if self.config.streaming:
                yield from self._stream_burst(cluster, engines + pool_engines, executions, batches, cells)
            else:
                yield all_of(spread(cluster, executions, engines + pool_engines))
                yield all_of([cluster.stop_engine(e) for e in engines])
                for batch in batches:
                    yield cluster.train(cluster.free_gpus(), batch)
            done += burst

    @staticmethod
    def _stream_burst(cluster: Cluster, engines, executions, batches, all_cells):
        """Roll out the burst; each cell whose engines are idle once nothing waits trains the burst's first batch
        (the first opens its step, the rest join); the burst's other batches train after it on every cell."""
        stopping: set[int] = set()
        queue = AdmissionQueue(cluster, lambda: [e for e in engines if e.id not in stopping])
        finished = queue.submit(executions)
        cells = [c for c in all_cells if any(e.gpus[0] in c for e in engines)]
        by_cell = {c: [e for e in engines if e.gpus[0] in c] for c in cells}
        free: list[tuple[int, ...]] = []  # cells whose engines stopped, in the order they did
        step = None
        joins = []  # a cell still switching in when its step ends is free once its join completes
        while len(free) < len(cells):
            if not len(queue):
                for c in cells:
                    if c not in free and all(e.n_live == 0 for e in by_cell[c]):
                        stopping.update(e.id for e in by_cell[c])
                        yield all_of([cluster.stop_engine(e) for e in by_cell[c]])
                        free.append(c)
                        if step is None:
                            step = cluster.open_step(c, batches[0])
                        elif cluster.training is not None and cluster.training.n_untrained:
                            joins.append(cluster.join_step(c))  # (a step with nothing left needs no more cells)
            pending = [h for h in finished if not h.done]
            if len(free) < len(cells) and pending:
                yield any_of(pending)
        yield step
        yield from joins_settled(joins)
        for batch in batches[1:]:
            c0, *rest = cells
            h = cluster.open_step(c0, batch)
            joins = [cluster.join_step(c) for c in rest]
            yield h
            yield from joins_settled(joins)
