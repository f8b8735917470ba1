"""Run configuration: which cluster, model, workload and policy; built without side effects.

A preset is a plain function returning a RunConfig (gyre.presets); a CLI flag only overrides a field
of a named preset via `override`, which validates and reports the offending field in one line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gyre.hardware import CostConfig, GpuConfig, ModelConfig
from gyre.workload import WorkloadConfig


class ConfigError(ValueError):
    """A user-supplied configuration is impossible; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    gpus: int
    gpu: GpuConfig
    model: ModelConfig
    cost: CostConfig = field(default_factory=CostConfig)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str
    cluster: ClusterConfig
    workload: WorkloadConfig
    steps: int = 8
    seed: int = 0
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)  # per policy name

    def validate(self) -> RunConfig:
        from gyre.hardware import derive_costs

        if self.cluster.gpus < 1:
            raise ConfigError(f"cluster.gpus must be >= 1, got {self.cluster.gpus}")
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        costs = derive_costs(self.cluster.model, self.cluster.gpu, self.cluster.cost)
        if self.cluster.gpus < costs.engine_gpus:
            raise ConfigError(
                f"cluster.gpus={self.cluster.gpus} cannot hold one engine of {self.cluster.model.name} "
                f"({costs.engine_gpus} GPUs)"
            )
        if self.cluster.gpus < costs.min_train_gpus:
            raise ConfigError(
                f"cluster.gpus={self.cluster.gpus} cannot train {self.cluster.model.name} "
                f"(needs >= {costs.min_train_gpus} GPUs)"
            )
        return self

    def costs(self):
        from gyre.hardware import derive_costs

        return derive_costs(self.cluster.model, self.cluster.gpu, self.cluster.cost)


def override(cfg: RunConfig, **changes: Any) -> RunConfig:
    """Replace fields; dotted keys reach nested configs ('cluster.gpus', 'workload.deadline_s')."""
    nested: dict[str, dict[str, Any]] = {}
    flat: dict[str, Any] = {}
    for key, value in changes.items():
        if value is None:
            continue
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            flat[key] = value
    for head, sub in nested.items():
        obj = getattr(cfg, head, None)
        if obj is None or not dataclasses.is_dataclass(obj):
            raise ConfigError(f"unknown config section {head!r}")
        names = {f.name for f in dataclasses.fields(obj)}
        bad = [k for k in sub if k.partition(".")[0] not in names]
        if bad:
            raise ConfigError(f"unknown field {head}.{bad[0]}")
        try:
            flat[head] = override(obj, **sub) if any("." in k for k in sub) else dataclasses.replace(obj, **sub)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    names = {f.name for f in dataclasses.fields(cfg)}
    bad = [k for k in flat if k not in names]
    if bad:
        raise ConfigError(f"unknown field {bad[0]!r}")
    try:
        return dataclasses.replace(cfg, **flat)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
