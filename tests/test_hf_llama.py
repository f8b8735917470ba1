"""gyre.real.nn.hf_llama: a Llama checkpoint directory (config.json + safetensors) read back as a TinyLlama, no
transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from gyre.real.nn.hf_llama import (
    hf_llama_config_dict,
    hf_llama_name,
    hf_llama_state,
    load_hf_llama,
    model_config_from_hf,
    tinyllama_name,
    tinyllama_state,
    write_hf_llama,
)
from gyre.real.nn.model import TinyLlamaConfig, TinyLlama

CFG = TinyLlamaConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, rope_theta=5e5,
                  norm_eps=1e-5)


def weights(cfg: TinyLlamaConfig, seed: int = 0) -> dict:
    return TinyLlama(cfg, np.random.default_rng(seed)).state_dict()


def assert_bitwise(a: dict, b: dict) -> None:
    assert list(a) == list(b), f"names differ: {sorted(set(a) ^ set(b))}"
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), f"{k} differs"


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shards", [1, 2])
def test_written_checkpoint_loads_back_bitwise(tmp_path, tied, shards):
    """Config and every tensor come back exactly, tied or untied head, one file or two shards."""
    cfg = TinyLlamaConfig(**{**CFG.__dict__, "tie_embeddings": tied})
    w = weights(cfg, seed=3)
    write_hf_llama(tmp_path, cfg, w, shards=shards)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) == shards, files
    if shards == 2:  # a real split: each shard holds part of the model
        from safetensors.torch import load_file

        sizes = [len(load_file(str(tmp_path / f))) for f in files]
        assert all(s > 0 for s in sizes) and sum(sizes) == len(w), sizes
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(hf_llama_state(w)), "index names every tensor"
    got_cfg, got = load_hf_llama(tmp_path)
    assert got_cfg == cfg
    assert_bitwise(got, w)
    m = TinyLlama(got_cfg, np.random.default_rng(99))
    m.load_state_dict(got)  # strict: exactly TinyLlama's parameters


def test_tied_checkpoint_with_an_lm_head_ignores_it(tmp_path):
    """A tied config with an lm_head.weight in the file (some exporters write it) loads the embedding as the head."""
    w = weights(CFG)
    write_hf_llama(tmp_path, CFG, {**w, "head.weight": torch.zeros_like(w["embed.weight"])})
    _, got = load_hf_llama(tmp_path)
    assert "head.weight" not in got
    assert_bitwise(got, w)


def test_bf16_checkpoint_keeps_its_dtype(tmp_path):
    w = weights(CFG)
    write_hf_llama(tmp_path, CFG, w, dtype="bfloat16")
    _, got = load_hf_llama(tmp_path)
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    assert torch.equal(got["embed.weight"], w["embed.weight"].to(torch.bfloat16))


def test_names_map_both_ways():
    w = weights(TinyLlamaConfig(tie_embeddings=False))
    hf = hf_llama_state(w)
    assert hf_llama_name("layers.1.mlp.w1.weight") == "model.layers.1.mlp.gate_proj.weight"
    assert tinyllama_name("model.layers.1.mlp.down_proj.weight") == "layers.1.mlp.w2.weight"
    assert list(tinyllama_state(hf)) == list(w)
    assert tinyllama_state(w) == w and hf_llama_state(hf) == hf  # already renamed: unchanged
    with pytest.raises(ValueError, match="bias"):
        tinyllama_name("model.layers.0.self_attn.q_proj.bias")


def test_engine_vllm_uses_the_one_mapping_and_writer():
    """engine_vllm renames weights with gyre.real.nn.hf_llama's mapping and has no model-directory writer of its own
    (it imports no vllm at module level)."""
    from gyre.real import engine_vllm

    assert engine_vllm.hf_llama_state is hf_llama_state, "engine_vllm has its own name mapping"
    assert not hasattr(engine_vllm, "save_hf_llama") and not hasattr(engine_vllm, "hf_llama_config"), \
        "engine_vllm writes model directories itself"


def test_transformers_5_rope_parameters_are_read():
    c = hf_llama_config_dict(CFG)
    del c["rope_theta"], c["rope_scaling"]
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    assert model_config_from_hf(c).rope_theta == 12345.0
    c.pop("tie_word_embeddings")  # LlamaConfig's default: untied
    assert model_config_from_hf(c).tie_embeddings is False


BAD = [
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling.rope_type = 'llama3'"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "rope_parameters.rope_type = 'yarn'"),
    ("attention_bias", True, "attention_bias = True"),
    ("mlp_bias", True, "mlp_bias = True"),
    ("model_type", "mistral", "model_type = 'mistral'"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("head_dim", 16, "head_dim = 16"),
    ("num_attention_heads", 5, "hidden_size = 32 is not a multiple of num_attention_heads = 5"),
    ("vocab_size", None, "vocab_size is missing"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_config_is_one_line_naming_file_and_field(tmp_path, field, value, message):
    write_hf_llama(tmp_path, CFG, weights(CFG))
    path = tmp_path / "config.json"
    c = json.loads(path.read_text())
    c[field] = value
    path.write_text(json.dumps(c))
    with pytest.raises(ValueError) as err:
        load_hf_llama(tmp_path)
    text = str(err.value)
    assert "\n" not in text and str(path) in text and message in text, text


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    from safetensors.torch import save_file

    untied = TinyLlamaConfig(**{**CFG.__dict__, "tie_embeddings": False})
    w = hf_llama_state(weights(untied))
    write_hf_llama(tmp_path, untied, w)
    save_file({k: v for k, v in w.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'lm_head.weight' is missing .*tie_word_embeddings = false") as err:
        load_hf_llama(tmp_path)
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)
    save_file({**w, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' has shape"):
        load_hf_llama(tmp_path)
    save_file({**w, "model.layers.2.input_layernorm.weight": torch.ones(32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.2.input_layernorm.weight' is beyond .*num_hidden_layers = 2"):
        load_hf_llama(tmp_path)
    save_file(w, str(tmp_path / "model.safetensors"))
    save_file({"model.norm.weight": torch.ones(32)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"'model.norm.weight' is in both extra.safetensors and model.safetensors"):
        load_hf_llama(tmp_path)


def test_toml_init_checkpoint_takes_the_model_and_refuses_a_different_one(tmp_path):
    """[pool] init_checkpoint: the model config comes from the checkpoint; a [pool.model] that differs is one line."""
    pytest.importorskip("ray")
    from gyre.real.pool import check_init_checkpoint
    from gyre.real.config import RealConfigError
    from gyre.real.config_file import load_config

    ck = write_hf_llama(tmp_path / "llama", CFG, weights(CFG))
    toml = tmp_path / "run.toml"
    toml.write_text(f'preset = "tiny-test"\n[pool]\ninit_checkpoint = "{ck}"\n[pool.model]\nn_layers = 2\n')
    cfg = load_config(toml)
    assert cfg.pool.model == CFG and cfg.pool.init_checkpoint == str(ck)
    check_init_checkpoint(cfg.pool)  # consistent: no error
    toml.write_text(f'[pool]\ninit_checkpoint = "{ck}"\n[pool.model]\nn_layers = 3\n')
    with pytest.raises(RealConfigError, match=r"run.toml: pool.model.n_layers = 3, the checkpoint has 2 ") as err:
        load_config(toml)
    assert "\n" not in str(err.value)
    toml.write_text(f'[pool]\ninit_checkpoint = "{tmp_path / "nowhere"}"\n')
    with pytest.raises(RealConfigError, match=r"run.toml: pool.init_checkpoint: .*nowhere: not a model directory"):
        load_config(toml)
    import dataclasses

    with pytest.raises(ValueError, match=r"PoolConfig.model differs from init_checkpoint .*: vocab_size = 256, the "
                                         r"checkpoint has 40"):
        check_init_checkpoint(dataclasses.replace(cfg.pool, model=TinyLlamaConfig()))


def test_trainer_resets_to_the_checkpoint(tmp_path):
    """A trainer worker (in process) publishes the checkpoint's weights as version 0, cast to fp32, at every reset."""
    pytest.importorskip("ray")
    from gyre.real.trainer import Trainer

    w = weights(CFG, seed=5)
    ck = write_hf_llama(tmp_path / "bf16", CFG, w, dtype="bfloat16")
    t = Trainer(CFG, init_checkpoint=str(ck))
    got = t.weights(0)
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], w[k].to(torch.bfloat16).float()) for k in w)
    with torch.no_grad():
        t.model.embed.weight.add_(1.0)
    assert t.reset(seed=1) == 0 and torch.equal(t.weights(0)["embed.weight"], got["embed.weight"])
    with pytest.raises(ValueError, match=r"init_checkpoint .*bf16: the trainer's model has n_layers = 1, the checkpoint has 2"):
        Trainer(TinyLlamaConfig(**{**CFG.__dict__, "n_layers": 1}), init_checkpoint=str(ck))
