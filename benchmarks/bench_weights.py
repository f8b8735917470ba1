"""A trainer rank's host memory during a weight sync: how many model copies it holds, measured.

A trainer (gyre.real.trainer.Trainer, fp32 master weights + AdamW state) of a Qwen3 folder written here
(random init, ~40M parameters by default) takes one step, then publishes its weights in the serving dtype
(bf16) and broadcasts them over gloo, bucket by bucket (gyre.real.collective.send), to a receiver process,
while a thread samples this process's resident memory every millisecond. Printed: the model's fp32 and
serving-dtype sizes, RSS before the sync, the peak during it, and the peak's excess over the serving-dtype
size (one host copy of the served weights plus one bucket is what the design allows).

Run: `python benchmarks/bench_weights.py [--hidden 512 --layers 8 --vocab 32000 --bucket-mb 64]`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import tempfile
import threading
import time
from datetime import timedelta

import torch


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def receiver(port: int, layout, bucket_bytes: int, q) -> None:
    from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

    from gyre.real import collective as C

    store = PrefixStore("w/", TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120)))
    pg = ProcessGroupGloo(store, 1, 2, C._gloo_options("127.0.0.1", timedelta(seconds=120)))
    state = C.receive(pg, layout, bucket_bytes, "cpu")
    q.put(sum(t.numel() * t.element_size() for t in state.values()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    a = ap.parse_args()
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from test_hf_loss import batch
    from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

    from gyre.real.nn.hf_folder import write_tiny_model
    from gyre.real import collective as C
    from gyre.real.trainer import Trainer, TrainerConfig

    folder = write_tiny_model(Path(tempfile.mkdtemp()) / "q3", "qwen3", vocab_size=a.vocab, hidden_size=a.hidden,
                              num_layers=a.layers, head_dim=a.hidden // 4)
    t = Trainer(str(folder), TrainerConfig(epochs=1, max_pack_tokens=1024), serve_dtype="bfloat16")
    trees, advs = batch(0, 4)
    t.train([(tr.preorder(), ad) for tr, ad in zip(trees, advs)])
    fp32 = sum(p.numel() * 4 for p in t.model.parameters())
    served = sum(v.numel() * v.element_size() for v in t.weights().values())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=120), wait_for_workers=False)
    layout, bucket = t.layout(), int(a.bucket_mb * 2**20)
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=receiver, args=(port, layout, bucket, q))
    proc.start()
    del t._published[t.version]  # the sync below makes this version's snapshot afresh, as a step's end does
    import gc

    gc.collect()
    before = rss()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    th = threading.Thread(target=sample)
    th.start()
    t0 = time.perf_counter()
    t._publish()
    pg = ProcessGroupGloo(PrefixStore("w/", master), 0, 2, C._gloo_options("127.0.0.1", timedelta(seconds=120)))
    sent = C.send(pg, t.weights(), layout, bucket, "cpu")
    dt = time.perf_counter() - t0
    got = q.get(timeout=120)
    done.set()
    th.join()
    proc.join()
    mib = 2**20
    print(f"model: {fp32 / mib:.1f} MiB fp32 parameters, {served / mib:.1f} MiB in the serving dtype (bf16)")
    print(f"sync: published + sent {sent / mib:.1f} MiB (received {got / mib:.1f}) in {dt:.2f} s, buckets of "
          f"{a.bucket_mb:g} MiB")
    print(f"trainer rank RSS: {before / mib:.1f} MiB before, peak {peak[0] / mib:.1f} MiB during the sync: "
          f"+{(peak[0] - before) / mib:.1f} MiB = {(peak[0] - before) / served:.2f} x the served weights")


if __name__ == "__main__":
    main()
