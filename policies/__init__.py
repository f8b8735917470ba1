"""Scheduling policies, written once against gyre.cluster.Cluster: one registry, plus user policies
loaded by dotted path ('package.module:Class' or 'package.module.Class')."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from gyre.policies.async_split import AsyncSplit
from gyre.policies.colocate import Colocate
from gyre.policies.elastic import Elastic

REGISTRY: dict[str, Callable[..., Any]] = {
    "colocate": Colocate,
    "async": AsyncSplit,
    "elastic": Elastic,
}


class UnknownPolicy(ValueError):
    pass


def make_policy(name: str, **params: Any):
    """A registered policy by name, or a user's policy class by dotted path, built with params."""
    if name in REGISTRY:
        cls = REGISTRY[name]
    elif "." in name or ":" in name:
        mod, _, attr = name.replace(":", ".").rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as exc:
            raise UnknownPolicy(f"cannot load policy {name!r}: {exc}") from None
    else:
        raise UnknownPolicy(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))} (or a dotted path)")
    try:
        return cls(**params)
    except TypeError as exc:
        raise UnknownPolicy(f"policy {name!r}: bad parameters {params}: {exc}") from None
