"""Worker processes for comparisons and experiments that end with the process that started them.

A `concurrent.futures.ProcessPoolExecutor` outlives its parent: a parent killed by SIGTERM leaves its
workers computing their current run with no one to read it, and on Ctrl-C (SIGINT reaches the whole
foreground process group) each worker turns the interrupt into its current task's exception and goes
on to the next queued one while the parent's `with` block waits for every queued task. `process_pool`
closes both holes:

- each worker asks the kernel to kill it when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`, which
  also covers a parent killed by SIGKILL), and exits at once if the parent is already gone;
- each worker ignores SIGINT and takes SIGTERM's default action, so only the parent handles an
  interrupt;
- when the block exits by an exception (KeyboardInterrupt included) the queued tasks are cancelled and
  the workers terminated, not waited for, and the task queue's feeder thread is not joined at exit (it can
  block writing to a pipe that only the killed workers read).

Elsewhere than Linux the first point is missing: a parent killed by a signal it does not handle still
leaves its workers to finish their current task.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """Worker initializer: killed with the parent; interrupts are the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request above took effect
        os._exit(1)


@contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A ProcessPoolExecutor of `workers` processes that end with this process (module docstring)."""
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_die_with_parent, initargs=(os.getpid(),))
    try:
        yield pool
    except BaseException:
        procs = list((pool._processes or {}).values())  # the executor has no public way to kill its workers
        if pool._call_queue is not None:  # its feeder may block on a pipe no killed worker reads: exit without it
            pool._call_queue.cancel_join_thread()
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(5)
        raise
    pool.shutdown(wait=True)
