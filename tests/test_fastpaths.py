"""Vectorized paths equal their plain reference: the CSV fast reader and the metrics (the lower bound is
tested against simulated runs in test_bound.py, not against a copy of its formula).

The references below are the straightforward per-record loops (the definitions); the library uses
numpy / pandas versions of them so that a 1M-execution replay stays fast.
"""

from __future__ import annotations


import numpy as np
import pytest

from gyre.config import override
from gyre.metrics import compute_metrics
from gyre.presets import get_preset
from gyre.sim.harness.runner import simulate
from gyre.traces import readers
from gyre.traces.readers import Grouping, read_request_csv


# ---------------------------------------------------------------- CSV: C parser vs line reader
def _trace_tuple(tr):
    return ([(e.exec_id, e.group_id, e.step, e.prompt, e.gen, e.kv, e.capped) for g in tr.groups for e in g.executions],
            tr.times, tr.skipped)


@pytest.mark.parametrize("times", ["numbers", "datetimes", "none"])
def test_clean_csv_fast_path_equals_line_reader(tmp_path, monkeypatch, times):
    """A well-formed CSV takes the C parser and reads exactly as the line-by-line reader does."""
    rng = np.random.default_rng(1)
    n = 500
    t = rng.permutation(n) * 0.5  # out of order: the reader sorts by time (stably)
    t[10] = t[11]  # a tie keeps file order
    if times == "datetimes":
        col = [f"2023-11-16 18:{int(x) // 60 % 60:02d}:{int(x) % 60:02d}.{int(x * 10) % 10}" for x in t]
    else:
        col = [repr(float(x)) for x in t]
    head = "TIMESTAMP,ContextTokens,GeneratedTokens" if times != "none" else "ContextTokens,GeneratedTokens"
    rows = [(f"{c}," if times != "none" else "") + f"{rng.integers(0, 9000)},{rng.integers(1, 900)}" for c in col]
    p = tmp_path / "r.csv"
    p.write_text(head + "\n" + "\n".join(rows) + "\n")
    fields = readers.RequestFields(time="" if times == "none" else "TIMESTAMP")
    g = Grouping(group_size=8, groups_per_step=4, cap=800)
    assert readers._clean_csv(p, fields) is not None, "a clean file takes the fast path"
    fast = _trace_tuple(read_request_csv(p, fields=fields, grouping=g))
    monkeypatch.setattr(readers, "_clean_csv", lambda *_: None)
    slow = _trace_tuple(read_request_csv(p, fields=fields, grouping=g))
    assert fast == slow, "fast and line-by-line readers disagree"


@pytest.mark.parametrize("body", [
    "1,10,5\n\n2,20,6\n",  # a blank line
    '1,10,5\n"2",20,6\n3,"3\n0",7\n',  # a quoted newline
    "1,10,5\n2,20\n",  # a missing field
    "1,10,5\n2,20,6,9\n",  # an extra field
    "1,10,5\n2,x,6\n",  # a bad value
    "1,10,5\n2,1.5,6\n",  # a non-integer token count
])
def test_irregular_csv_takes_the_line_reader(tmp_path, body):
    """Anything irregular is left to the line reader (which names file:line)."""
    p = tmp_path / "r.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + body)
    assert readers._clean_csv(p, readers.AZURE_FIELDS) is None


# ---------------------------------------------------------------- metrics: reference loops
def _reference_role_seconds(log, n_gpus, makespan):
    role = np.zeros(n_gpus, dtype=np.int64)
    since = np.zeros(n_gpus)
    last_work = np.full(n_gpus, -1)
    secs = np.zeros(4)
    realloc = 0
    for r in log:
        if r[0] != "role":
            continue
        t, gpus, new = min(r[1], makespan), list(r[2]), r[3]
        for g in gpus:
            secs[role[g]] += t - since[g]
            since[g] = t
            role[g] = new
            if new in (1, 2):
                realloc += int(last_work[g] >= 0 and last_work[g] != new)
                last_work[g] = new
    for g in range(n_gpus):
        secs[role[g]] += makespan - since[g]
    return secs, realloc


def _reference_utilization(log, n_gpus, grid):
    changes = [(r[1], list(r[2]), r[3]) for r in log if r[0] == "role"]
    out = []
    for x in grid:
        role = np.zeros(n_gpus, dtype=np.int64)
        for t, gpus, new in changes:
            if t <= x:
                role[gpus] = new
        out.append(np.bincount(role, minlength=4))
    return np.array(out, dtype=float)


@pytest.fixture(scope="module")
def runs():
    out = []
    for preset in ("xlong-swe-small", "short-math"):
        for policy in ("colocate", "async", "elastic"):
            out.append(simulate(override(get_preset(preset), steps=3), policy))
    return out


def test_metrics_equal_reference_loops(runs):
    """GPU-seconds by role, reallocations, utilization grid and execution times match plain loops."""
    for r in runs:
        n = r.config.cluster.gpus
        m = compute_metrics(r.log, n_gpus=n, policy=r.policy)
        secs, realloc = _reference_role_seconds(r.log, n, m.makespan_s)
        got = [m.gpu_seconds["idle"], m.gpu_seconds["rollout_busy"] + m.gpu_seconds["rollout_idle"],
               m.gpu_seconds["train"], m.gpu_seconds["switching"]]
        np.testing.assert_allclose(got, secs, rtol=1e-9, atol=1e-6, err_msg=f"{r.policy}: GPU-seconds by role")
        assert m.reallocations == realloc, f"{r.policy}: reallocations {m.reallocations} != {realloc}"
        ref = _reference_utilization(r.log, n, m.utilization["t_s"].to_numpy())
        np.testing.assert_array_equal(m.utilization[["idle", "rollout", "train", "switching"]].to_numpy(), ref)
        start = {x[2]: x[1] for x in r.log if x[0] == "start"}
        fin = [(x[2], start[x[2]], x[1], x[3], x[4]) for x in r.log if x[0] == "finish"]
        assert [tuple(v) for v in m.executions.itertuples(index=False)] == fin, f"{r.policy}: executions frame"
        assert len(m.staleness) == sum(1 for x in r.log if x[0] == "trained")


def test_gc_pause_leaks_no_cycle():
    """Cycles made while the collector is paused are still collected afterwards (freeze + unfreeze
    only skips the young-generation scan)."""
    import gc
    import weakref

    from gyre.gc_pause import no_gc

    class Node:
        pass

    refs = []
    with no_gc():
        with no_gc():  # nests
            for _ in range(100):
                a = Node()
                a.self = a  # a cycle: refcounting alone cannot free it
                refs.append(weakref.ref(a))
            del a
        assert not gc.isenabled(), "the outer pause still holds"
    assert gc.isenabled()
    gc.collect()
    assert all(r() is None for r in refs), "a cycle made during the pause leaked"


def test_role_matrix_equals_reference_loop(runs):
    """The timeline's role per GPU and time bin: the last role change at or before each bin start."""
    from gyre.metrics import role_matrix

    for r in runs:
        n = r.config.cluster.gpus
        for bins in (7, 300):
            got = role_matrix(r.log, n, r.makespan_s, bins=bins)
            grid = np.linspace(0.0, r.makespan_s, bins, endpoint=False)
            ref = np.zeros((n, bins), dtype=np.int8)
            for x in r.log:
                if x[0] == "role":
                    ref[list(x[2]), int(np.searchsorted(grid, x[1], side="left")):] = x[3]
            got_roles = np.where(got == 4, 1, got)  # 4 = rollout with nothing decoding
            np.testing.assert_array_equal(got_roles, ref, err_msg=f"{r.policy}, {bins} bins")
            assert not np.any((got == 4) & (ref != 1)), "only rollout GPUs can be 'nothing decoding'"
