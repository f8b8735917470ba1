"""Where the model proxy (gyre.real.proxy) runs: a Ray actor on the driver's node, or a thread of this process.

`ProxyActor` hosts one `Proxy` on its asyncio loop for a run (gyre.real.tasks.harness starts it; tool calls reach it
by handle); `ProxyThread` runs one on an event loop in a daemon thread, for tests and the benchmark, which drive
its sessions without Ray.
"""

from __future__ import annotations

import asyncio
import threading

from gyre.real.proxy import Proxy, ProxyConfig


class ProxyActor:
    """The proxy in a Ray actor (asyncio): one per run, on the driver's node; tool calls reach it by handle."""

    def __init__(self, tokenizer_folder: str, config: ProxyConfig) -> None:
        from gyre.real.chat import ChatTokenizer

        self.proxy = Proxy(ChatTokenizer(tokenizer_folder).tok, config)

    async def start(self) -> str:
        return self.proxy.url or await self.proxy.start()

    def open(self, key: str, token: str, max_new: int, max_context: int) -> None:
        self.proxy.open(key, token, max_new, max_context)

    async def launch(self, key, token, max_new, max_context, argv, env, cwd, timeout_s, sandbox="none",
                     memory_mb=4096, file_mb=256, files=None) -> dict:
        """Open the execution's session and start its harness (see Proxy.launch)."""
        self.proxy.open(key, token, max_new, max_context)
        return await self.proxy.launch(key, argv, env, cwd, timeout_s, sandbox, memory_mb, file_mb, files)

    async def respond(self, key, n, ids, logprobs) -> dict:
        return await self.proxy.respond(key, n, ids, logprobs)

    async def respond_all(self, key, answers) -> dict:
        return await self.proxy.respond_all(key, answers)

    async def stop(self, key) -> dict:
        return await self.proxy.stop(key)

    def served(self) -> int:
        return self.proxy.served


class ProxyThread:
    """A Proxy on its own event loop in a daemon thread (tests and the benchmark drive it without Ray)."""

    def __init__(self, tokenizer, config: ProxyConfig | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = self.call(_make(tokenizer, config))
        self.url = self.call(self.proxy.start())

    def call(self, coro, timeout: float | None = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def _make(tokenizer, config):
    return Proxy(tokenizer, config)  # built on its loop: the sessions' queues belong to it
