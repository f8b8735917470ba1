"""Jobs for the sweep tests (tests/test_sweep.py), in a module Ray's workers can import by name."""

from __future__ import annotations

import time
from pathlib import Path


def square_after(a: tuple[int, float]) -> int:
    """i * i, after sleeping `pause` seconds."""
    i, pause = a
    time.sleep(pause)
    return i * i


def mark_after(a: tuple[str, float]) -> str:
    """Write a file at `path` after sleeping `pause` seconds: it exists only if the job ran to its end."""
    path, pause = a
    time.sleep(pause)
    Path(path).write_text("ran to the end")
    return path
