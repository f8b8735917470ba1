"""Harness programs behind the model proxy without Ray: the test plays the backend (it answers each request with
ids of its choosing, as an engine would) and checks what the harness saw and what the records make for training."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tornado")
pytest.importorskip("transformers")

from gyre.real.chat import ChatTokenizer  # noqa: E402
from gyre.real.proxy_chat import TOOLS_TEMPLATE  # noqa: E402
from gyre.real.proxy_host import ProxyThread  # noqa: E402
from gyre.trajectory import PackConfig, SamplingConfig, TaskRecorder, build_packs  # noqa: E402
from gyre.trajectory.sample import roles_of, sample_branches  # noqa: E402
from gyre.trajectory.tito import TitoRecord, TitoTree  # noqa: E402
from gyre.trajectory.tree import ROLES  # noqa: E402

ROOT = Path(__file__).parents[1]
OWN = ROOT / "real" / "harnesses" / "own_agent.py"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    for f in (ROOT / "configs" / "tiny_chat").iterdir():
        shutil.copyfile(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return ChatTokenizer(folder).tok


@pytest.fixture()
def proxy(tok):
    pt = ProxyThread(tok)
    yield pt
    pt.close()


def drive(pt, key: str, argv: list[str], cwd: Path, answer, env: dict | None = None, timeout_s: float = 20.0):
    """Run one harness to its end as the backend relays it: each request is answered with `answer(event)` ids
    (log-prob -0.5 - 0.01 n per token). The TITO records in request order and the exit event."""
    pt.proxy.open(key, "tok-" + key, 32, 8192)
    ev = pt.call(pt.proxy.launch(key, argv, {"GYRE_TASK": "Write add_one(x).", **(env or {})}, str(cwd), timeout_s))
    recs = []
    while ev["kind"] == "request":
        out = [int(t) for t in answer(ev)]
        lps = [-0.5 - 0.01 * ev["n"]] * len(out)
        recs.append(TitoRecord(execution=key, n=ev["n"], role=ev["role"], input_ids=tuple(ev["ids"]),
                               output_ids=tuple(out), logprobs=tuple(lps), version=0, received_s=ev["received"],
                               issued_s=0.0, done_s=0.0))
        ev = pt.call(pt.proxy.respond(key, ev["n"], out, lps))
    return recs, ev


def text_answer(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def own_run(tok, pt, tmp_path):
    """The own harness with a sub-agent at turn 1 and a compaction after turn 1: six calls (main, sub-agent,
    sub-agent-summary, main, main-summary, main), each answered with plain text of a different length."""
    argv = [sys.executable, str(OWN), "--turns", "3", "--subagent-at", "1", "--compact-after", "6"]
    recs, ev = drive(pt, "e0", argv, tmp_path / "e0", lambda ev: text_answer(tok, "y" * (2 * ev["n"] + 1)))
    assert ev["code"] == 0 and not ev["timed_out"], (ev, (tmp_path / "e0" / ".harness.stderr").read_text())
    return recs


def test_a_harness_with_a_sub_agent_and_a_compaction_leaves_role_labelled_leaves(tok, proxy, tmp_path):
    """The own harness's calls make a tree whose leaves carry the roles of the calls that ended them: the
    sub-agent's context ends in its summary, the compacted main context in the summary that closed it (that call
    sends no tools, so it branches off), the main contexts before and after compaction in main calls."""
    recs = own_run(tok, proxy, tmp_path)
    assert [r.role for r in recs] == ["main", "sub-agent", "sub-agent-summary", "main", "main-summary", "main"], recs
    r = TaskRecorder("t", [1, 2, 3])
    ex = r.start()
    t = TitoTree(r.tree, ex.id)
    for x in recs:
        t.add(x)
    t.close(ex)
    assert t.kinds == ["root", "branch", "extend", "extend", "branch", "branch"], t.kinds
    ends = t._ends
    assert [e for e, _ in t.leaves] == [ends[2], ends[3], ends[4], ends[5]], (t.leaves, ends)
    pre = r.tree.preorder()
    got = [ROLES[k] for k in roles_of(pre)]
    assert got == ["sub-agent-summary", "main", "main-summary", "main"], f"roles the tree stores: {got}"


def test_role_bounded_sampling_draws_the_harness_paths_by_the_documented_rule(tok, proxy, tmp_path):
    """With J_max paths per execution: main leaves first, the first of them drawn with probability proportional
    to its trained tokens (worked out from the answer lengths), then main-summary, then sub-agent-summary; the
    packer trains exactly the drawn paths."""
    recs = own_run(tok, proxy, tmp_path)
    L = [len(x.output_ids) for x in recs]  # 4, 6, 8, 10, 12, 14 (text of 2n + 1 'y's and the stop token)
    r = TaskRecorder("t", [1, 2, 3])
    ex = r.start()
    t = TitoTree(r.tree, ex.id)
    for x in recs:
        t.add(x)
    t.close(ex)
    # branches in order: 0 sub-agent-summary (calls 2+3), 1 main (calls 1+4), 2 main-summary (call 5), 3 main (call 6)
    w_main = {1: L[0] + L[3], 3: L[5]}
    for seed in range(6):
        u = np.random.default_rng(seed).random()
        first = 1 if u * (w_main[1] + w_main[3]) < w_main[1] else 3
        want = {1: [first], 2: [first, 4 - first], 3: [first, 4 - first, 2], None: [first, 4 - first, 2, 0]}
        for j_max, paths in want.items():
            cfg = SamplingConfig(mode="roles", j_max=j_max)
            got = sample_branches(r.tree.preorder(), cfg, np.random.default_rng(seed)).tolist()
            assert got == paths, f"seed {seed} (u = {u:.3f}), J_max {j_max}: drew {got}, the rule says {paths}"
        batch = build_packs([r.tree], [np.array([1.0])], PackConfig(max_tokens=4096,
                                                                     sampling=SamplingConfig(mode="roles", j_max=2)),
                            rng=np.random.default_rng(seed))
        assert batch.branch_source.tolist() == want[2], f"seed {seed}: packed {batch.branch_source}"
        trained = sum(int(p.rows.pred.shape[0]) for p in batch.packs)
        assert trained == L[0] + L[3] + L[5], f"seed {seed}: {trained} trained tokens, want the two main paths'"


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    """A tiny random Qwen3 of the tiny tokenizer's vocabulary, with the tool-aware chat template."""
    pytest.importorskip("torch")
    from gyre.real.nn.hf_folder import write_tiny_model

    folder = tmp_path_factory.mktemp("qwen3chat")
    write_tiny_model(folder, "qwen3", vocab_size=384, seed=4)
    for f in (ROOT / "configs" / "tiny_chat").iterdir():
        shutil.copyfile(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(folder)


def test_parallel_sub_agents_are_generated_together_and_recorded_per_call(engine_model, tmp_path):
    """Two sub-agents of one execution call at once: the proxy hands both to the backend as one round, a real torch
    engine decodes them in one batch (its decode steps hold 2 sequences), and each call's TITO record holds its own
    answer: each summary call continues its own sub-agent's record exactly, and every record is what the engine
    returned for it."""
    import asyncio
    import json
    import threading
    import time

    from gyre.real.engine_torch import TorchEngine, TorchEngineConfig

    pt = ProxyThread(ChatTokenizer(engine_model).tok)
    eloop = asyncio.new_event_loop()  # the engine on a loop of its own, as an engine actor is its own process
    threading.Thread(target=eloop.run_forever, daemon=True).start()

    async def make():
        e = TorchEngine(engine_model, TorchEngineConfig(max_batch=8))
        await e.wake(None, 0)
        return e

    eng = asyncio.run_coroutine_threadsafe(make(), eloop).result(60)
    rounds, answers = [], {}

    async def gen(seq, r, seed):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            eng.generate(seq, r["ids"], r["max_new"], [0], seed), eloop))

    async def relay(key, cwd):  # the backend's part, as gyre.real.tasks.harness does it: a round at a time
        argv = [sys.executable, str(OWN), "--turns", "2", "--subagent-at", "1", "--parallel", "2"]
        ev = await pt.proxy.launch(key, argv, {"GYRE_TASK": "Write add_one(x)."}, str(cwd), 30.0)
        while ev["kind"] in ("request", "requests"):
            reqs = ev["requests"] if ev["kind"] == "requests" else [ev]
            outs = await asyncio.gather(*[gen(f"{key}.{k}", r, r["n"]) for k, r in enumerate(reqs)])
            rounds.append([r["n"] for r in reqs])
            for r, o in zip(reqs, outs):
                answers[r["n"]] = (r, o)
            ev = await pt.proxy.respond_all(key, [(r["n"], o["tokens"], o["logprobs"]) for r, o in zip(reqs, outs)])
        return ev

    try:
        asyncio.run_coroutine_threadsafe(eng.generate("warm", [1, 2, 3], 2, [0], 0), eloop).result(60)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), eloop).result(5)
        eng.get_profile()
        pt.proxy.open("e0", "tok-e0", 16, 8192)
        t0 = time.monotonic()
        end = pt.call(relay("e0", tmp_path / "e0"), timeout=60)
        wall = time.monotonic() - t0
        batches = [b for b, _, _ in asyncio.run_coroutine_threadsafe(_profile(eng), eloop).result(5)["decode"]]
    finally:
        pt.close()
        eloop.call_soon_threadsafe(eloop.stop)
    assert end["code"] == 0, (end, (tmp_path / "e0" / ".harness.stderr").read_text())
    roles = {n: r["role"] for n, (r, _) in answers.items()}
    pairs = [rd for rd in rounds if len(rd) == 2]
    assert [[roles[n] for n in rd] for rd in pairs] == [["sub-agent"] * 2, ["sub-agent-summary"] * 2], \
        f"rounds {rounds} of roles {roles}: the parallel calls were not served together"
    assert max(batches) == 2, f"the engine never decoded the two calls together: batches {batches}"
    recs = {n: TitoRecord(execution="e0", n=n, role=r["role"], input_ids=tuple(r["ids"]),
                          output_ids=tuple(o["tokens"]), logprobs=tuple(o["logprobs"]), version=0, received_s=0.0,
                          issued_s=0.0, done_s=0.0) for n, (r, o) in answers.items()}
    subs = [recs[n] for n in pairs[0]]
    for n in pairs[1]:
        own = [s for s in subs if recs[n].input_ids[:len(s.input_ids) + len(s.output_ids)] == s.input_ids + s.output_ids]
        assert len(own) == 1, f"summary call {n} does not continue exactly one sub-agent call's ids and answer"
    details = sorted(ChatTokenizer(engine_model).tok.decode(list(s.input_ids)).count("Detail 1 of 2") for s in subs)
    assert details == [0, 1], "the two sub-agents must have contexts of their own"
    calls = [json.loads(ln) for ln in (tmp_path / "e0" / "transcript.jsonl").read_text().splitlines()]
    assert all(c["status"] == 200 and c["ok"] for c in calls) and len(calls) == len(answers), calls
    assert wall < 30, wall


async def _profile(eng):
    return eng.get_profile()
