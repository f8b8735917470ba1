"""An execution as the simulator tracks it: a cursor over its ExecutionSpec plus observable state.

Policies see it through the ExecutionView protocol (id, phase, engine, progress so far); the spec,
which knows the future, stays private to the backend.

Its phase and its version credit (`vsum`, `seg_cred`, `first_version` and the remembered `base_*`) change only
through the methods below (the phase moves and the credit it earns), as its KV fields change only through its
engine's KvLedger: the engine's event loop (gyre.sim.cluster.engine), KV pressure (gyre.sim.cluster.kv_pressure),
what the cluster does to an engine (gyre.sim.cluster.engine_moves) and the cluster itself (finish, park) call
them. Each does the same float operations, in the same order, as the code it replaced.
"""

from __future__ import annotations

import dataclasses
from operator import add

from gyre.backend import BookedGroup
from gyre.cluster import Phase
from gyre.handles import Handle
from gyre.workload import ExecutionSpec, GroupSpec

_TOOL, _PREFILL, _DECODE, _QUEUED = Phase.TOOL, Phase.PREFILL, Phase.DECODE, Phase.QUEUED


class SimExecution:
    __slots__ = (
        "id", "group_id", "task_id", "spec", "engine", "phase", "seg", "first_version", "started_at",
        "deadline_at", "handle", "v_start", "ctx", "seg_done", "resident", "pf_left", "adm", "reserved",
        "max_ctx", "migrate_to", "migrate_handle", "finished_at", "truncated", "end", "generated", "gen", "kv",
        "tool_s", "tool_out", "last", "ready_at", "vsum", "seg_cred", "holds", "base_seg", "base_vsum", "base_fv",
    )

    def __init__(self, spec: ExecutionSpec) -> None:
        self.id = spec.exec_id
        self.group_id = spec.group_id
        self.task_id = spec.task_id
        self.spec = spec
        self.engine = None
        self.phase = Phase.QUEUED
        self.seg = 0  # index of the next (or current) segment to decode
        self.first_version: int | None = None
        self.started_at: float | None = None
        self.deadline_at = float("inf")
        self.handle = Handle(f"exec{spec.exec_id}")
        self.v_start = 0.0  # the engine's V when it joined the decode batch
        self.ctx = spec.kv[0]  # context when it (re)starts decoding: its segment's start plus tokens done
        self.seg_done = 0.0  # tokens of the current segment decoded before a preemption
        self.resident = 0  # KV tokens of ctx held on its engine while not decoding (its KvLedger writes it)
        self.holds = False  # holds KV on its engine: decoding, or a resident context (its KvLedger's count)
        self.pf_left = 0.0  # tokens still to prefill (in the engine's prefill queue)
        self.adm = -1  # admission sequence number on its engine (preemption picks the largest)
        self.reserved = 0  # KV reserved on its engine (reservation mode)
        self.max_ctx = max(map(add, spec.kv, spec.gen))  # its largest context
        self.migrate_to = None
        self.migrate_handle: Handle | None = None
        self.finished_at: float | None = None
        self.truncated = False
        self.end = ""  # how it ended: "done", "capped" (length cap) or "deadline"
        self.generated = 0
        # the spec's per-segment lists, held directly for the hot path
        self.gen, self.kv, self.tool_s, self.tool_out = spec.gen, spec.kv, spec.tool_s, spec.tool_out
        self.last = len(spec.gen) - 1
        self.ready_at: float | None = None  # when it rejoins the batch (while between turns)
        self.vsum = 0.0  # sum over its generated tokens of the version that generated each (per-token lag)
        self.seg_cred = 0.0  # tokens of the current segment already counted in vsum (a sync or preemption mid-segment)
        # the version credit (vsum, first_version) as it was before segment `base_seg` first changed it (-1: none
        # remembered): what a cancelled request of that segment restores (`_mark_credit`, `drop_segment_credit`)
        self.base_seg = -1
        self.base_vsum = 0.0
        self.base_fv: int | None = None

    # --- the phase on an engine ---
    def wait(self) -> None:
        """It waits in its engine's wait queue (for KV, or for a running sequence to leave)."""
        self.phase = _QUEUED

    def start_prefill(self) -> None:
        """It left the wait queue into the prefill queue: its missing context is being computed."""
        self.phase = _PREFILL

    def start_decode(self, V: float, version: int) -> None:
        """It joins the decode batch at the engine's token clock V, generating at `version`: an older version than
        any before lowers its first version (remembered, as for any change of the credit mid-segment)."""
        self.phase = _DECODE
        self.v_start = V
        if self.first_version is None or version < self.first_version:
            self._mark_credit()
            self.first_version = version

    def await_tool(self) -> None:
        """It is between turns: its tool call (or its next request) is a timer on its engine."""
        self.phase = _TOOL

    def end_segment(self, version: int) -> None:
        """Its current segment was decoded to the end (it left the batch): the segment's tokens count as generated,
        those not yet credited at `version`, and it is between turns (the caller then moves the cursor on)."""
        gen = self.gen[self.seg]
        self.generated += gen
        self.vsum += (gen - self.seg_cred) * version  # the segment's tokens not yet counted, at this version
        self.seg_cred = 0.0
        self.seg_done = 0
        self.phase = _TOOL

    # --- off every engine ---
    def park(self) -> None:
        """It was moved off every engine (KV freed); a running tool call keeps its return time (`ready_at`)."""
        self.phase = Phase.PARKED

    def finish(self, t: float, end: str) -> None:
        """It ended at t: "done", "capped" (its last segment, at the length cap) or "deadline"."""
        self.phase = Phase.DONE
        self.finished_at = t
        self.end = end
        self.truncated = end != "done"

    # --- the current segment's version credit ---
    def _mark_credit(self) -> None:
        """The current segment is about to change the version credit (vsum or first_version) for the first time:
        remember the credit as it was (called by every such change that happens mid-segment, and by the first
        decode that lowers first_version; the common end of a segment changes it after the segment is over)."""
        if self.base_seg != self.seg:
            self.base_seg = self.seg
            self.base_vsum = self.vsum
            self.base_fv = self.first_version

    def credit_decoded(self, done: float, version: int) -> None:
        """Mid-segment (a preemption, or a weight sync): the first `done` tokens of the current segment were
        generated at `version`; those not yet credited are credited now."""
        self._mark_credit()
        self.vsum += (done - self.seg_cred) * version
        self.seg_cred = done

    def drop_segment_credit(self) -> None:
        """The current segment's tokens are discarded (its request was cancelled): the version credit is again
        what the kept tokens earned, exactly (restored, not subtracted: no float residue)."""
        if self.base_seg == self.seg:
            self.vsum = self.base_vsum
            self.first_version = self.base_fv
            self.base_seg = -1
        self.seg_done = self.seg_cred = 0.0

    # --- ExecutionView ---
    @property
    def engine_id(self) -> int | None:
        return None if self.engine is None else self.engine.id

    @property
    def turns_done(self) -> int:
        return self.seg

    @property
    def context_tokens(self) -> int:
        return int(self.ctx) if self.phase == Phase.DECODE else self.resident

    @property
    def trajectory_tokens(self) -> int:
        """Prompt, generated and tool-output tokens so far (the tool calls started); once finished, what training
        trains (`produced().tokens`)."""
        return self.spec.prompt + self.generated + sum(self.tool_out[: min(self.seg, len(self.tool_out))])

    def produced(self) -> ExecutionSpec:
        """What this finished execution produced, as a spec: the whole spec unless its deadline cut it, else
        its turns generated and the outputs of the tool calls it started (what training trains, and costs)."""
        if self.end != "deadline":
            return self.spec
        seg = self.seg
        n = seg + 1 if seg <= self.last and self.generated == sum(self.gen[: seg + 1]) else seg
        return dataclasses.replace(self.spec, gen=self.gen[:n], kv=self.kv[:n], tool_s=self.tool_s[:seg],
                                   tool_out=self.tool_out[:seg], branches=[b for b in self.spec.branches if b[0] < n])

    def __repr__(self) -> str:
        return f"<exec {self.id} {self.phase.name} seg={self.seg} engine={self.engine_id}>"


class SimGroup(BookedGroup):
    __slots__ = ("id", "task_id", "step", "executions", "spec")

    def __init__(self, spec: GroupSpec, executions: list[SimExecution]) -> None:
        self.id = spec.group_id
        self.task_id = spec.task_id
        self.step = spec.step
        self.executions = executions
        self.spec = spec  # private to the backend, like SimExecution.spec

    @property
    def first_version(self) -> int | None:
        vs = [e.first_version for e in self.executions if e.first_version is not None]
        return min(vs) if vs else None
