"""Model-proxy overhead per request against calling the engine directly, at 1, 16 and 64 concurrent executions.

Equal work: the proxy pass serves `--turns` chat turns per execution from HTTP clients (one thread each, plain
urllib, the way a harness calls it) through gyre.real.proxy to an in-process torch engine (a tiny random Qwen3 of
the tiny chat tokenizer's vocabulary); every call's ids, max_new and seed are recorded; the direct pass then
replays exactly those calls (same ids, same seeds, same concurrency: one coroutine per execution) on a fresh
engine of the same weights. Both passes generate the same tokens, so the difference is the proxy: HTTP, JSON,
chat-template rendering, decoding, the relay. Per request: mean latency seen by the client (proxy) or the
engine call (direct); the overhead = the client's latency minus the engine time of the same call in the proxy
pass (what the proxy adds to each call); plus requests per second of both passes. The clients run in their own
process (as harnesses do); the proxy and the engine run on event loops of their own, in two threads of one process.

What it leaves out: the Ray hops of a real run (driver -> tool worker -> proxy actor, one per call each way), which
tests/test_real_harness.py exercises but does not time. Prints a table and writes CSV (`--out`).
  .venv/bin/python benchmarks/bench_proxy.py --concurrency 1 16 64 --turns 3 --repeat 2 --out benchmarks/results/proxy.csv
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def model_folder() -> str:
    from gyre.real.nn.hf_folder import write_tiny_model
    from gyre.real.proxy_chat import TOOLS_TEMPLATE

    folder = Path(tempfile.mkdtemp(prefix="gyre-bench-proxy-"))
    write_tiny_model(folder, "qwen3", vocab_size=384, seed=0)
    for f in (ROOT / "configs" / "tiny_chat").iterdir():
        shutil.copyfile(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(folder)


async def engine(folder: str):
    from gyre.real.engine_torch import TorchEngine, TorchEngineConfig

    eng = TorchEngine(folder, TorchEngineConfig(max_batch=64))
    await eng.wake(None, 0)
    return eng


def client(url: str, token: str, turns: int, lat: list) -> None:
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sum a list of numbers."}]
    for _ in range(turns):
        body = json.dumps({"model": "m", "messages": msgs, "max_tokens": 16}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Authorization": f"Bearer {token}"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            reply = json.loads(r.read())["choices"][0]["message"]
        lat.append(time.perf_counter() - t0)
        msgs += [{"role": "assistant", "content": reply["content"] or ""}, {"role": "user", "content": "Go on."}]


def clients(url: str, n: int, turns: int, out) -> None:
    """The harnesses' side, in its own process (as harness processes are): n client threads; latencies to `out`."""
    lat: list = []
    threads = [threading.Thread(target=client, args=(url, f"t{i}", turns, lat)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((lat, time.perf_counter() - t0))


def proxy_pass(folder: str, n: int, turns: int) -> tuple[list, list, float]:
    from gyre.real.chat import ChatTokenizer
    from gyre.real.proxy_host import ProxyThread

    pt = ProxyThread(ChatTokenizer(folder).tok)
    eloop = asyncio.new_event_loop()  # the engine on its own loop and thread, as an engine actor is its own process
    threading.Thread(target=eloop.run_forever, daemon=True).start()
    eng = asyncio.run_coroutine_threadsafe(engine(folder), eloop).result(120)
    calls: list = []

    async def timed(key, ids, max_new, seed):
        t0 = time.perf_counter()
        res = await eng.generate(key, ids, max_new, [0], seed)
        return res, time.perf_counter() - t0

    async def relay(key: str) -> None:  # the backend's part: next request -> engine -> answer
        ev = await pt.proxy.next_event(key)
        while ev["kind"] == "request":
            seed = len(calls)
            res, dt = await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(timed(key, ev["ids"], ev["max_new"], seed), eloop))
            calls.append((key, ev["ids"], ev["max_new"], seed, len(res["tokens"]), dt))
            ev = await pt.proxy.respond(key, ev["n"], res["tokens"], res["logprobs"])

    asyncio.run_coroutine_threadsafe(eng.generate("warm", [1, 2, 3], 4, [0], 0), eloop).result(60)
    for i in range(n):
        pt.proxy.open(f"e{i}", f"t{i}", 16, 4096)
        asyncio.run_coroutine_threadsafe(relay(f"e{i}"), pt.loop)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=clients, args=(pt.url, n, turns, q))
    proc.start()
    lat, wall = q.get(timeout=1800)
    proc.join()
    for i in range(n):
        pt.call(pt.proxy.stop(f"e{i}"))
    pt.close()
    eloop.call_soon_threadsafe(eloop.stop)
    return lat, calls, wall


async def direct_pass(folder: str, calls: list) -> tuple[list, float]:
    eng = await engine(folder)
    await eng.generate("warm", [1, 2, 3], 4, [0], 0)
    by_key: dict = {}
    for c in calls:
        by_key.setdefault(c[0], []).append(c)
    lat: list = []
    toks: list = []

    async def one(seq: list) -> None:
        for key, ids, max_new, seed, *_ in seq:
            t0 = time.perf_counter()
            res = await eng.generate(key, ids, max_new, [0], seed)
            lat.append(time.perf_counter() - t0)
            toks.append(len(res["tokens"]))

    t0 = time.perf_counter()
    await asyncio.gather(*[one(s) for s in by_key.values()])
    return lat, time.perf_counter() - t0, sum(toks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    folder = model_folder()
    rows = []
    for rep in range(a.repeat):
        for n in a.concurrency:
            plat, calls, pwall = proxy_pass(folder, n, a.turns)
            dlat, dwall, dtok = asyncio.run(direct_pass(folder, calls))
            row = {"repeat": rep, "executions": n, "requests": len(calls), "tokens_proxy": sum(c[4] for c in calls),
                   "tokens_direct": dtok, "proxy_ms": 1e3 * sum(plat) / len(plat),
                   "engine_in_proxy_ms": 1e3 * sum(c[5] for c in calls) / len(calls),
                   "direct_ms": 1e3 * sum(dlat) / len(dlat), "proxy_rps": len(calls) / pwall,
                   "direct_rps": len(calls) / dwall}
            row["overhead_ms"] = row["proxy_ms"] - row["engine_in_proxy_ms"]  # the same calls: client minus engine
            rows.append(row)
            print(f"{n:>3} executions, {len(calls):>4} requests: proxy {row['proxy_ms']:8.1f} ms/request "
                  f"({row['proxy_rps']:6.1f}/s), direct {row['direct_ms']:8.1f} ms ({row['direct_rps']:6.1f}/s), "
                  f"proxy minus its own engine time {row['overhead_ms']:7.1f} ms; tokens {row['tokens_proxy']} / "
                  f"{row['tokens_direct']}", flush=True)
    df = pd.DataFrame(rows)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(a.out, index=False)
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
