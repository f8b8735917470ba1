"""Export of a run's trained model as a Hugging Face folder that `transformers` loads.

What it models: the end product of a training run. `export_model(dest, pool_config, weights, tokenizer_dir)`
writes the trainer's latest weights (the worker of record's published state dict) as a model folder:

- a run of a model folder (`[pool] model_dir`, any transformers causal LM): its config.json (and
  generation_config.json) with the trained weights as model.safetensors, in the names the folder uses;
- a run of gyre's TinyLlama: a Llama folder (gyre.real.nn.hf_llama.write_hf_llama, LlamaForCausalLM);

beside the tokenizer and chat template of `tokenizer_dir` (the task's model folder) or of the model folder, so
`AutoModelForCausalLM.from_pretrained(dest)` and `AutoTokenizer.from_pretrained(dest)` load the trained agent.

Simplifications: one safetensors file, in the dtype the weights were published in (the engines' serving dtype).
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
CONFIG_FILES = ("config.json", "generation_config.json")


def export_model(dest: str | Path, pool_config, weights: dict, tokenizer_dir: str | Path | None = None) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model_dir = getattr(pool_config, "model_dir", "")
    if model_dir:
        from safetensors.torch import save_file

        for name in CONFIG_FILES:
            if (Path(model_dir) / name).exists():
                shutil.copyfile(Path(model_dir) / name, dest / name)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in weights.items()}, str(dest / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        from gyre.real.nn.hf_llama import write_hf_llama

        write_hf_llama(dest, pool_config.model, weights)
    for src in [tokenizer_dir, model_dir]:
        if src and any((Path(src) / n).exists() for n in TOKENIZER_FILES):
            for name in TOKENIZER_FILES:
                if (Path(src) / name).exists():
                    shutil.copyfile(Path(src) / name, dest / name)
            break
    return dest


def export_run(cluster, dest: str | Path) -> Path:
    """The cluster's trained model (its trainer of record's latest weights) exported to `dest`."""
    return export_model(dest, cluster.pool.cfg, cluster.trainer_weights(), getattr(cluster.cfg.task, "model_dir", None))
