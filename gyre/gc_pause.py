"""Pausing Python's cycle collector while millions of small, long-lived objects are made.

Each collection rescans the objects that survived earlier ones, so as a trace, a simulation log or a
replay's executions grow into the millions, collections cost more and more (a quarter to a half of a
1M-execution replay). Readers, the simulator's event loop and its post-processing make no reference
cycles worth collecting meanwhile; whatever cycles they do make are collected once the pause ends.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def no_gc():
    """Pause the cyclic garbage collector inside the block (nests; restores the previous state).

    On leaving the outermost pause, the objects made meanwhile go straight to the oldest generation
    (freeze + unfreeze moves them without a scan): otherwise the first young collection after the
    pause would scan all of them at once (about 1 s per 5M objects), only to promote them anyway.
    A later full collection still sees them, so no cycle made inside the pause leaks."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.freeze()
            gc.unfreeze()
            gc.enable()
