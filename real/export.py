"""Export of a run's trained model as a Hugging Face folder that `transformers` loads.

What it models: the end product of a training run. `export_model(cluster, dest)` takes the trainer's latest
weights (the worker of record's) and writes them as a Llama model folder (config.json + model.safetensors,
gyre.nn.hf_llama.write_hf_llama), beside the task's tokenizer and chat template when the task has a model
folder (`model_dir` in its config), so `AutoModelForCausalLM.from_pretrained(dest)` and
`AutoTokenizer.from_pretrained(dest)` load the trained agent.

Simplifications: the model is gyre's TinyLlama (exported as LlamaForCausalLM) in float32.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt")


def export_model(cluster, dest: str | Path) -> Path:
    from gyre.nn.hf_llama import write_hf_llama

    dest = Path(dest)
    write_hf_llama(dest, cluster.pool.cfg.model, cluster.trainer_weights())
    src = getattr(cluster.cfg.task, "model_dir", None)
    if src:
        for name in TOKENIZER_FILES:
            if (Path(src) / name).exists():
                shutil.copyfile(Path(src) / name, dest / name)
    return dest
