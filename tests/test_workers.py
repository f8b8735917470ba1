"""An interrupted comparison leaves nothing running: `gyre-sim compare` stopped by SIGTERM or Ctrl-C
(SIGINT) while its worker processes compute takes them with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="compare runs in this process on one core")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_compare_stopped_by_a_signal_leaves_no_worker(tmp_path, sig):
    """Signal compare once its workers run: within seconds neither it nor any of its children survives."""
    cmd = [sys.executable, "-c", "from gyre.sim.cli.app import main; main()", "compare", "--preset", "short-math",
           "--steps", "2", "--gpus", "16", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parent = psutil.Process(proc.pid)
    children: list[psutil.Process] = []
    try:
        until = time.monotonic() + 60
        while time.monotonic() < until and len(children) < 2 and proc.poll() is None:
            time.sleep(0.2)
            children = parent.children(recursive=True)
        assert len(children) >= 2, f"compare started {len(children)} workers (exit {proc.poll()})"
        time.sleep(0.5)  # the workers are computing their first runs
        proc.send_signal(sig)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"workers {[p.pid for p in alive]} outlived compare stopped by {sig.name}"
    finally:
        for p in [*children, parent]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
