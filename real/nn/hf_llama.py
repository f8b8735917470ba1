"""Hugging Face Llama checkpoints <-> gyre's TinyLlama: names, config.json and safetensors, without transformers.

What it models: a Llama-architecture model directory (config.json plus one or more *.safetensors files, e.g.
the folder vLLM serves) is the same network as a TinyLlama when its config asks only for what TinyLlama
computes: RMSNorm, RoPE without scaling, grouped-query attention, a SiLU-gated MLP, no biases, tied or
untied head. Then
- `model_config_from_hf(config_json)` is its TinyLlamaConfig (anything else is one ValueError naming the file
  and the field: a different model_type, rope_scaling, attention/mlp bias, an activation other than silu,
  an inconsistent head_dim, dropout);
- `load_hf_llama(path)` reads every *.safetensors file of the folder (sharded checkpoints too) into a
  state dict under TinyLlama names, in the stored dtype, bit for bit;
- `hf_llama_name` / `tinyllama_name` and `hf_llama_state` / `tinyllama_state` rename parameters both
  ways (same tensors, same layout: both rotate halves of each head, so q/k need no permutation);
- `hf_llama_config_dict(cfg)` / `write_hf_llama(path, cfg, weights)` write such a folder (config.json as
  transformers' LlamaConfig would, model.safetensors or N shards with a model.safetensors.index.json).

Both config.json spellings of RoPE are read: `rope_theta` (+ `rope_scaling`) of transformers < 5 and
`rope_parameters` ({"rope_type": "default", "rope_theta": ...}) of transformers 5.

Simplifications: `max_position_embeddings`, `torch_dtype`/`dtype`, token ids and `pretraining_tp` are not
part of TinyLlamaConfig (TinyLlama has no position limit; a loaded model takes the dtype it is built with); a
tied checkpoint's `lm_head.weight`, if present, is ignored (as transformers does), and
`rotary_emb.inv_freq` buffers of old checkpoints are skipped. safetensors and torch are imported lazily.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gyre.real.nn.model import TinyLlamaConfig

_LAYER_NAMES = {  # gyre.real.nn.model.Block -> transformers LlamaDecoderLayer
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "head.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FROM_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_FROM_TOP = {v: k for k, v in _TOP_NAMES.items()}


def _rename(name: str, top: dict, layer: re.Pattern, layers: dict, prefix: str) -> str | None:
    """`name` through a top-level table, or a layer's `<i>.<rest>` through the per-layer table; None if neither."""
    if name in top:
        return top[name]
    m = layer.fullmatch(name)
    return f"{prefix}{m.group(1)}.{layers[m.group(2)]}" if m and m.group(2) in layers else None


def hf_llama_name(name: str) -> str:
    """The Hugging Face Llama name of a TinyLlama parameter (same tensor, same layout: both rotate halves)."""
    out = _rename(name, _TOP_NAMES, _LAYER, _LAYER_NAMES, "model.layers.")
    if out is None:
        raise ValueError(f"hf_llama_name: {name!r} is not a gyre TinyLlama parameter")
    return out


def tinyllama_name(name: str) -> str:
    """The TinyLlama name of a Hugging Face Llama parameter (the inverse of hf_llama_name)."""
    out = _rename(name, _FROM_TOP, _HF_LAYER, _FROM_LAYER, "layers.")
    if out is None:
        raise ValueError(f"tinyllama_name: {name!r} is not a Hugging Face Llama parameter TinyLlama has")
    return out


def hf_llama_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A TinyLlama state dict under Hugging Face Llama names; a state already in HF names is returned as is."""
    if "embed.weight" not in state:
        return dict(state)
    return {hf_llama_name(k): v for k, v in state.items()}


def tinyllama_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face Llama state dict under TinyLlama names; a state already in TinyLlama names is returned as is."""
    if "model.embed_tokens.weight" not in state:
        return dict(state)
    return {tinyllama_name(k): v for k, v in state.items()}


# ---------------------------------------------------------------- config.json


def _rope_theta(cfg: dict, where: str) -> float:
    """RoPE base from either spelling; any scaling or partial rotary is refused."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    for field, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {field} = {value!r}: expected a table")  # noqa: TRY004 (one error type)
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{where}: {field}.rope_type = {kind!r}: TinyLlama computes RoPE without scaling")
        extra = sorted(set(value) - {"rope_type", "type", "rope_theta"})
        extra = [k for k in extra if not (k == "partial_rotary_factor" and value[k] in (1, 1.0, None))]
        if extra:
            raise ValueError(f"{where}: {field}.{extra[0]} = {value[extra[0]]!r}: TinyLlama computes plain RoPE")
    if "partial_rotary_factor" in cfg and cfg["partial_rotary_factor"] not in (1, 1.0, None):
        raise ValueError(f"{where}: partial_rotary_factor = {cfg['partial_rotary_factor']!r}: TinyLlama rotates "
                         f"every head dimension")
    theta = (params or {}).get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        theta = (scaling or {}).get("rope_theta", 10000.0)
    return float(theta)


def model_config_from_hf(config_json: dict, *, source: str = "config.json") -> TinyLlamaConfig:
    """The TinyLlamaConfig of a Hugging Face Llama config.json (a dict); `source` names the file in errors."""
    c = config_json

    def need(field: str):
        if c.get(field) is None:
            raise ValueError(f"{source}: {field} is missing")
        return c[field]

    def want(field: str, allowed: tuple, why: str, default=None):
        v = c.get(field, default)
        if v not in allowed:
            raise ValueError(f"{source}: {field} = {v!r}: {why}")

    want("model_type", ("llama",), "only Llama checkpoints are TinyLlama's architecture")
    archs = c.get("architectures") or ["LlamaForCausalLM"]
    if archs != ["LlamaForCausalLM"]:
        raise ValueError(f"{source}: architectures = {archs!r}: only LlamaForCausalLM is TinyLlama's architecture")
    want("hidden_act", ("silu",), "TinyLlama's MLP is SiLU-gated (SwiGLU)", "silu")
    want("attention_bias", (False, None), "TinyLlama's projections have no bias", False)
    want("mlp_bias", (False, None), "TinyLlama's projections have no bias", False)
    want("attention_dropout", (0, 0.0, None), "TinyLlama has no dropout", 0.0)
    want("tie_word_embeddings", (True, False), "expected true or false", False)  # LlamaConfig's default
    dim, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    if dim % heads:
        raise ValueError(f"{source}: hidden_size = {dim} is not a multiple of num_attention_heads = {heads}")
    if c.get("head_dim") is not None and int(c["head_dim"]) != dim // heads:
        raise ValueError(f"{source}: head_dim = {c['head_dim']} but hidden_size / num_attention_heads = "
                         f"{dim // heads}: TinyLlama's heads split hidden_size")
    try:
        return TinyLlamaConfig(
            vocab_size=int(need("vocab_size")), dim=dim, n_layers=int(need("num_hidden_layers")), n_heads=heads,
            n_kv_heads=kv_heads, ffn_dim=int(need("intermediate_size")), rope_theta=_rope_theta(c, source),
            norm_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def read_model_config(path: str | Path) -> TinyLlamaConfig:
    """model_config_from_hf of `path`/config.json (a model directory) or of `path` (a config.json file)."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    try:
        data = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{f}: cannot read the model config ({exc})") from None
    return model_config_from_hf(data, source=str(f))


def hf_llama_config_dict(cfg: TinyLlamaConfig, *, max_position_embeddings: int = 4096, dtype: str = "float32") -> dict:
    """config.json of the Llama model computing what TinyLlama(cfg) computes (as transformers' LlamaConfig writes)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": max_position_embeddings,
        "initializer_range": cfg.init_std, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "torch_dtype": dtype, "use_cache": True,
    }


# ---------------------------------------------------------------- weights


def _safetensors():
    try:
        from safetensors.torch import load_file, save_file
    except ImportError as exc:  # pragma: no cover - the `real` extra pins it
        raise ImportError("reading Hugging Face checkpoints needs safetensors (pip install 'gyre[real]')") from exc
    return load_file, save_file


def tinyllama_shapes(cfg: TinyLlamaConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of TinyLlama(cfg)'s state dict, in its order (no weights are built)."""
    hd, out = cfg.head_dim, {"embed.weight": (cfg.vocab_size, cfg.dim)}
    for i in range(cfg.n_layers):
        out.update({
            f"layers.{i}.attn_norm.weight": (cfg.dim,), f"layers.{i}.attn.wq.weight": (cfg.n_heads * hd, cfg.dim),
            f"layers.{i}.attn.wk.weight": (cfg.n_kv_heads * hd, cfg.dim),
            f"layers.{i}.attn.wv.weight": (cfg.n_kv_heads * hd, cfg.dim),
            f"layers.{i}.attn.wo.weight": (cfg.dim, cfg.n_heads * hd), f"layers.{i}.mlp_norm.weight": (cfg.dim,),
            f"layers.{i}.mlp.w1.weight": (cfg.ffn_dim, cfg.dim), f"layers.{i}.mlp.w3.weight": (cfg.ffn_dim, cfg.dim),
            f"layers.{i}.mlp.w2.weight": (cfg.dim, cfg.ffn_dim),
        })
    out["norm.weight"] = (cfg.dim,)
    if not cfg.tie_embeddings:
        out["head.weight"] = (cfg.vocab_size, cfg.dim)
    return out


def write_hf_llama(path: str | Path, cfg: TinyLlamaConfig, weights: Mapping[str, Any], *, shards: int = 1,
                   max_position_embeddings: int = 4096, dtype: str = "float32") -> Path:
    """Write a Llama model directory for TinyLlama(cfg) with `weights` (TinyLlama or HF names): config.json and
    model.safetensors, or `shards` files model-0000i-of-0000n.safetensors plus model.safetensors.index.json."""
    import torch

    _, save_file = _safetensors()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(
        hf_llama_config_dict(cfg, max_position_embeddings=max_position_embeddings, dtype=dtype), indent=2) + "\n")
    state = {k: v.detach().to("cpu", getattr(torch, dtype)).contiguous() for k, v in hf_llama_state(weights).items()}
    names = list(state)
    if shards <= 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    index = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, str(path / fname), metadata={"format": "pt"})
        index.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=2) + "\n")
    return path


def _index(p: Path, cfg: TinyLlamaConfig) -> dict[str, tuple[str, str]]:
    """TinyLlama name -> (HF name, file) of every tensor the model needs, checked from the files' headers only
    (names and shapes; no tensor data is read)."""
    from safetensors import safe_open

    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{p}: no *.safetensors file")
    shapes: dict[str, tuple] = {}
    where: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if k in where:
                    raise ValueError(f"{p}: tensor {k!r} is in both {where[k]} and {f.name}")
                shapes[k], where[k] = tuple(h.get_slice(k).get_shape()), f.name
    index = {}
    for k in shapes:
        if k.endswith("rotary_emb.inv_freq") or (k == "lm_head.weight" and cfg.tie_embeddings):
            continue  # recomputed / tied to the embedding
        try:
            index[tinyllama_name(k)] = (k, where[k])
        except ValueError:
            raise ValueError(f"{p}/{where[k]}: tensor {k!r} is not a parameter of a Llama model TinyLlama "
                             f"computes") from None
    want = tinyllama_shapes(cfg)
    for k, shape in want.items():
        if k not in index:
            raise ValueError(f"{p}: tensor {hf_llama_name(k)!r} is missing (config.json: "
                             f"tie_word_embeddings = {str(cfg.tie_embeddings).lower()})")
        name, fname = index[k]
        if shapes[name] != shape:
            raise ValueError(f"{p}/{fname}: tensor {name!r} has shape {list(shapes[name])}, config.json implies "
                             f"{list(shape)}")
    extra = sorted(set(index) - set(want))
    if extra:
        raise ValueError(f"{p}: tensor {index[extra[0]][0]!r} is beyond config.json's "
                         f"num_hidden_layers = {cfg.n_layers}")
    return {k: index[k] for k in want}


def check_hf_llama(path: str | Path) -> TinyLlamaConfig:
    """The TinyLlamaConfig of a Llama model directory whose tensors load_hf_llama would accept, from config.json and
    the safetensors headers only (cheap: a driver validates a checkpoint its workers will load)."""
    _safetensors()
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{p}: not a model directory (config.json + *.safetensors)")
    cfg = read_model_config(p)
    _index(p, cfg)
    return cfg


def load_hf_llama(path: str | Path) -> tuple[TinyLlamaConfig, dict]:
    """(TinyLlamaConfig, state dict under TinyLlama names) of a Llama model directory: config.json plus every
    *.safetensors file in it (sharded checkpoints too). Tensors keep their stored dtype and bits. A missing,
    duplicated, unexpected or misshapen tensor is one ValueError naming the folder (or file) and the tensor."""
    from safetensors import safe_open

    cfg = check_hf_llama(path)
    p = Path(path)
    index = _index(p, cfg)
    state = {}
    for fname in sorted({f for _, f in index.values()}):
        with safe_open(str(p / fname), framework="pt") as h:
            for k, (name, f) in index.items():
                if f == fname:
                    state[k] = h.get_tensor(name)
    return cfg, {k: state[k] for k in index}


def config_mismatch(given: TinyLlamaConfig, checkpoint: TinyLlamaConfig) -> str | None:
    """The first field (init_std aside: loaded weights make it moot) where `given` differs from a checkpoint's
    TinyLlamaConfig, as 'field = given, the checkpoint has value'; None when they agree."""
    for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps",
              "tie_embeddings"):
        a, b = getattr(given, f), getattr(checkpoint, f)
        if a != b:
            return f"{f} = {a!r}, the checkpoint has {b!r}"
    return None
