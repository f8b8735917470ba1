"""The real backend trains transformers models from local folders (tiny random Qwen3 and Llama) under every policy."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from test_real_cluster import check_run  # noqa: E402
from test_real_dist import ProbeAfter  # noqa: E402

from gyre.real.nn.hf_folder import write_tiny_model  # noqa: E402
from gyre.policies import make_policy  # noqa: E402
from gyre.real import task as T  # noqa: E402
from gyre.real.config import preset_tiny_test  # noqa: E402
from gyre.real.engine_torch import TorchEngineConfig  # noqa: E402
from gyre.real.pool import ActorPool, PoolConfig  # noqa: E402
from gyre.real.runner import run_real  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")
BASE = preset_tiny_test()


def hf_run(model_dir: str) -> object:
    """tiny-test (4 logical GPUs), trainer and torch engines built from `model_dir`: the trainer computes in bf16
    (autocast, fp32 master weights) with checkpointed layers and micro-batches of 64 tokens; engines serve bf16.
    Every run shares the tiny-test pool of the other real tests (only model and settings differ: set_model)."""
    tc = dataclasses.replace(BASE.pool.trainer_config, max_pack_tokens=1024, dtype="bfloat16",
                             grad_checkpointing=True, micro_batch_tokens=64)
    pool = dataclasses.replace(BASE.pool, model_dir=model_dir, trainer_config=tc,
                               engine_config=TorchEngineConfig(dtype="bfloat16"))
    return dataclasses.replace(BASE, pool=pool)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", vocab_size=T.VOCAB_SIZE, seed=2))


@pytest.mark.parametrize("policy", ["colocate", "async", "elastic"])
def test_every_policy_trains_a_tiny_qwen3(local_ray, qwen3, policy):
    """A tiny random Qwen3 trains under colocate, async and elastic (see hf_run): nothing lost, every step has a
    gradient, the first step is on-policy to bf16 precision."""
    cfg = hf_run(qwen3)
    pool = ActorPool.shared(cfg.pool)
    r = run_real(cfg, policy, pool=pool)
    check_run(r, cfg.steps)
    notes = [x[3] for x in r.log if x[0] == "note" and x[2] == "train"]
    assert all(n["grad_norm"] > 0 and n["tokens"] > 64 for n in notes), f"{policy}: {notes}"
    # version 0 is the folder's weights, served in bf16; the trainer computes in bf16 from fp32: agreement to bf16
    assert notes[0]["logp_mismatch"] < 0.05, f"{policy}: first step off-policy by {notes[0]['logp_mismatch']}"
    w = r.cluster.trainer_weights()
    assert "model.layers.0.self_attn.q_norm.weight" in w and "lm_head.weight" not in w, sorted(w)[:4]


def test_llama_weights_reach_every_engine_bitwise_in_the_serving_dtype(local_ray, tmp_path):
    """A tiny Llama served in bf16: after elastic steps and a collective (gloo) sync, each engine holds the
    trainer's published weights bit for bit, in bf16, untied head included."""
    llama = str(write_tiny_model(tmp_path / "llama", "llama", vocab_size=T.VOCAB_SIZE, seed=3))
    cfg = hf_run(llama)
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, weight_sync="collective"))
    probe = ProbeAfter(make_policy("elastic"))
    pool = ActorPool.shared(cfg.pool)
    assert pool.cfg.model_dir == llama
    r = run_real(cfg, probe, pool=pool)
    check_run(r, cfg.steps)
    engines, trainer = probe.seen
    assert engines and {t.dtype for t in trainer.values()} == {torch.bfloat16}, "published in the serving dtype"
    assert "lm_head.weight" in trainer, "an untied head is served"
    for i, w in enumerate(engines):
        assert set(w) == set(trainer), f"engine {i} serves other tensors: {sorted(set(w) ^ set(trainer))[:4]}"
        bad = [k for k in trainer if w[k].dtype != torch.bfloat16 or not torch.equal(w[k], trainer[k])]
        assert not bad, f"engine {i}: {len(bad)} tensors differ from the trainer's, e.g. {bad[:3]}"


def test_served_model_must_be_the_trained_one(local_ray, qwen3, tmp_path):
    """vLLM serving a Llama while the trainer trains a Qwen3: refused, naming both, before any actor starts."""
    llama = str(write_tiny_model(tmp_path / "llama", "llama", vocab_size=T.VOCAB_SIZE))
    actors = len(ray.util.list_named_actors(all_namespaces=True)) if hasattr(ray.util, "list_named_actors") else 0
    bad = PoolConfig(n_gpus=2, engine="vllm", model_dir=qwen3, vllm_model=llama)
    with pytest.raises(ValueError) as err:
        ActorPool(bad)
    msg = str(err.value)
    assert "architecture: trained 'Qwen3ForCausalLM', served 'LlamaForCausalLM'" in msg and llama in msg, msg
    assert "\n" not in msg, msg
    if hasattr(ray.util, "list_named_actors"):
        assert len(ray.util.list_named_actors(all_namespaces=True)) == actors, "an actor was started"
    other = str(write_tiny_model(tmp_path / "q3b", "qwen3", vocab_size=T.VOCAB_SIZE, num_layers=3))
    with pytest.raises(ValueError, match=r"num_layers: trained 2, served 3"):
        ActorPool(dataclasses.replace(bad, vllm_model=other))


ROOT = Path(__file__).parents[1]


def test_tiny_qwen3_config_runs_as_a_new_user_runs_it(local_ray, tmp_path, monkeypatch):
    """`gyre-real run --config configs/tiny_qwen3_cpu.toml --policy elastic`: the first run writes the tiny Qwen3
    folder (no download) where the config says, trains it and writes the outputs."""
    from typer.testing import CliRunner

    from gyre.bridge.cli import app

    monkeypatch.chdir(tmp_path)  # model_dir is relative to where the command runs
    toml = tmp_path / "tiny.toml"  # the file as shipped, with a smaller batch (the suite's budget)
    toml.write_text((ROOT / "configs" / "tiny_qwen3_cpu.toml").read_text() + "\n[cluster]\ngroups_per_step = 2\n"
                    "group_size = 4\n")
    res = CliRunner().invoke(app, ["run", "--config", str(toml), "--policy", "elastic", "--steps", "1",
                                   "--out", "out/run"])
    assert res.exit_code == 0, f"run failed: {res.output}"
    made = tmp_path / "out" / "models" / "tiny-qwen3"
    cfg = __import__("json").loads((made / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["vocab_size"] == T.VOCAB_SIZE, cfg
    assert (tmp_path / "out" / "run" / "summary.csv").exists(), res.output


def test_gpu_example_config_runs_on_cpu_at_a_tiny_size(local_ray, tmp_path):
    """configs/real_gpu_example.toml with a tiny Qwen2 in place of Qwen2.5-1.5B: served = trained passes the
    check as written (vLLM, collective sync); with CPU stand-ins for what needs CUDA or vLLM, it trains."""
    from gyre.real.collective import CollectiveConfig
    from gyre.real.config_file import load_config
    from gyre.real.pool import check_models

    cfg = load_config(ROOT / "configs" / "real_gpu_example.toml")
    assert cfg.pool.engine == "vllm" and not cfg.pool.vllm_model, "vLLM serves the trained folder"
    tiny = str(write_tiny_model(tmp_path / "qwen2", "qwen2", vocab_size=T.VOCAB_SIZE))
    cpu_tc = dataclasses.replace(cfg.pool.trainer_config, device="cpu", attention="sdpa", max_pack_tokens=1024,
                                 micro_batch_tokens=256, lr=1e-4)
    pool = dataclasses.replace(cfg.pool, model_dir=tiny, trainer_config=cpu_tc, collective=CollectiveConfig())
    check_models(pool)  # the vLLM pool as configured: no error
    pool = dataclasses.replace(pool, engine="torch", address=None, n_gpus=4, gpus_per_engine=1, vllm_args=(),
                               engine_config=TorchEngineConfig(dtype="bfloat16"))  # the other tests' pool shape
    run = dataclasses.replace(cfg, pool=pool, steps=1, cluster=dataclasses.replace(
        cfg.cluster, groups_per_step=2, group_size=4, min_train_gpus=1, checkpoint=None, max_wall_s=300,
        kv_capacity=4096, task=BASE.cluster.task))
    r = run_real(run, "colocate", pool=ActorPool.shared(run.pool))
    check_run(r, 1)
    from gyre.real.nn.hf_causal import build_model

    total = sum(p.numel() for p in build_model(tiny).parameters())
    steps = [x[3] for x in r.log if x[0] == "note" and x[2] == "train"]
    # FSDP2 (sharding = "fsdp" as written) over colocate's 4 GPUs: rank 0 holds ~1/4 (rows cut as torch.chunk)
    assert all(s["ranks"] == 4 and s["local_params"] <= 0.3 * total for s in steps), \
        f"not sharded 4 ways: {[(s['ranks'], s['local_params'], total) for s in steps]}"


def test_bad_model_folder_exits_2_before_anything_starts(tmp_path, qwen3):
    """A model_dir without config.json, or a served model that is not the trained one: one line, exit 2."""
    import shutil

    from typer.testing import CliRunner

    from gyre.bridge.cli import app

    bad = tmp_path / "noconfig"
    shutil.copytree(qwen3, bad)
    (bad / "config.json").unlink()
    llama = write_tiny_model(tmp_path / "llama", "llama", vocab_size=T.VOCAB_SIZE)
    for toml, says in ((f'[pool]\nmodel_dir = "{bad}"\n', f"{bad}/config.json: missing"),
                       (f'[pool]\nmodel_dir = "{qwen3}"\nengine = "vllm"\nvllm_model = "{llama}"\n',
                        "architecture: trained 'Qwen3ForCausalLM', served 'LlamaForCausalLM'"),
                       ('[pool.trainer_config]\ndtype = "float16"\n', "TrainerConfig.dtype = 'float16'")):
        p = tmp_path / "run.toml"
        p.write_text(toml)
        res = CliRunner().invoke(app, ["run", "--config", str(p), "--policy", "elastic", "--out", str(tmp_path)])
        assert res.exit_code == 2 and says in res.output, res.output
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output
