"""Trees from TITO records: prefix matching per execution, branch kinds, roles on leaves, and what training reads."""

from __future__ import annotations

from pathlib import Path

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
    a request after the deadline stops the harness and the execution is dropped (truncated, outcome overall_timeout)."""
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
    assert [(s.outcome, s.truncated) for s in task.score(g)] == [("overall_timeout", True)], "dropped, not scored"
    assert [r for _, r in ep.tito.leaves] == ["sub-agent"], ep.tito.leaves


def harness_task(tmp_path, **kw):
    from gyre.real.tasks.harness import HarnessTask, HarnessTaskConfig

    root = Path(__file__).parents[1]
    cfg = HarnessTaskConfig(problems=str(root / "configs" / "code_problems.jsonl"),
                            model_dir=str(root / "configs" / "tiny_chat"), overall_timeout_s=10.0, workdir=str(tmp_path),
                            **kw)
    task = HarnessTask(cfg, 0)
    task._proxy = "proxy-handle"  # no actor: the episode only names it in its tool calls
    return task


EXIT = {"kind": "exit", "code": 0, "timed_out": False, "requests": 0}


def test_executions_past_the_overall_timeout_leave_training_and_the_group_is_scored_over_the_rest(tmp_path):
    """Issue 46's rule on the harness path: of a group of four, one dropped at its deadline while it waited for the
    harness (a correct solution.py left, never scored), one whose harness exited on its own past the deadline, one
    killed at the harness timeout (scored, truncated), one finished: advantages over the two members left; a group
    of two with one dropped leaves training whole, and the packer trains none of its branches."""
    pytest.importorskip("transformers")
    from gyre.trajectory import AdvantageConfig, group_advantages
    from gyre.trajectory.credit import MEMBER_OUTCOMES

    task = harness_task(tmp_path)
    g = task.new_group(0, 4)  # add_one: three asserts
    eps = g.episodes
    for ep in eps:
        ep.start(0.0)
        Path(ep.cwd).mkdir(parents=True)
    (Path(eps[0].cwd) / "solution.py").write_text("def add_one(x):\n    return x + 1\n")
    assert eps[0].on_tool({"kind": "request", "n": 1, "ids": [5], "role": "main", "max_new": 4, "received": 0.0},
                          10.0).call.method == "stop", "a request at the deadline must stop the harness"
    eps[0].on_tool({**EXIT, "code": -9, "timed_out": True}, 10.5)
    (Path(eps[1].cwd) / "solution.py").write_text("def add_one(x):\n    return x + 1\n")
    eps[1].on_tool(EXIT, 12.0)  # exited by itself, but after the overall timeout
    (Path(eps[2].cwd) / "solution.py").write_text("def add_one(x):\n    return 2\n")  # passes 1 of 3
    eps[2].on_tool({**EXIT, "code": -9, "timed_out": True}, 6.0)  # the harness timeout: scored
    (Path(eps[3].cwd) / "solution.py").write_text("def add_one(x):\n    return x + 1\n")
    eps[3].on_tool(EXIT, 3.0)
    scores = task.score(g)
    got = [(s.outcome, s.truncated, round(s.reward, 3)) for s in scores]
    assert got == [("overall_timeout", True, 0.0), ("overall_timeout", True, 0.0), ("valid", True, 0.333),
                   ("valid", False, 1.0)], got
    adv = group_advantages(scores)
    members = [s.reward for s in scores if s.outcome in MEMBER_OUTCOMES]
    assert members == [pytest.approx(1 / 3), 1.0], members
    mean = (1 / 3 + 1.0) / 2
    assert np.isnan(adv[:2]).all() and adv[2:] == pytest.approx([1 / 3 - mean, 1.0 - mean]), adv

    g2 = task.new_group(1, 2)
    for k, ep in enumerate(g2.episodes):
        ep.start(0.0)
        t = 11.0 if k == 0 else 4.0
        ev = ep.on_tool({"kind": "request", "n": 1, "ids": [5, 6], "role": "main", "max_new": 4, "received": 0.0}, 1.0)
        assert ev.context == [5, 6], ev
        ep.on_generated([7, 0], [-0.5, -0.5], 0, t)
        ep.on_tool(EXIT, t + 0.5)
    scores2 = task.score(g2)
    assert [s.outcome for s in scores2] == ["overall_timeout", "valid"], scores2
    adv2 = group_advantages(scores2, AdvantageConfig())
    assert np.isnan(adv2).all(), f"a group with one member left must leave training: {adv2}"
    batch = build_packs([g2.recorder.tree], [adv2], PackConfig(max_tokens=64))
    assert batch.branch_execution.size == 0 and not batch.packs, "a group that left training was packed"
