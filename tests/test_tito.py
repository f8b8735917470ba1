"""Trees from TITO records: prefix matching per execution, branch kinds, roles on leaves, and what training reads."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.trajectory import TaskRecorder, build_packs, PackConfig
from gyre.trajectory.tito import TitoRecord, TitoTree

PROMPT = [1, 2, 3]


def rec(n, inp, out, role="main", lp=-0.25, version=0):
    return TitoRecord(execution="e", n=n, role=role, input_ids=tuple(inp), output_ids=tuple(out),
                      logprobs=tuple([lp] * len(out)), version=version, received_s=0.0, issued_s=0.0, done_s=0.0)


def paths(tree, leaves):
    return sorted(tree.path_tokens(e).tolist() for e, _ in leaves)


def test_extend_branch_and_root_calls_make_the_paths_the_model_saw():
    """A turn that extends the last call is one path; a compaction branches at the divergence; a sub-agent sharing
    nothing hangs from the root; each leaf carries the role of the call that ended it."""
    r = TaskRecorder("t", PROMPT)
    ex = r.start()
    t = TitoTree(r.tree, ex.id)
    calls = [rec(1, PROMPT, [10, 11]), rec(2, PROMPT + [10, 11, 20], [12]),  # a tool result, a turn
             rec(3, PROMPT + [10, 11, 20, 12, 21], [13], role="main-summary"),  # the summary request
             rec(4, PROMPT + [30], [14]),  # compacted: prompt + summary
             rec(5, [40, 41], [15], role="sub-agent")]  # a sub-agent with its own context
    for c in calls:
        t.add(c)
    leaves = t.close(ex)
    assert t.kinds == ["root", "extend", "extend", "branch", "root"], t.kinds
    want = sorted([PROMPT + [10, 11, 20, 12, 21, 13], PROMPT + [30, 14], [40, 41, 15]])
    assert paths(r.tree, leaves) == want, paths(r.tree, leaves)
    assert sorted(role for _, role in leaves) == ["main", "main-summary", "sub-agent"], leaves
    assert ex.generated_tokens == 6 and r.tree.branch_execution == [0, 0, 0], (ex.generated_tokens, r.tree.branch_execution)
    assert r.tree.size == len(PROMPT) + 11, f"shared prefixes stored more than once: {r.tree.size} tokens"


def test_outputs_are_trained_with_their_logprobs_and_inputs_are_not():
    """Generated ids are policy tokens with their log-probs and version; every new input id is context only."""
    r = TaskRecorder("t", PROMPT)
    ex = r.start()
    t = TitoTree(r.tree, ex.id)
    t.add(rec(1, PROMPT, [10, 11], lp=-0.5, version=3))
    end = t.add(rec(2, PROMPT + [10, 11, 20], [12], lp=-1.5, version=4))
    t.close(ex)
    tr = r.tree
    got = [(int(tr.tokens[i]), bool(tr.trained[i]), float(tr.logprob[i]), int(tr.version[i])) for i in range(tr.size)]
    assert got == [(1, False, 0.0, -1), (2, False, 0.0, -1), (3, False, 0.0, -1), (10, True, -0.5, 3), (11, True, -0.5, 3),
                   (20, False, 0.0, -1), (12, True, -1.5, 4)], got
    assert end == tr.size - 1 and ex.oldest_version == 3, (end, ex.oldest_version)


def test_a_retried_call_is_a_branch_and_an_identical_one_is_one_path():
    """The same request answered twice: different answers are two leaves, identical answers one."""
    r = TaskRecorder("t", PROMPT)
    ex = r.start()
    t = TitoTree(r.tree, ex.id)
    t.add(rec(1, PROMPT, [10]))
    t.add(rec(2, PROMPT, [11]))
    t.add(rec(3, PROMPT, [11]))
    assert t.kinds == ["root", "branch", "branch"], t.kinds
    assert paths(r.tree, t.close()) == [PROMPT + [10], PROMPT + [11]], "identical answers must share one path"


def test_two_executions_share_the_prompt_and_pack_like_a_recorded_group():
    """Two executions' records share the prompt's tokens in one tree, and the packer takes their branches."""
    r = TaskRecorder("t", PROMPT)
    for out in ([10, 11], [12]):
        ex = r.start()
        t = TitoTree(r.tree, ex.id)
        t.add(rec(1, PROMPT, out))
        t.close(ex)
    assert r.tree.size == len(PROMPT) + 3 and r.tree.branch_execution == [0, 1], r.tree.branch_execution
    batch = build_packs([r.tree], [np.array([1.0, -1.0])], PackConfig(max_tokens=64))
    assert batch.branch_execution.tolist() == [0, 1], f"branches packed: {batch.branch_execution}"
    assert sum(p.size for p in batch.packs) == r.tree.size, "every token of the tree packed once"


def test_a_record_without_output_is_refused():
    """A record with no output ids (or a log-prob count that differs) is a one-line ValueError naming it."""
    t = TitoTree(TaskRecorder("t", PROMPT).tree, 0)
    with pytest.raises(ValueError, match=r"record e#1: 3 input ids, 0 output ids"):
        t.add(rec(1, PROMPT, []))


def test_harness_episode_relays_records_and_drops_at_the_overall_timeout(tmp_path):
    """The harness task's episode without Ray: launch -> request -> Generate of the proxy's ids -> record -> respond;
    a request after the deadline stops the harness and the execution is dropped (truncated, scored 0)."""
    pytest.importorskip("transformers")
    from pathlib import Path

    from gyre.real.task_api import Done, Generate, Tool
    from gyre.real.tasks.harness import HarnessTask, HarnessTaskConfig

    root = Path(__file__).parents[1]
    cfg = HarnessTaskConfig(problems=str(root / "configs" / "code_problems.jsonl"),
                            model_dir=str(root / "configs" / "tiny_chat"), overall_timeout_s=10.0, workdir=str(tmp_path))
    task = HarnessTask(cfg, 0)
    task._proxy = "proxy-handle"  # no actor: the episode only names it in its tool calls
    g = task.new_group(0, 1)
    ep = g.episodes[0]
    launch = ep.start(0.0)
    assert isinstance(launch, Tool) and launch.call.method == "launch" and launch.call.args[1] == ep.token, launch
    gen = ep.on_tool({"kind": "request", "n": 1, "ids": [1, 2, 3], "role": "sub-agent", "max_new": 8, "received": 0.0}, 1.0)
    assert gen == Generate([1, 2, 3], 8, seq="sub"), gen
    resp = ep.on_generated([7, 0], [-0.5, -0.25], 2, 2.0)
    assert resp.call.method == "respond" and resp.call.args[1:] == (1, [7, 0], [-0.5, -0.25]), resp.call.args
    assert ep.records[0].role == "sub-agent" and ep.records[0].issued_s == 1.0 and ep.records[0].done_s == 2.0
    stop = ep.on_tool({"kind": "request", "n": 2, "ids": [1, 2, 3, 7, 0, 9], "role": "main", "max_new": 8,
                       "received": 0.0}, 11.0)
    assert stop.call.method == "stop" and ep.dropped, "a request past the deadline must stop the harness"
    done = ep.on_tool({"kind": "exit", "code": -9, "timed_out": True, "requests": 2}, 11.5)
    assert done == Done(truncated=True, end=2) and ep.cursor.status == "truncated", done
    assert [s.reward for s in task.score(g)] == [0.0], "a dropped execution scores 0"
    assert [r for _, r in ep.tito.leaves] == ["sub-agent"], ep.tito.leaves
