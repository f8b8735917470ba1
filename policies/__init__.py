"""Scheduling policies, written once against gyre.cluster.Cluster: one registry, plus user policies
loaded by dotted path ('package.module:Class' or 'package.module.Class').

A policy class may declare `Config`, a frozen keyword-only dataclass of its parameters (the class is then
built as `cls(config)`), `grid(shape, etas)`, the parameter sets `gyre-sim compare` sweeps to find its
best setting, and `search(shape, etas)`, a search over that grid driven by measured makespans
(policies.tuning) where the whole grid is too many runs. A class without them takes its parameters as
keywords and is compared as configured. The
backends and CLIs read policies only through the functions below, so no code outside this package names
a policy.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from gyre.policies.async_split import AsyncSplit
from gyre.policies.colocate import Colocate
from gyre.policies.common import ClusterShape
from gyre.policies.elastic import Elastic
from gyre.policies.tuning import Search, exhaustive
from gyre.policies.waterlevel import Waterlevel

REGISTRY: dict[str, type] = {
    "colocate": Colocate,
    "async": AsyncSplit,
    "elastic": Elastic,
    "waterlevel": Waterlevel,
}

__all__ = ["REGISTRY", "ClusterShape", "UnknownPolicy", "baselines", "check_params", "make_policy", "policy_class", "policy_config",
           "sweep", "tuner", "takes"]


class UnknownPolicy(ValueError):
    """A policy name, dotted path or parameter that cannot be used (a one-line message)."""


def policy_class(name: str) -> type:
    """The class of a registered policy, or of a user's policy given by dotted path."""
    if name in REGISTRY:
        return REGISTRY[name]
    if "." in name or ":" in name:
        mod, _, attr = name.replace(":", ".").rpartition(".")
        try:
            return getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise UnknownPolicy(f"cannot load policy {name!r}: {exc}") from None
    raise UnknownPolicy(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))} (or a dotted path)")


def policy_config(name: str, params: Mapping[str, Any]):
    """The policy's typed config built from `params` (None for a class without `Config`)."""
    cls = policy_class(name)
    config_cls = getattr(cls, "Config", None)
    if config_cls is None:
        return None
    fields = {f.name for f in dataclasses.fields(config_cls)}
    bad = [k for k in params if k not in fields]
    if bad:
        raise UnknownPolicy(f"policy {name!r} has no parameter {bad[0]!r}; it takes {', '.join(sorted(fields))}")
    try:
        return config_cls(**params)
    except (TypeError, ValueError) as exc:
        raise UnknownPolicy(f"policy {name!r}: {exc}") from None


def check_params(policy_params: Mapping[str, Mapping[str, Any]]) -> None:
    """Every policy's configured parameters build its config; else one line naming policy_params.<name>."""
    for name, params in policy_params.items():
        policy_class(name)
        try:
            policy_config(name, params)
        except UnknownPolicy as exc:
            raise UnknownPolicy(f"policy_params.{name}: {str(exc).removeprefix(f'policy {name!r}: ')}") from None


def make_policy(name: str, **params: Any):
    """A registered policy by name, or a user's policy class by dotted path, built with params."""
    cls = policy_class(name)
    if getattr(cls, "Config", None) is not None:
        return cls(policy_config(name, params))
    try:
        return cls(**params)
    except TypeError as exc:
        raise UnknownPolicy(f"policy {name!r}: bad parameters {params}: {exc}") from None


def takes(name: str, param: str) -> bool:
    """Whether the policy has a parameter of this name."""
    config_cls = getattr(policy_class(name), "Config", None)
    return config_cls is not None and param in {f.name for f in dataclasses.fields(config_cls)}


def sweep(name: str, shape: ClusterShape, etas: tuple[int, ...]) -> list[dict[str, Any]]:
    """The parameter sets a comparison tries for this policy (one empty set if it declares no grid)."""
    grid = getattr(policy_class(name), "grid", None)
    return grid(shape, etas) if grid is not None else [{}]


def tuner(name: str, shape: ClusterShape, etas: tuple[int, ...]) -> Search:
    """The search a comparison runs to tune this policy: its own `search`, else its whole grid."""
    search = getattr(policy_class(name), "search", None)
    return search(shape, etas) if search is not None else exhaustive(sweep(name, shape, etas))


def baselines() -> list[str]:
    """Registered policies every result is compared against (each gets a speedup_vs_<name> column)."""
    return [name for name, cls in REGISTRY.items() if getattr(cls, "baseline", False)]
