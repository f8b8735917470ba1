"""Model folders: any causal LM `transformers` knows, read from a local directory (config.json + safetensors).

What it models: the unit a real run trains and serves is a model folder as `save_pretrained` writes it (and
as a hub snapshot looks): config.json, one or more *.safetensors files (a sharded checkpoint has an
index), optionally the tokenizer's files. Nothing is downloaded: every read is `local_files_only`.

- `check_model_folder(path)` -> `ModelSpec`: the folder's architecture and shapes from config.json and the
  safetensors headers only (cheap: a driver validates what its workers will load). Bad input is one
  `ModelFolderError` line naming the file or field: no such folder, no config.json, no weights, a model type
  or architecture transformers does not know, or one that is not a causal LM.
- `load_model(path, dtype=, device=)` -> (transformers config, model): the entry point for code that needs
  the model itself (trainer, torch engine, an agent task that scores with it).
- `tokenizer_dir(path)`: the folder whose tokenizer files go with the model (None if it has none).
- `spec_mismatch(a, b)`: the first architecture or shape field where two specs differ (served vs trained).
- `write_tiny_model(path, family)`: a tiny random-init Qwen3 / Qwen2 / Llama folder via `save_pretrained`
  (tests, the tiny CPU config), seconds on a CPU.
- `check_dtype(name, device)`: a dtype the device can train or serve in, or one line why not.

Simplifications: one model per folder (no adapters, no remote code: `trust_remote_code` is never set);
transformers and safetensors are imported lazily, so `import gyre.real.nn` stays light.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# tiny shapes per family: 2 layers, d=64, 4 query / 2 KV heads of 16 (the families' real configs differ only in size)
TINY = {
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
}


class ModelFolderError(ValueError):
    """A model folder (or a dtype for it) refused; the message names the file or field."""


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """What a model folder holds: architecture and the shapes that decide whether two models are the same."""

    path: str
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_embeddings: bool
    stored_dtype: str
    num_parameters: int  # from the safetensors headers (a tied head counted once)

    def identity(self) -> dict:
        """The fields two folders of the same network agree on (path and stored dtype aside)."""
        return {k: v for k, v in asdict(self).items() if k not in ("path", "stored_dtype")}


def _causal_lm_names() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _read_config(p: Path):
    """transformers' config of folder `p`, after checking config.json names a causal LM it knows."""
    f = p / "config.json"
    if not p.is_dir():
        raise ModelFolderError(f"{p}: not a model folder (config.json + *.safetensors)")
    try:
        raw = json.loads(f.read_text())
    except OSError:
        raise ModelFolderError(f"{f}: missing (a model folder needs config.json)") from None
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{f}: not JSON ({exc})") from None
    known = _causal_lm_names()
    mtype = raw.get("model_type")
    if mtype not in known:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        why = "is not a causal LM" if mtype in CONFIG_MAPPING_NAMES else "is not a model type transformers knows"
        raise ModelFolderError(f"{f}: model_type = {mtype!r} {why} (transformers "
                               f"{__import__('transformers').__version__})")
    archs = raw.get("architectures") or [known[mtype]]
    import transformers

    if not isinstance(archs, list) or not hasattr(transformers, str(archs[0])):
        raise ModelFolderError(f"{f}: architectures = {archs!r}: not a class transformers has")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True), str(archs[0])
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelFolderError(f"{f}: {str(exc).splitlines()[0][:200]}") from None


def _weights_header(p: Path) -> tuple[int, str]:
    """(number of parameters, dtype of the first tensor) from the folder's safetensors headers."""
    from safetensors import safe_open

    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"{p}: no *.safetensors weights (a model folder needs config.json + *.safetensors)")
    n, dtype = 0, ""
    for fname in files:
        try:
            with safe_open(str(fname), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 (a safetensors handle)
                    s = h.get_slice(k)
                    shape = s.get_shape()
                    n += int(__import__("math").prod(shape)) if shape else 1
                    dtype = dtype or str(s.get_dtype())
        except Exception as exc:  # safetensors raises its own error types for a corrupt header
            raise ModelFolderError(f"{fname}: cannot read the safetensors header ({str(exc)[:120]})") from None
    return n, {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(dtype, dtype.lower())


def check_model_folder(path: str | Path) -> ModelSpec:
    """The `ModelSpec` of a model folder, or one ModelFolderError line naming the file or field."""
    p = Path(path)
    cfg, arch = _read_config(p)
    n, stored = _weights_header(p)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = int(text.num_attention_heads)
    hidden = int(text.hidden_size)
    return ModelSpec(
        path=str(p.resolve()), architecture=arch, model_type=str(cfg.model_type), vocab_size=int(text.vocab_size),
        hidden_size=hidden, num_layers=int(text.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        intermediate_size=int(getattr(text, "intermediate_size", 0) or 0),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), stored_dtype=stored, num_parameters=n)


def spec_mismatch(trained: ModelSpec, served: ModelSpec) -> str | None:
    """'field: trained X, served Y' for the first field where the two differ; None when they are one network."""
    a, b = trained.identity(), served.identity()
    for k in a:
        if a[k] != b[k]:
            return f"{k}: trained {a[k]!r}, served {b[k]!r}"
    return None


def check_dtype(name: str, device: str = "cpu", *, field: str = "dtype") -> str:
    """`name` if `device` can compute in it; else one ModelFolderError line naming `field`."""
    import torch

    if name not in DTYPES:
        raise ModelFolderError(f"{field} = {name!r}: expected one of {', '.join(DTYPES)}")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelFolderError(f"{field}: device {device!r} has no CUDA here")
        if name == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise ModelFolderError(f"{field} = 'bfloat16': this GPU has no bf16 (use float16 or float32)")
    elif device != "cpu":
        raise ModelFolderError(f"device = {device!r}: expected 'cpu' or 'cuda'")
    return name


def load_model(path: str | Path, *, dtype: str = "float32", device: str = "cpu", attn: str = "sdpa"):
    """(transformers config, causal LM in eval mode) of a model folder, weights in `dtype` on `device`.

    `attn`: transformers' attention implementation ("sdpa": a boolean 4D mask is honoured; "flex_attention":
    a FlexAttention BlockMask is, CUDA only for training)."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = check_model_folder(path)
    check_dtype(dtype, device)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(spec.path, local_files_only=True, dtype=getattr(torch, dtype),
                                                 attn_implementation=attn)
    model.to(device).eval()
    return model.config, model


def tokenizer_dir(path: str | Path) -> Path | None:
    """The folder holding the model's tokenizer files (the model folder itself when it has them), else None."""
    p = Path(path)
    return p.resolve() if any((p / f).is_file() for f in TOKENIZER_FILES) else None


def write_tiny_model(path: str | Path, family: str = "qwen3", *, vocab_size: int = 64, hidden_size: int = 64,
                     num_layers: int = 2, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """A tiny random-init causal LM folder of `family` (qwen3, qwen2, llama), written by save_pretrained."""
    import torch
    import transformers

    if family not in TINY:
        raise ModelFolderError(f"family = {family!r}: expected one of {', '.join(TINY)}")
    cls_name, extra = TINY[family]
    cfg = getattr(transformers, cls_name)(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **{**extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    p = Path(path)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(str(p))
    return p
