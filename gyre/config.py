"""Run configuration: which cluster, model, workload and policy; built without side effects.

A preset is a plain function returning a RunConfig (gyre.presets); a CLI flag only overrides a field
of a named preset via `override`, which validates and reports the offending field in one line. The real
backend's configs (gyre.real.config) are overridden by the same two functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gyre.faults import FaultSpecError, parse_faults
from gyre.datasheets import GpuConfig, ModelConfig
from gyre.hardware import CostConfig
from gyre.trajectory.sample import SamplingConfig
from gyre.workload import WorkloadConfig


class ConfigError(ValueError):
    """A user-supplied configuration is impossible; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    gpus: int
    gpu: GpuConfig
    model: ModelConfig
    cost: CostConfig = field(default_factory=CostConfig)
    cell_gpus: int = 0  # GPUs in one training cell (a streaming step's unit); 0: the model's training minimum
    standalone_gpus: int = 0  # a standalone rollout pool: the last GPUs, which never train


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str
    cluster: ClusterConfig
    workload: WorkloadConfig
    steps: int = 8
    seed: int = 0
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)  # per policy name
    faults: tuple[str, ...] = ()  # injected faults (gyre.faults), e.g. ("kill-engine@600", "random-engines:4")
    checkpoint_every: int = 0  # steps between trainer checkpoints (0: none; a lost trainer state replays every step)
    # which paths a step trains (gyre.trajectory.sample): "exact" every one; "roles": role-bounded, j_max per execution
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def validate(self) -> RunConfig:
        from gyre.hardware import derive_costs

        if self.cluster.gpus < 1:
            raise ConfigError(f"cluster.gpus must be >= 1, got {self.cluster.gpus}")
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        try:
            parse_faults(self.faults)
        except FaultSpecError as exc:
            raise ConfigError(f"faults: {exc}") from None
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
        c = self.cluster
        for name in ("cell_gpus", "standalone_gpus"):
            v = getattr(c, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"cluster.{name} must be an integer >= 0, got {v!r}")
        if c.standalone_gpus % costs.engine_gpus:
            raise ConfigError(f"cluster.standalone_gpus={c.standalone_gpus} must be a multiple of the engine's "
                              f"{costs.engine_gpus} GPUs")
        cell, rest = c.cell_gpus or costs.min_train_gpus, c.gpus - c.standalone_gpus
        if c.cell_gpus and c.cell_gpus < costs.min_train_gpus:
            raise ConfigError(f"cluster.cell_gpus={c.cell_gpus} cannot hold the core's training state of "
                              f"{c.model.name} (weights, gradients, optimizer: needs >= {costs.min_train_gpus} GPUs)")
        if not (c.cell_gpus or c.standalone_gpus):  # no cells asked for: cells() lists whole training minima
            return self
        if rest < cell or rest % cell:
            raise ConfigError(f"cluster.cell_gpus={cell} must divide the {rest} GPUs left after the standalone pool "
                              f"(cluster.gpus={c.gpus}, cluster.standalone_gpus={c.standalone_gpus})")
        if cell % costs.engine_gpus:
            raise ConfigError(f"cluster.cell_gpus={cell} must be a multiple of the engine's {costs.engine_gpus} GPUs")
        return self

    def costs(self):
        from gyre.hardware import derive_costs

        return derive_costs(self.cluster.model, self.cluster.gpu, self.cluster.cost)


def replace_fields(obj, table: Mapping[str, Any], where: str = "", prefix: str = ""):
    """`dataclasses.replace` with nested tables: a dict value reaches the nested config it names; a list or a
    table given for a tuple field becomes a tuple (TOML has no tuples). Unknown fields and values a config
    refuses are one ConfigError naming `where` (a file, or nothing) and the dotted field."""
    at = f"{where}: " if where else ""
    fields = {f.name for f in dataclasses.fields(obj)}
    kw = {}
    for k, v in table.items():
        if k not in fields:
            raise ConfigError(f"{at}unknown field {prefix + k!r} (known: {', '.join(sorted(fields))})")
        cur = getattr(obj, k)
        if dataclasses.is_dataclass(cur) and isinstance(v, Mapping):
            v = replace_fields(cur, v, where, f"{prefix}{k}.")
        elif isinstance(cur, tuple) and isinstance(v, list):
            v = tuple(v)
        elif isinstance(cur, tuple) and isinstance(v, Mapping):
            v = tuple(sorted(v.items()))
        kw[k] = v
    try:
        return dataclasses.replace(obj, **kw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{at}{prefix.rstrip('.') or 'run'}: {exc}") from None


def override(cfg, **changes: Any):
    """Replace fields; dotted keys reach nested configs ('cluster.gpus', 'workload.deadline_s'); None is no
    change. The one override mechanism of both backends (TOML files go through `replace_fields` too)."""
    table: dict[str, Any] = {}
    for key, value in changes.items():
        if value is None:
            continue
        *heads, last = key.split(".")
        t = table
        for h in heads:
            t = t.setdefault(h, {})
        t[last] = value
    return replace_fields(cfg, table)
