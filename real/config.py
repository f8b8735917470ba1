"""A real run's configuration and its named presets.

A real run is a `RealRunConfig`: the actor pool (PoolConfig: GPUs, model, engine and trainer
settings), the cluster (RealClusterConfig: batch shape, task, weight route), both in gyre.real.component_config and the
policies' parameters. Presets are plain functions returning one; a variant is a function that edits a base
preset. A TOML file (gyre.real.config_file) or a CLI flag only overrides fields of a preset, through
gyre.config.override / replace_fields, the mechanism the simulator's configs use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.config import ConfigError
from gyre.real.nn.model import TinyLlamaConfig
from gyre.real import task as T
from gyre.real.component_config import PoolConfig, RealClusterConfig, TrainerConfig
from gyre.real.engine_torch import TorchEngineConfig


class RealConfigError(ConfigError):
    """A bad real-run configuration; the message names the file and field."""


@dataclass(kw_only=True, frozen=True)
class RealRunConfig:
    name: str
    pool: PoolConfig
    cluster: RealClusterConfig
    steps: int = 30
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """The training cells against the pool: the standalone pool holds whole engines, and the cell size divides
        the GPUs left after it (checked only when either is set, as the simulator's gyre.config does)."""
        c, n, k = self.cluster, self.pool.n_gpus, self.pool.gpus_per_engine
        if c.standalone_gpus % k or c.standalone_gpus >= n:
            raise ValueError(f"RealClusterConfig.standalone_gpus={c.standalone_gpus} must be a multiple of the "
                             f"engine's {k} GPUs and leave GPUs to train (pool.n_gpus={n})")
        cell, rest = c.cell_gpus or c.min_train_gpus, n - c.standalone_gpus
        if (c.cell_gpus or c.standalone_gpus) and (rest < cell or rest % cell):
            raise ValueError(f"RealClusterConfig.cell_gpus={cell} must divide the {rest} GPUs left after the "
                             f"standalone pool (pool.n_gpus={n}, cluster.standalone_gpus={c.standalone_gpus})")


# calibration files (gyre.estimate) measured on a development machine: examples of [cluster] estimate = <file>;
# the presets profile their own hardware at start-up instead (gyre.real.profile)
ESTIMATES = Path(__file__).resolve().parent / "estimates"


def preset_tiny_cpu() -> RealRunConfig:
    """4 logical GPUs on local Ray, 1 GPU per engine, a 2-layer d=64 model: minutes on a laptop CPU."""
    return RealRunConfig(
        name="tiny-cpu",
        pool=PoolConfig(n_gpus=4, gpus_per_engine=1, model=TinyLlamaConfig(vocab_size=T.VOCAB_SIZE),
                        engine_config=TorchEngineConfig(), trainer_config=TrainerConfig(lr=3e-3, epochs=4)),
        cluster=RealClusterConfig(groups_per_step=4, group_size=8),
        steps=30,
    )


def preset_tiny_test() -> RealRunConfig:
    """tiny-cpu with 2 small groups per step and 2 steps (the test tier)."""
    base = preset_tiny_cpu()
    return dataclasses.replace(base, name="tiny-test", steps=2, policy_params={},
                               cluster=dataclasses.replace(base.cluster, groups_per_step=2, group_size=4))


PRESETS = {"tiny-cpu": preset_tiny_cpu, "tiny-test": preset_tiny_test}


def get_preset(name: str) -> RealRunConfig:
    if name not in PRESETS:
        raise RealConfigError(f"unknown real preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()
