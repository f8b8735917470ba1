"""Which model and GPU a real vLLM run used: from its meta.json, a Hugging Face config.json, or flags.

Model, first match wins:
1. `--model-config FILE`: a Hugging Face causal-LM `config.json`; the architecture's numbers are read
   from it (`model_from_hf_config`);
2. `--model NAME`: a preset key or alias (gyre.presets.find_model);
3. meta.json's `model` id, as a preset: exactly, or once trailing release tags are dropped
   (`Qwen/Qwen3-30B-A3B-Instruct-2507` -> `Qwen3-30B-A3B`: `-Instruct`, `-Chat`, `-Base`, `-FP8`,
   `-AWQ`, `-GPTQ-Int4`, dates such as `-2507` or `-20240307`, versions such as `-v0.3`): tags name a
   fine-tune or a quantized copy of the same architecture. A quantized id keeps its weight width
   (`-FP8`, `-Int8`, `-W8A8`: 1 byte a weight; `-AWQ`, `-Int4`, `-W4A16`: 0.5), the rest bf16;
4. a `config.json` beside the run's files.

GPU, first match wins: `--gpu NAME`, meta.json's `hardware.device_name` (CUDA's device name, as vLLM
logs it), the run folder's name before its first `_` (`<gpu>_<model>/`). A flag wins over the file: a
user who names the model or the GPU means it.

Parameter counts from a config.json (the decoder of Llama, Qwen2/3, Mistral, Mixtral, Qwen2/3-MoE and
DeepSeek-V2/V3 configs): per layer attention q, k, v, o projections (MLA: the low-rank q and kv
projections), a gated MLP of 3 x hidden x intermediate (a dense layer), or E routed experts of
3 x hidden x moe_intermediate plus shared experts and the router (an MoE layer); the input embedding
and, untied, the LM head (vocab x hidden each). Norms and biases (under 0.1% of the weights) are left
out. Active parameters count k routed experts instead of E.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from gyre.config import ConfigError
from gyre.datasheets import GpuConfig, ModelConfig
from gyre.presets import find_gpu, find_model

WAYS_MODEL = "give --model NAME (a preset), --model-config config.json, or put the model's config.json beside the run"
WAYS_GPU = ("give --gpu NAME (a preset), log hardware.device_name in meta.json, or name the folder <gpu>_<model>")

# a release tag after the architecture's name (case-insensitive, one dash-separated part)
_TAG = re.compile(r"^(instruct|chat|base|it|hf|thinking|reasoning|fp8|fp16|bf16|awq|gptq|int4|int8|w4a16|w8a8|"
                  r"w8a16|dynamic|marlin|gguf|\d+bit|\d{4}|\d{6}|\d{8}|v\d+(\.\d+)*)$", re.I)
_BYTES = {"fp8": 1.0, "int8": 1.0, "w8a8": 1.0, "w8a16": 1.0, "8bit": 1.0,
          "awq": 0.5, "int4": 0.5, "w4a16": 0.5, "4bit": 0.5}


def preset_from_id(model_id: str) -> ModelConfig:
    """The preset a Hugging Face id names, exactly or once release tags are dropped; ConfigError otherwise."""
    try:
        return find_model(model_id)
    except ConfigError as first:
        parts = model_id.rsplit("/", 1)[-1].split("-")
        tags: list[str] = []
        while len(parts) > 1 and _TAG.match(parts[-1]):
            tags.append(parts.pop().lower())
            try:
                m = find_model("-".join(parts))
            except ConfigError:
                continue
            quant = next((t for t in tags if t in _BYTES), None)
            return m if quant is None else replace(m, name=f"{m.name}-{quant}", infer_bytes_per_param=_BYTES[quant])
        raise first from None


def _int(cfg: dict, where: str, *keys: str, default: int | None = None) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    if default is not None:
        return default
    raise ConfigError(f"{where}: field {keys[0]!r} is missing or not a positive integer (a Hugging Face "
                      "causal-LM config.json has it)")


def model_from_hf_config(cfg: Any, where: str, name: str | None = None) -> ModelConfig:
    """A ModelConfig from a Hugging Face causal-LM config.json's fields (see the module docstring)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object (a Hugging Face config.json)")
    if isinstance(cfg.get("text_config"), dict):  # a multimodal wrapper: the language model's config
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    arch = cfg.get("architectures")
    if not (isinstance(arch, list) and any(isinstance(a, str) and a.endswith("ForCausalLM") for a in arch)):
        raise ConfigError(f"{where}: field 'architectures' names no *ForCausalLM class ({arch!r}): not a "
                          f"causal-LM config; {WAYS_MODEL}")
    layers = _int(cfg, where, "num_hidden_layers")
    hidden = _int(cfg, where, "hidden_size")
    heads = _int(cfg, where, "num_attention_heads")
    kv_heads = _int(cfg, where, "num_key_value_heads", default=heads)
    head_dim = _int(cfg, where, "head_dim", default=hidden // heads)
    vocab = _int(cfg, where, "vocab_size")
    tied = bool(cfg.get("tie_word_embeddings", False))
    lora, rope = int(cfg.get("kv_lora_rank") or 0), int(cfg.get("qk_rope_head_dim") or 0)
    if lora:  # MLA (DeepSeek-V2/V3): low-rank q (optional) and kv projections, per-head nope + rope keys
        nope, v_dim = _int(cfg, where, "qk_nope_head_dim"), _int(cfg, where, "v_head_dim")
        q_lora = int(cfg.get("q_lora_rank") or 0)
        qk = heads * (nope + rope)
        q = hidden * q_lora + q_lora * qk if q_lora else hidden * qk
        attn = q + hidden * (lora + rope) + lora * heads * (nope + v_dim) + heads * v_dim * hidden
        head_dim = nope + rope
    else:
        attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    experts = _int(cfg, where, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    dense_mlp = 3 * hidden * _int(cfg, where, "intermediate_size")
    total = active = float(layers * attn)
    if experts:
        top_k = _int(cfg, where, "num_experts_per_tok")
        expert = 3 * hidden * _int(cfg, where, "moe_intermediate_size", "intermediate_size")
        shared = 3 * hidden * int(cfg.get("shared_expert_intermediate_size") or 0) \
            + int(cfg.get("n_shared_experts") or 0) * expert
        dense_layers = int(cfg.get("first_k_dense_replace") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        moe = [i >= dense_layers and i not in only and (i + 1) % step == 0 for i in range(layers)]
        n_moe = sum(moe)
        total += (layers - n_moe) * dense_mlp + n_moe * (experts * expert + shared + hidden * experts)
        active += (layers - n_moe) * dense_mlp + n_moe * (top_k * expert + shared + hidden * experts)
    else:
        top_k = 0
        total += layers * dense_mlp
        active += layers * dense_mlp
    emb = vocab * hidden * (1 if tied else 2)
    return ModelConfig(name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "config.json"),
                       total_params_b=(total + emb) / 1e9, active_params_b=(active + emb) / 1e9, layers=layers,
                       kv_heads=kv_heads, head_dim=head_dim, q_heads=heads, experts=experts, top_k=top_k,
                       kv_lora_rank=lora, rope_dim=rope if lora else 0, hidden=hidden, vocab=vocab,
                       tied_embeddings=tied)


def read_hf_config(path: Path, name: str | None = None) -> ModelConfig:
    """model_from_hf_config of a config.json file; ConfigError naming the file when it is unreadable."""
    import json

    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
    return model_from_hf_config(doc, str(path), name)


def resolve_model(meta_path: Path, meta_id: str | None, model: str | None = None,
                  model_config: Path | None = None) -> ModelConfig:
    """The run's model (see the module docstring); ConfigError naming the field and the ways to supply it."""
    if model_config is not None:
        return read_hf_config(model_config, meta_id)
    if model is not None:
        return find_model(model)
    beside = meta_path.parent / "config.json"
    if meta_id is None:
        if beside.exists():
            return read_hf_config(beside)
        raise ConfigError(f"{meta_path}: field 'model' is missing; {WAYS_MODEL}")
    try:
        return preset_from_id(meta_id)
    except ConfigError as exc:
        if beside.exists():
            return read_hf_config(beside, meta_id)
        raise ConfigError(f"{meta_path}: field 'model': {exc}; or {WAYS_MODEL}") from None


def resolve_gpu(meta_path: Path, device: str | None, gpu: str | None = None) -> GpuConfig:
    """The run's GPU (see the module docstring); ConfigError naming where the name came from."""
    if gpu is not None:
        where, name = "--gpu", gpu
    elif device is not None:
        where, name = f"{meta_path}: field 'hardware.device_name'", device
    else:
        folder = meta_path.parent.resolve().name
        if "_" not in folder:
            raise ConfigError(f"{meta_path}: field 'hardware.device_name' is missing and the folder name "
                              f"{folder!r} is not <gpu>_<model>; {WAYS_GPU}")
        where, name = f"{meta_path}: the folder name {folder!r}", folder.partition("_")[0]
    try:
        return find_gpu(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}; or {WAYS_GPU}") from None
