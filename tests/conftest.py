"""Shared test fixtures: hand-made cost models and workloads small enough to compute by hand."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
