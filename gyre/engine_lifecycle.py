"""An inference engine's lifecycle, as both backends' engines live it.

An engine's state is an `EngineState`, moved only by `EngineLifecycle.transition` (the one writer of an engine's
state and of the version it serves) along `TRANSITIONS`: starting -> ready -> stopping -> stopped, and
ready -> restarting -> ready (or stopping) for an engine whose process died (gyre.faults). Both backends'
engines (gyre.sim.cluster.engine.SimEngine, gyre.real.engine_view) are `EngineLifecycle`s; the cluster
skeleton (gyre.backend.ClusterBase) decides which states each verb accepts.
"""

from __future__ import annotations

import enum


class EngineState(str, enum.Enum):
    STARTING = "starting"  # its GPUs switch to it (waking, loading weights)
    READY = "ready"  # serving; admits, migrations and syncs go to it
    RESTARTING = "restarting"  # its process died; a new one comes up with the latest weights
    STOPPING = "stopping"  # going to sleep; its GPUs switch away
    STOPPED = "stopped"  # gone from the cluster


STARTING, READY, RESTARTING, STOPPING, STOPPED = EngineState
TRANSITIONS: dict[EngineState, tuple[EngineState, ...]] = {
    STARTING: (READY, RESTARTING),  # a real engine's actor may die while it wakes
    READY: (STOPPING, RESTARTING),
    RESTARTING: (READY,),
    STOPPING: (STOPPED,),
    STOPPED: (),
}


class EngineLifecycle:
    """An engine's state and the version of the weights it serves, each written by one method."""

    __slots__ = ("state", "_version")

    def __init__(self, version: int) -> None:
        self.state = STARTING
        self._version = version

    @property
    def version(self) -> int:
        """The version it serves; while starting or restarting, the one it will serve once ready."""
        return self._version

    @property
    def ready(self) -> bool:
        return self.state is READY

    def transition(self, to: EngineState, version: int | None = None) -> None:
        """Move to state `to` (one of TRANSITIONS[state]), serving `version` from now if given."""
        if to not in TRANSITIONS[self.state]:
            raise RuntimeError(f"engine {getattr(self, 'id', '?')}: no transition {self.state.value} -> {to.value}")
        self.state = to
        if version is not None:
            self.serve(version)

    def serve(self, version: int) -> None:
        """From now on it serves (or, not ready, will serve) `version`: the one place a version is set."""
        self._version = version
