"""calibrate-engine finds a run's model and GPU as users have them: ids with release tags, config.json, flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.config import ConfigError
from gyre.presets import MODELS
from gyre.sim.cli.app import app
from gyre.sim.vllm_check.run_presets import model_from_hf_config, preset_from_id
from gyre.sim.vllm_check.serving_run import RunError, read_run
from tests.test_calibrate_engine import META, write_run

runner = CliRunner()

# the published config.json fields of two models (Hugging Face hub), as the files give them
LLAMA_31_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
               "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
               "tie_word_embeddings": False, "model_type": "llama"}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_attention_heads": 32, "num_hidden_layers": 48,
                 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False}


@pytest.mark.parametrize("model_id, preset, width", [
    ("Qwen/Qwen3-30B-A3B-Instruct-2507", "moe-30b-a3b", 2.0),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b", 2.0),
    ("/models/Qwen3-32B-FP8", "qwen3-32b", 1.0),
    ("Qwen/Qwen3-30B-A3B-GPTQ-Int4", "moe-30b-a3b", 0.5),
    ("Qwen/Qwen2.5-7B-Instruct", "dense-7b", 2.0),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b", 2.0),
])
def test_release_tags_resolve_to_the_architecture(model_id, preset, width):
    """An id with release tags after a known architecture resolves to its preset; a quantized one keeps its width."""
    m = preset_from_id(model_id)
    base = MODELS[preset]
    assert (m.layers, m.total_params_b, m.experts) == (base.layers, base.total_params_b, base.experts), m
    assert m.infer_bytes_per_param == width, m


def test_an_unknown_architecture_is_not_guessed():
    """Stripping tags never reaches a different architecture: Qwen3-14B-Instruct is not Qwen3-32B or anything else."""
    for bad in ("Qwen/Qwen3-14B-Instruct", "acme/Foo-7B-2507", "Instruct"):
        with pytest.raises(ConfigError, match="unknown model"):
            preset_from_id(bad)


def test_parameter_counts_from_config_json():
    """Counts from config.json fields match the models' published totals (Llama-3.1-8B 8.03B; Qwen3-30B-A3B
    30.5B total, 3.3B active) computed by hand: per layer q/o 2 d (H d_h), k/v 2 d (H_kv d_h), MLP 3 d I."""
    d, hd = 4096, 128
    llama = 32 * (2 * d * 32 * hd + 2 * d * 8 * hd + 3 * d * 14336) + 2 * 128256 * d
    m = model_from_hf_config(LLAMA_31_8B, "config.json", "meta-llama/Llama-3.1-8B")
    assert m.total_params_b * 1e9 == pytest.approx(llama) and abs(m.total_params_b - 8.03) < 0.01, m
    assert (m.layers, m.q_heads, m.kv_heads, m.head_dim, m.hidden, m.vocab) == (32, 32, 8, 128, 4096, 128256), m
    q = model_from_hf_config(QWEN3_30B_A3B, "config.json")
    attn = 2 * 2048 * 32 * 128 + 2 * 2048 * 4 * 128
    expert = 3 * 2048 * 768
    emb = 2 * 151936 * 2048
    assert q.total_params_b * 1e9 == pytest.approx(48 * (attn + 128 * expert + 2048 * 128) + emb), q
    assert q.active_params_b * 1e9 == pytest.approx(48 * (attn + 8 * expert + 2048 * 128) + emb), q
    assert abs(q.total_params_b - 30.5) < 0.1 and abs(q.active_params_b - 3.3) < 0.1, q
    assert (q.experts, q.top_k) == (128, 8), q


def _cli(run: Path, *flags: str):
    r = runner.invoke(app, ["calibrate-engine", str(run), "--engine", str(run.parent / "e.json"), *flags])
    return r, " ".join(r.output.split())


@pytest.fixture
def applied(tmp_path):
    (tmp_path / "e.json").write_text(json.dumps({"gyre_engine": 1, "coeffs": {"eff_bw": 0.7}}))
    return tmp_path


def _meta(run: Path, **changes) -> None:
    m = json.loads((run / "meta.json").read_text())
    for k, v in changes.items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    m["engine_kwargs"].pop("model", None)
    (run / "meta.json").write_text(json.dumps(m))


def test_model_from_flag_or_config_json(applied):
    """Without a model in meta.json: an error naming the field and the three ways; then --model, a config.json
    beside the run and --model-config each make it run."""
    run = write_run(applied / "run", n=8)
    _meta(run, model=None)
    r, out = _cli(run)
    assert r.exit_code == 2 and "field 'model' is missing" in out, out
    assert "--model NAME" in out and "--model-config" in out and "config.json beside the run" in out, out
    assert r.output.strip().count("error:") == 1 and "Traceback" not in r.output, r.output
    r, out = _cli(run, "--model", "llama-3.1-8b")
    assert r.exit_code == 0, out
    cfg = applied / "llama.json"
    cfg.write_text(json.dumps(LLAMA_31_8B))
    r, out = _cli(run, "--model-config", str(cfg))
    assert r.exit_code == 0, out
    (run / "config.json").write_text(json.dumps(LLAMA_31_8B))
    assert read_run(run).model_cfg.layers == 32


def test_not_a_causal_lm_config(applied):
    """A --model-config whose architectures name no *ForCausalLM class is one line naming the field, exit 2."""
    run = write_run(applied / "run", n=6)
    cfg = applied / "bert.json"
    cfg.write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 768}))
    r, out = _cli(run, "--model-config", str(cfg))
    assert r.exit_code == 2 and "bert.json: field 'architectures'" in out and "not a causal-LM config" in out, out
    cfg.write_text(json.dumps({**LLAMA_31_8B, "num_hidden_layers": None}))
    r, out = _cli(run, "--model-config", str(cfg))
    assert r.exit_code == 2 and "field 'num_hidden_layers' is missing" in out, out


def test_gpu_from_device_name_flag_or_folder(applied):
    """The GPU comes from meta.json's device name (vLLM's), else --gpu, else the folder name; without any, one
    line names the field and the three ways; an unknown --gpu lists the presets."""
    run = write_run(applied / "myrun", n=6)
    _meta(run, hardware={"device_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition"})
    assert read_run(run).gpu_cfg.name == "rtxpro6000"
    _meta(run, hardware=None)
    r, out = _cli(run)
    assert r.exit_code == 2 and "field 'hardware.device_name' is missing" in out, out
    assert "--gpu NAME" in out and "<gpu>_<model>" in out, out
    r, out = _cli(run, "--gpu", "rtx4090")
    assert r.exit_code == 0, out
    r, out = _cli(run, "--gpu", "A100-ish")
    assert r.exit_code == 2 and "--gpu: unknown GPU 'A100-ish'; known: " in out and "h200" in out, out
    named = run.rename(applied / "RTX4090_whatever")
    assert read_run(named).gpu_cfg.name == "rtx4090"


def test_the_issue_run_layout_resolves(tmp_path):
    """The held-out MoE run's meta.json as it comes (an -Instruct-2507 id, vLLM's device name, DP 2 with expert
    parallel, in a folder named for nothing) reads without flags."""
    meta = json.loads(json.dumps(META))
    write_run(tmp_path / "x", n=6, meta=meta)
    meta.update(model="Qwen/Qwen3-30B-A3B-Instruct-2507",
                hardware={"device_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition"})
    meta["engine_kwargs"].update(data_parallel_size=2, enable_expert_parallel=True)
    (tmp_path / "x" / "meta.json").write_text(json.dumps(meta))
    run = read_run(tmp_path / "x")
    assert (run.model_cfg.name, run.gpu_cfg.name) == ("moe-30b-a3b", "rtxpro6000"), run
    assert run.engine.expert_parallel and run.engine.data_parallel == 2, run.engine
    meta["engine_kwargs"]["enable_expert_parallel"] = "yes"
    (tmp_path / "x" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RunError, match="'enable_expert_parallel' must be true or false"):
        read_run(tmp_path / "x")


# LLMServingSim's cluster config.json (bench/examples/<gpu>/<model>/config.json), one instance of two, trimmed
CLUSTER = {"num_nodes": 1, "nodes": [{"num_instances": 2, "instances": [
    {"model_name": "Qwen/Qwen3-30B-A3B-Instruct-2507", "hardware": "RTXPRO6000", "num_npus": 1, "tp_size": 1,
     "ep_size": 2, "dp_group": "A", "pd_type": None}]}]}


def test_the_public_run_layout_resolves(applied):
    """A run laid out as LLMServingSim publishes it (`<model>/vllm/`, vLLM 0.28 engine_kwargs with a null
    max_model_len, the cluster config.json one level up) reads without flags; with an id no preset knows, that
    cluster config.json beside the run is one line saying it is not a causal-LM config, exit 2."""
    run = write_run(applied / "Qwen3-30B-A3B-Instruct-2507" / "vllm", n=6)
    (run.parent / "config.json").write_text(json.dumps(CLUSTER))
    (run.parent / "e.json").write_text((applied / "e.json").read_text())
    kw = {**META["engine_kwargs"], "data_parallel_size": 2, "enable_expert_parallel": True, "max_model_len": None,
          "load_format": "auto", "skip_tokenizer_init": False, "enforce_eager": False}
    _meta(run, model="Qwen/Qwen3-30B-A3B-Instruct-2507", engine_kwargs=kw, vllm_version="0.28.0",
          hardware={"device_count": 2, "device_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition"})
    got = read_run(run)
    assert (got.model_cfg.name, got.gpu_cfg.name, got.engine.data_parallel) == ("moe-30b-a3b", "rtxpro6000", 2), got
    r, out = _cli(run)
    assert r.exit_code == 0, out
    (run / "config.json").write_text(json.dumps(CLUSTER))
    _meta(run, model="deepseek-ai/DeepSeek-V3.2-Exp-16L64E")
    r, out = _cli(run)
    assert r.exit_code == 2 and "vllm/config.json: field 'architectures'" in out, out
    assert "not a causal-LM config" in out and "--model NAME" in out and "Traceback" not in r.output, out
