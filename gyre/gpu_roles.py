"""The GPU role book that every backend keeps: each GPU's role, who holds it, what its memory holds.

Both backends (gyre.sim, gyre.real) use this one class through gyre.backend.ClusterBase, so role
bookkeeping, the "is this GPU free" rule and the role records of the event log cannot drift apart.

Invariants: a GPU is held by at most one engine (its id) or the trainer (TRAINER); a free GPU is IDLE
and unheld; every role change is logged as ("role", t, gpus, role).
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre.cluster import ClusterError, Role

TRAINER = -1


class GpuRoles:
    def __init__(self, n_gpus: int, log: list[tuple]) -> None:
        if n_gpus < 1:
            raise ClusterError(f"cluster.gpus must be >= 1, got {n_gpus}")
        self.n = n_gpus
        self.role = [Role.IDLE] * n_gpus
        self.owner: list[int | None] = [None] * n_gpus  # engine id, TRAINER, or None
        self.resident: list[str | None] = [None] * n_gpus  # what memory holds: "engine" / "trainer"
        self._log = log

    def free(self) -> list[int]:
        return [g for g in range(self.n) if self.owner[g] is None and self.role[g] == Role.IDLE]

    def check_free(self, gpus: Sequence[int], what: str) -> tuple[int, ...]:
        """The GPUs as a tuple, or a one-line ClusterError naming the verb and the first bad GPU."""
        gpus = tuple(int(g) for g in gpus)
        if len(set(gpus)) != len(gpus):
            raise ClusterError(f"{what}: GPU list has duplicates: {gpus}")
        for g in gpus:
            if not 0 <= g < self.n:
                raise ClusterError(f"{what}: GPU {g} does not exist (cluster has {self.n})")
            if self.owner[g] is not None or self.role[g] != Role.IDLE:
                raise ClusterError(f"{what}: GPU {g} is busy ({Role(self.role[g]).name})")
        return gpus

    def set_role(self, gpus: Sequence[int], role: Role, t: float) -> None:
        for g in gpus:
            self.role[g] = role
        self._log.append(("role", t, tuple(gpus), int(role)))

    def hold(self, gpus: Sequence[int], owner: int | None) -> None:
        for g in gpus:
            self.owner[g] = owner

    def load(self, gpus: Sequence[int], what: str) -> None:
        for g in gpus:
            self.resident[g] = what

