"""Reading a trainer checkpoint (gyre.real.trainer `save`) as data only, so a checkpoint cannot run code.

What it models: the check a run makes before it trusts a file: unpickled with torch's data-only unpickler
(tensors, numbers, strings, plain containers), the keys a trainer writes, and the model it was written for.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from gyre.real.nn.hf_causal import model_identity

CHECKPOINT_KEYS = ("model", "opt", "version", "model_config")  # what `Trainer.save` writes


class CheckpointError(ValueError):
    """A trainer checkpoint refused: it needs more than data to load, cannot be read, or is of another model."""


def read_checkpoint(path: str | Path, model_config: object, *, map_location: str | torch.device = "cpu",
                    mmap: bool = False) -> dict:
    """The state a trainer checkpoint holds (model, opt, version, model_config), unpickled as data only: tensors,
    numbers, strings and plain containers. A file that needs anything more (a pickled class or callable) is
    refused before any of it runs; `model_config`: the trainer's (a TinyLlamaConfig or a model folder); `mmap`: map
    the tensors instead of reading them (a cheap check)."""
    try:
        state = torch.load(path, weights_only=True, map_location=map_location, mmap=mmap)
    except pickle.UnpicklingError as exc:  # the data-only unpickler stopped: say at what
        tail = str(exc).partition("WeightsUnpickler error:")[2]
        why = next((ln.strip() for ln in tail.splitlines() if ln.strip()), "").partition(" was not an allowed")[0]
        if "global" in why:  # a class or callable: something that runs code
            raise CheckpointError(f"checkpoint {path}: refused, it needs more than tensors, numbers and plain "
                                  f"containers to load ({why}); load only checkpoints a gyre trainer wrote") from None
        raise CheckpointError(f"checkpoint {path}: cannot be read as a torch checkpoint ({why or 'unpickling failed'})"
                              ) from None
    except Exception as exc:  # torch.load's failures on a file that is not a checkpoint are many kinds
        msg = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"checkpoint {path}: cannot be read as a torch checkpoint "
                              f"({type(exc).__name__}: {msg[:200]})") from None
    missing = [k for k in CHECKPOINT_KEYS if k not in state] if isinstance(state, dict) else list(CHECKPOINT_KEYS)
    if missing:
        raise CheckpointError(f"checkpoint {path}: not a gyre trainer checkpoint (no {', '.join(missing)})")
    if state["model_config"] != model_identity(model_config):
        raise CheckpointError(f"checkpoint {path} is for model {state['model_config']}, not "
                              f"{model_identity(model_config)}")
    return state
