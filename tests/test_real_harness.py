"""Black-box harness programs on the real backend: local Ray, a tiny random Qwen3, the model proxy in between."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("tornado")

sys.path.insert(0, str(Path(__file__).parent))
from test_real_cluster import check_run  # noqa: E402

from gyre.cluster import Phase  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.engine_torch import TorchEngineConfig  # noqa: E402
from gyre.real.nn.hf_folder import write_tiny_model  # noqa: E402
from gyre.real.pool import ActorPool  # noqa: E402
from gyre.real.proxy_chat import TOOLS_TEMPLATE  # noqa: E402
from gyre.real.runner import run_real  # noqa: E402
from gyre.real.tasks.harness import HarnessTaskConfig  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")
ROOT = Path(__file__).parents[1]
BASE = preset_tiny_test()
OWN = ("{python}", "{harnesses}/own_agent.py", "--turns", "3", "--subagent-at", "1", "--compact-after", "4")


@pytest.fixture(scope="module")
def chat_qwen3(tmp_path_factory):
    """A tiny random Qwen3 folder with the tiny tokenizer and a tool-aware chat template (gyre.real.proxy_chat)."""
    folder = tmp_path_factory.mktemp("qwen3chat")
    write_tiny_model(folder, "qwen3", vocab_size=384, seed=4)
    for f in (ROOT / "configs" / "tiny_chat").iterdir():
        shutil.copyfile(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(folder)


def harness_run(model_dir: str, tmp_path, harness=OWN, **task):
    pool = dataclasses.replace(BASE.pool, model_dir=model_dir, engine_config=TorchEngineConfig(),
                               model=dataclasses.replace(BASE.pool.model, vocab_size=384))
    tcfg = HarnessTaskConfig(harness=harness, model_dir=model_dir, problems=str(ROOT / "configs" / "code_problems.jsonl"),
                             max_new_tokens=24, max_context=2048, workdir=str(tmp_path / "work"), **task)
    cluster = dataclasses.replace(BASE.cluster, task_class="gyre.real.tasks.harness:HarnessTask", task=tcfg,
                                  groups_per_step=1, group_size=2, kv_capacity=16384, estimate="none",
                                  move_at="request", max_wall_s=300.0)
    return dataclasses.replace(BASE, pool=pool, cluster=cluster, steps=1)


def transcripts(r) -> list[list[dict]]:
    out = []
    for g in r.cluster.groups.values():
        for ep in g.env.episodes:
            p = Path(ep.cwd) / "transcript.jsonl"
            out.append([json.loads(ln) for ln in p.read_text().splitlines()] if p.exists() else [])
    return out


def check_records_are_the_tree(g) -> None:
    """Every TITO record's ids and log-probs lie in the group's tree, on one root-to-leaf path, exactly."""
    tree = g.env.recorder.tree
    for ep in g.env.episodes:
        leaves = [e for e, _ in ep.tito.leaves]
        for rec, end in zip(ep.records, ep.tito._ends):
            path = tree.path_tokens(end)
            seq = np.asarray(rec.input_ids + rec.output_ids)
            assert np.array_equal(path[-seq.size:], seq) and path.size == seq.size, \
                f"{rec.execution}#{rec.n}: the tree path is not the record's ids"
            n = len(rec.output_ids)
            idx, q = [], end
            for _ in range(n):
                idx.append(q)
                q = int(tree.parent[q])
            idx = idx[::-1]
            assert np.array_equal(tree.logprob[idx], np.asarray(rec.logprobs)) and tree.trained[idx].all(), \
                f"{rec.execution}#{rec.n}: log-probs differ or output not trained"
        assert leaves, f"{ep.key}: no branch"


@contextlib.contextmanager
def engine_answers():
    """Every answer an engine gave the flow inside the block, in order: {exec, engine, current (the execution still
    wanted it: not moved away meanwhile), cancelled, tokens, logprobs}."""
    from gyre.real import flow

    answers: list[dict] = []
    orig = flow.ExecutionFlow._on_generated

    def spy(self, ex, req, eng, actor, res, err):
        if err is None:
            answers.append({"exec": ex.id, "engine": eng.id, "current": req == ex.req, "cancelled": bool(
                res.get("cancelled")), "tokens": list(res["tokens"]), "logprobs": list(res["logprobs"])})
        return orig(self, ex, req, eng, actor, res, err)

    flow.ExecutionFlow._on_generated = spy
    try:
        yield answers
    finally:
        flow.ExecutionFlow._on_generated = orig


def check_records_are_the_answers(r, answers: list[dict]) -> None:
    """Each execution's TITO records are, in order and exactly, the engines' ids and log-probs of the answers it
    still wanted, one per harness call; and the records lie on the group's tree."""
    for g in r.cluster.groups.values():
        check_records_are_the_tree(g)
        for ex, ep in zip(g.executions, g.env.episodes):
            got = [(list(x.output_ids), list(x.logprobs)) for x in ep.records]
            want = [(a["tokens"], a["logprobs"]) for a in answers
                    if a["exec"] == ex.id and a["current"] and not a["cancelled"]]
            assert got and got == want, f"execution {ex.id}: records differ from the engines' answers"


def test_own_harness_runs_under_colocate_with_every_branch_kind_and_a_move_mid_request(local_ray, chat_qwen3, tmp_path):
    """The own harness (a subprocess on plain HTTP) runs end to end under colocate: records equal the engines' ids and
    log-probs exactly, its sub-agent and compaction calls carry their roles and form branches, and an execution moved
    while its request decodes finishes with every HTTP answer an ordinary 200."""
    cfg = harness_run(chat_qwen3, tmp_path)
    moved: list[int] = []
    tick = move_one_decoding(moved)

    with engine_answers() as answers:
        r = run_real(cfg, "colocate", pool=ActorPool.shared(cfg.pool), on_tick=tick)
    check_run(r, cfg.steps)
    assert moved, "no execution was moved while it decoded"
    notes = [x[3] for x in r.log if x[0] == "note" and x[2] == "request_moved"]
    assert notes and notes[0]["exec"] == moved[0], f"the move was not an in-flight one: {notes}"
    check_own_calls(r, answers)


def move_one_decoding(moved: list, record=lambda ex: ex.id):
    """An `on_tick` that, once, moves the first execution decoding after its first turn to another ready engine and
    appends `record(execution)` to `moved`."""

    def tick(c) -> None:
        if moved:
            return
        for ex in c.executions.values():
            others = [e for e in c._engines.values() if e.ready and e is not ex.engine]
            if ex.phase == Phase.DECODE and ex.turns >= 1 and others:
                c.migrate(ex, others[0])
                moved.append(record(ex))
                return

    return tick


def check_own_calls(r, answers: list[dict], min_calls: int = 1) -> None:
    """The own harness's run: every call it made (>= min_calls) an HTTP 200, its records the engines' answers on the
    tree with the roles it sent, its sub-agent's and compaction's calls among them, branching off the main context."""
    check_records_are_the_answers(r, answers)
    for g in r.cluster.groups.values():
        for ex, ep in zip(g.executions, g.env.episodes):
            calls = transcripts_of(ep)
            assert len(calls) >= min_calls and all(c["status"] == 200 and c["ok"] for c in calls), \
                f"a harness saw a failed call: {calls}"
            roles = [x.role for x in ep.records]
            assert roles == [c["role"] for c in calls], f"execution {ex.id}: roles {roles}"
            assert {"sub-agent", "sub-agent-summary", "main-summary"} <= set(roles), f"roles {roles}"
            assert ep.tito.kinds.count("branch") >= 2, f"execution {ex.id}: kinds {ep.tito.kinds}"
            leaf_roles = {role for _, role in ep.tito.leaves}
            assert {"main", "sub-agent-summary"} <= leaf_roles, f"execution {ex.id}: leaf roles {leaf_roles}"


def transcripts_of(ep) -> list[dict]:
    return [json.loads(ln) for ln in (Path(ep.cwd) / "transcript.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("policy", ["async", "elastic"])
def test_own_harness_runs_under_async_and_elastic(local_ray, chat_qwen3, tmp_path, policy):
    """async and elastic run the own harness end to end (inside bubblewrap where it is installed): nothing lost,
    every call a 200, its records the engines' answers on the tree with the roles it sent."""
    cfg = own_config(chat_qwen3, tmp_path, policy)
    with engine_answers() as answers:
        r = run_real(cfg, policy, pool=ActorPool.shared(cfg.pool))
    check_run(r, cfg.steps)
    check_own_calls(r, answers, min_calls=5)


def sandboxed() -> str:
    """The harness sandbox the tests use: bubblewrap where it is installed."""
    return "bwrap" if shutil.which("bwrap") else "none"


def own_config(model_dir: str, tmp_path, policy: str):
    """The own harness's run under `policy`, sandboxed; elastic reads the cost estimate, measured at start-up."""
    cfg = harness_run(model_dir, tmp_path, sandbox=sandboxed())
    return dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, estimate="profile" if policy == "elastic" else "none"))


def test_a_crashed_and_a_hung_harness_end_their_executions_with_their_work_scored(local_ray, chat_qwen3, tmp_path):
    """One harness exits with code 3, the other hangs past harness_timeout_s and is killed: both executions end
    (truncated only the killed one), nothing is lost, and both are scored on the solution.py they left."""
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"id": "p", "prompt": "write anything", "tests": ["assert True"]}) + "\n")
    argv = OWN + ("--fault", "crash:e0", "--fault", "hang:e1")
    cfg = harness_run(chat_qwen3, tmp_path, harness=argv, harness_timeout_s=8.0)
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, task=dataclasses.replace(cfg.cluster.task, problems=str(problems))))
    r = run_real(cfg, "colocate", pool=ActorPool.shared(cfg.pool))
    check_run(r, cfg.steps)
    eps = [ep for g in r.cluster.groups.values() for ep in g.env.episodes]
    crashed = [ep for ep in eps if ep.key.endswith("e0")]
    hung = [ep for ep in eps if ep.key.endswith("e1")]
    assert crashed and all(ep.exit["code"] == 3 and not ep.exit["timed_out"] for ep in crashed), [ep.exit for ep in crashed]
    assert hung and all(ep.exit["timed_out"] and ep.cursor.status == "truncated" for ep in hung), [ep.exit for ep in hung]
    rewards = [x[3] for x in r.log if x[0] == "note" and x[2] == "train"]
    assert rewards and rewards[0]["reward_mean"] == 1.0, f"the work left was not scored: {rewards}"
    assert all(len(ep.records) == 1 for ep in eps), "each harness made exactly its first call"


@pytest.mark.slow
def test_parallel_sub_agents_are_one_round_on_the_engine_and_move_together(local_ray, chat_qwen3, tmp_path):
    """The own harness with two sub-agents at once under colocate: their calls reach the backend as one round, a
    Generate with a parallel segment, decoded at once on the execution's engine; a round moved while it decodes is
    cancelled and re-issued whole; every record is the engine's answer to that call, and every HTTP answer a 200."""
    argv = OWN[:-2] + ("--compact-after", "8", "--parallel", "2")
    cfg = harness_run(chat_qwen3, tmp_path, harness=argv)
    from gyre.real import flow

    seen: dict[int, list] = {}
    moved: list[int] = []
    orig = flow.ExecutionFlow._on_generated

    def spy(self, ex, req, eng, actor, res, err):
        if err is None and req == ex.req and not res.get("cancelled"):
            for g in res.get("parallel") or [res]:
                seen.setdefault(ex.id, []).append((list(g["tokens"]), list(g["logprobs"])))
        return orig(self, ex, req, eng, actor, res, err)

    def tick(c) -> None:
        if moved:
            return
        for ex in c.executions.values():
            others = [e for e in c._engines.values() if e.ready and e is not ex.engine]
            if ex.phase == Phase.DECODE and getattr(ex.inflight, "parallel", ()) and others:
                c.migrate(ex, others[0])
                moved.append(ex.id)
                return

    flow.ExecutionFlow._on_generated = spy
    try:
        r = run_real(cfg, "colocate", pool=ActorPool.shared(cfg.pool), on_tick=tick)
    finally:
        flow.ExecutionFlow._on_generated = orig
    check_run(r, cfg.steps)
    for calls in transcripts(r):
        assert calls and all(c["status"] == 200 and c["ok"] for c in calls), f"a harness saw a failed call: {calls}"
    notes = [x[3]["exec"] for x in r.log if x[0] == "note" and x[2] == "request_moved"]
    assert moved and notes == moved, f"no parallel round was moved while it decoded: {moved}, {notes}"
    for g in r.cluster.groups.values():
        check_records_are_the_tree(g)
        for ex, ep in zip(g.executions, g.env.episodes):
            got = [(list(x.output_ids), list(x.logprobs)) for x in ep.records]
            assert got == seen.get(ex.id), f"execution {ex.id}: records differ from the engines' answers"
            rounds: dict[float, list[str]] = {}
            for x in ep.records:
                rounds.setdefault(x.issued_s, []).append(x.role)
            pairs = sorted(v for v in rounds.values() if len(v) == 2)
            assert pairs == [["sub-agent"] * 2, ["sub-agent-summary"] * 2], f"execution {ex.id}: rounds {rounds}"


MINI = ROOT / ".venv-mini" / "bin" / "mini"


@pytest.mark.skipif(not MINI.exists(), reason="mini-swe-agent not installed (make harness-mini)")
@pytest.mark.parametrize("policy", ["colocate", "async", "elastic"])
def test_mini_swe_agent_runs_unmodified_behind_the_proxy(local_ray, chat_qwen3, tmp_path, policy):
    """mini-swe-agent 2.4.6 (PyPI, its own venv, inside bubblewrap where installed) runs as the agent under each
    policy: every call it made is a record equal to the engine's answer, on the tree, it ran to its own end (its
    trajectory file), nothing lost."""
    cfg = mini_config(chat_qwen3, tmp_path, policy)
    with engine_answers() as answers:
        r = run_real(cfg, policy, pool=ActorPool.shared(cfg.pool))
    check_run(r, cfg.steps)
    check_mini_calls(r, answers)


def mini_config(model_dir: str, tmp_path, policy: str):
    """mini-swe-agent (2 steps, sandboxed) on a code problem under `policy`: ~3k-token contexts (its system prompt)."""
    argv = ("{harnesses}/mini_swe_agent.sh",)
    cfg = harness_run(model_dir, tmp_path, harness=argv, env=(("MINI", str(MINI)), ("MINI_STEPS", "2")),
                      sandbox=sandboxed())
    tc = dataclasses.replace(cfg.pool.trainer_config, max_pack_tokens=8192, micro_batch_tokens=8192)  # ~3k-token paths
    return dataclasses.replace(cfg, pool=dataclasses.replace(cfg.pool, trainer_config=tc), cluster=dataclasses.replace(
        cfg.cluster, kv_capacity=65536, estimate="profile" if policy == "elastic" else "none",
        task=dataclasses.replace(cfg.cluster.task, max_context=8192, max_new_tokens=32)))


def check_mini_calls(r, answers: list[dict]) -> None:
    """mini-swe-agent's run: every call it made is a record (role main: it sends none) equal to the engine's answer,
    on the tree, and it ran to its own end (its trajectory file)."""
    check_records_are_the_answers(r, answers)
    for g in r.cluster.groups.values():
        for ep in g.env.episodes:
            assert ep.exit is not None and ep.exit["requests"] == len(ep.records) >= 1, \
                f"{ep.key}: {ep.exit}, {len(ep.records)} records: {(Path(ep.cwd) / '.harness.stderr').read_text()[-400:]}"
            assert {x.role for x in ep.records} == {"main"}, f"{ep.key}: roles {[x.role for x in ep.records]}"
            assert (Path(ep.cwd) / "traj.json").exists(), f"{ep.key}: mini-swe-agent did not run to its end"
