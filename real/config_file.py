"""TOML run configs for the real backend: a preset name plus tables overriding its fields.

`preset = "tiny-cpu"` (the default) names the base; every other table overrides fields of it by name
([pool], [pool.trainer_config], [cluster], [cluster.task], [policy_params.<policy>], ...). With
`[pool] init_checkpoint = "dir"` (a Llama model directory) the model config is the checkpoint's, and a
[pool.model] table may only restate it. Every error is one line naming the file and the dotted field.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from gyre.config import ConfigError, replace_fields
from gyre.real.nn.hf_llama import check_hf_llama, config_mismatch
from gyre.real.config import RealConfigError, RealRunConfig, get_preset
from gyre.real.task_api import TaskError, task_class


def _apply(base: RealRunConfig, data: dict, where: str) -> RealRunConfig:
    try:
        return replace_fields(base, data, where)
    except ConfigError as exc:
        raise RealConfigError(str(exc)) from None


def _task_config(base: RealRunConfig, cluster: dict, p: Path) -> RealRunConfig:
    """`base` whose [cluster.task] is the default config of the task [cluster] task_class names (its
    config_class), so the table sets the fields that task declares and no others."""
    path = cluster.get("task_class")
    if path is None:
        return base
    try:
        cls = task_class(str(path))
    except TaskError as exc:
        raise RealConfigError(f"{p}: cluster.task_class: {exc}") from None
    if isinstance(base.cluster.task, cls.config_class):
        return base
    try:
        task = cls.config_class()
    except (TypeError, ValueError) as exc:
        raise RealConfigError(f"{p}: cluster.task: {cls.config_class.__name__}: {exc}") from None
    return dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, task=task))


def load_config(path: str | Path) -> RealRunConfig:
    """The run config a TOML file describes."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RealConfigError(f"{p}: {exc}") from None
    base = get_preset(data.pop("preset", "tiny-cpu"))
    base = _task_config(base, data.get("cluster") or {}, p)
    init = (data.get("pool") or {}).get("init_checkpoint")
    if not init:
        return _apply(base, data, str(p))
    try:  # the model is the checkpoint's; a [pool.model] table may only restate it
        ckpt = check_hf_llama(init)
    except ValueError as exc:
        raise RealConfigError(f"{p}: pool.init_checkpoint: {exc}") from None
    cfg = _apply(dataclasses.replace(base, pool=dataclasses.replace(base.pool, model=ckpt)), data, str(p))
    bad = config_mismatch(cfg.pool.model, ckpt)
    if bad:
        raise RealConfigError(f"{p}: pool.model.{bad} (pool.init_checkpoint = {init!r}); omit [pool.model] to "
                              f"take the checkpoint's")
    return cfg
