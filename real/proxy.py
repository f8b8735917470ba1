"""The model-request proxy: an OpenAI-compatible HTTP endpoint between black-box agent harnesses and the engines.

What it models: the forwarding point of the system Gyre follows (docs/harness.md). A harness process talks to
it as to any OpenAI-compatible server; the proxy turns each chat request into token ids (gyre.real.proxy_chat),
hands them to the backend as the next event of the request's execution, and answers with the reply decoded from
the ids the engine generated. The backend owns routing: the request becomes a gyre.real.task_api.Generate of the
execution's episode (gyre.real.tasks.harness), sent to whichever engine serves the execution now, and re-issued
elsewhere when the execution moves while it decodes (gyre.real.flow); the harness sees one ordinary response.

HTTP surface (tornado, bound to 127.0.0.1 unless `ProxyConfig.host` says otherwise, which start-up announces):

- `POST /v1/chat/completions`: `model`, `messages` (system, user, assistant with `tool_calls`, tool), `tools`,
  `max_tokens` / `max_completion_tokens` (capped at the task's `max_new_tokens`), `stream` (SSE: the reply in
  token-sized delta chunks cut at character boundaries, then one per tool call, a finish chunk and `data: [DONE]`;
  the engines return a segment whole, so the chunks are sent once the whole answer is back), `logprobs`.
  Sampling fields (temperature, top_p, stop, seed) are ignored: the engine samples the policy at temperature 1
  and stops at the template's end-of-turn token, so the behaviour log-probs are the policy's.
- `GET /v1/models`: the one served model.
- Auth: `Authorization: Bearer <token>`, the per-execution token the harness got as `OPENAI_API_KEY`. The
  execution is the token's; a request may name it (header `X-Gyre-Execution` or `metadata.gyre_execution`),
  and naming another one is refused. The call's role is the header `X-Gyre-Role` or `metadata.gyre_role`:
  main (default), main-summary, sub-agent or sub-agent-summary.
- Errors: 400 naming the field (the execution is unharmed: its next valid request is served), 401 (no or an
  unknown token), 403 (another execution), 404, 413 (body over `max_body_bytes`), 503 (the execution ended).

Harness processes: `launch` starts one per execution (its own session and process group, an empty working
folder, an environment of PATH, HOME, OPENAI_BASE_URL, OPENAI_API_KEY and the GYRE_* task variables only), and
`next_event` returns the execution's next request, or its exit: the process ended, or it outlived its
`harness_timeout_s` and was killed with its process group (`timed_out`). The fence around the process is
gyre.real.harness_sandbox's (bubblewrap namespaces with this proxy's Unix socket as the only network, or limits
only); see docs/harness.md.

Concurrent calls of one execution (parallel sub-agents) are served in rounds: the requests waiting when the
backend takes the execution's next event go out together (`next_event` returns them as one round; the episode
generates them at once on its engine, gyre.real.task_api.Generate.parallel, and answers them with `respond_all`);
a call that arrives while a round decodes waits for the round's end. An execution seen with two calls outstanding
at once, or whose harness announced it (a request with the header `X-Gyre-Parallel`), has each round wait
`round_window_s` for the calls sent together with its first, and a call that says it is one of N sent at once
(`X-Gyre-Parallel: N`) waits up to `round_wait_s` until N are there.

Simplifications: rounds, not independent streams (above); one proxy per run, on the driver's node (harnesses are
launched beside it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

from gyre.real.proxy_chat import CallCache, ChatCodec, ChatFormatError, Reply

PROXY_ROLES = ("main", "main-summary", "sub-agent", "sub-agent-summary")


def exposure(host: str) -> str | None:
    """The start-up warning for a bind address beyond loopback (None for a loopback one)."""
    import ipaddress

    try:
        loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = False
    return None if loop else (f"gyre proxy: ProxyConfig.host = {host!r} is beyond loopback: any host that reaches it "
                              f"can call the model with an execution token")


@dataclass(kw_only=True, frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"  # anything else exposes the endpoint beyond this machine (announced at start-up)
    port: int = 0  # 0: a free port
    model_name: str = "gyre-policy"  # what GET /v1/models lists
    max_body_bytes: int = 8 << 20
    # once an execution has had two calls outstanding at once, a request taken waits this long for the calls sent
    # with it, so they are generated together (one round, see `next_event`); 0: take what is queued only
    round_window_s: float = 0.005
    # a call that says it is one of N sent at once (header X-Gyre-Parallel: N) waits up to this long for the others
    round_wait_s: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"ProxyConfig.host must be an address, got {self.host!r}")
        if not 0 <= int(self.port) < 65536:
            raise ValueError(f"ProxyConfig.port must be in [0, 65536), got {self.port}")
        for name in ("round_window_s", "round_wait_s"):
            if not 0 <= getattr(self, name) <= 10:
                raise ValueError(f"ProxyConfig.{name} must be in [0, 10] seconds, got {getattr(self, name)}")


class ProxyError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Session:
    """One execution as the proxy holds it."""

    key: str
    token: str
    max_new: int
    max_context: int
    cache: CallCache = field(default_factory=CallCache)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: dict = field(default_factory=dict)  # request n -> future of {"ids", "logprobs"}
    n: int = 0
    proc: asyncio.subprocess.Process | None = None
    deadline: float = float("inf")  # monotonic time its harness is killed at
    closed: bool = False
    exit: dict | None = None
    concurrent: bool = False  # it has had two calls outstanding at once (its rounds wait `round_window_s`)


def write_files(root: str, files: dict) -> None:
    """Write {relative path: text} under `root` (folders made as needed); a path that leaves `root` is refused."""
    base = os.path.realpath(root)
    for rel, text in files.items():
        path = os.path.realpath(os.path.join(base, rel))
        if os.path.isabs(rel) or not path.startswith(base + os.sep):
            raise ValueError(f"file {rel!r} is not a relative path inside the working folder")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


class Proxy:
    """The endpoint and its sessions; runs on one asyncio loop (see the module docstring)."""

    def __init__(self, tokenizer, config: ProxyConfig | None = None) -> None:
        self.cfg = config or ProxyConfig()
        self.codec = ChatCodec(tokenizer)
        self.sessions: dict[str, Session] = {}
        self.by_token: dict[str, str] = {}
        self.url = ""
        self.unix = ""
        self.served = 0  # requests answered (the benchmark's count)

    # --- the server ---
    async def start(self) -> str:
        """Bind and serve; the base URL (http://host:port). Binding beyond loopback is announced on stderr."""
        import tornado.httpserver
        import tornado.netutil
        import tornado.web

        proxy = self

        class Chat(tornado.web.RequestHandler):
            async def post(self) -> None:
                await proxy._chat(self)

        class Models(tornado.web.RequestHandler):
            def get(self) -> None:
                try:
                    proxy._auth(self)
                except ProxyError as err:
                    return proxy._error(self, err)
                self.write({"object": "list", "data": [{"id": proxy.cfg.model_name, "object": "model",
                                                        "created": 0, "owned_by": "gyre"}]})

        app = tornado.web.Application([(r"/v1/chat/completions", Chat), (r"/v1/models", Models)],
                                      log_function=lambda _h: None)
        server = tornado.httpserver.HTTPServer(app, max_body_size=self.cfg.max_body_bytes)
        socks = tornado.netutil.bind_sockets(self.cfg.port, address=self.cfg.host)
        server.add_sockets(socks)
        self.unix = os.path.join(tempfile.mkdtemp(prefix="gyre-proxy-"), "proxy.sock")  # sandboxed harnesses' way in
        server.add_socket(tornado.netutil.bind_unix_socket(self.unix, mode=0o666))
        port = socks[0].getsockname()[1]
        host = self.cfg.host if ":" not in self.cfg.host else f"[{self.cfg.host}]"
        self.url = f"http://{host}:{port}"
        warn = exposure(self.cfg.host)
        if warn:
            print(f"{warn} (listening on {self.url})", file=sys.stderr, flush=True)
        return self.url

    # --- sessions (the backend's side) ---
    def open(self, key: str, token: str, max_new: int, max_context: int) -> None:
        if key not in self.sessions:
            self.sessions[key] = Session(key, token, max_new, max_context)
            self.by_token[token] = key

    async def launch(self, key: str, argv: list[str], env: dict, cwd: str, timeout_s: float, sandbox: str = "none",
                     memory_mb: int = 4096, file_mb: int = 256, files: dict | None = None) -> dict:
        """Start the execution's harness (once; a retried call only waits), fenced by `sandbox`
        (gyre.real.harness_sandbox), in `cwd` holding `files` ({relative path: text}, written first: a task's
        repository), and return its first event."""
        from gyre.real import harness_sandbox as hs

        s = self.sessions[key]
        if s.proc is None and s.exit is None:
            full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": cwd, "OPENAI_BASE_URL": self.url + "/v1",
                    "OPENAI_API_KEY": s.token, "GYRE_EXECUTION": key, **env}
            os.makedirs(cwd, exist_ok=True)
            write_files(cwd, files or {})
            if sandbox != "none":
                argv, full = hs.wrap(argv, cwd, full, self.unix)
            argv, pre = hs.limited(argv, memory_mb, file_mb)
            with open(os.path.join(cwd, ".harness.stderr"), "wb") as err:
                s.proc = await asyncio.create_subprocess_exec(
                    *argv, cwd=cwd, env=full, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                    stderr=err, start_new_session=True, preexec_fn=pre)
            s.deadline = time.monotonic() + timeout_s
        return await self.next_event(key)

    async def respond(self, key: str, n: int, ids: list[int], logprobs: list[float]) -> dict:
        """Answer request n with the generated ids (once: a retried call only waits) and return the next event."""
        return await self.respond_all(key, [(n, ids, logprobs)])

    async def respond_all(self, key: str, answers: list[tuple[int, list[int], list[float]]]) -> dict:
        """Answer a round's requests, (n, ids, logprobs) each (once: a retried call only waits); the next event."""
        s = self.sessions[key]
        for n, ids, logprobs in answers:
            fut = s.pending.pop(n, None)
            if fut is not None and not fut.done():
                fut.set_result({"ids": list(ids), "logprobs": list(logprobs)})
        return await self.next_event(key)

    async def next_event(self, key: str) -> dict:
        """The execution's next request ({"kind": "request", "n", "ids", "role", "max_new", "received"}), or a
        round of them when several are waiting ({"kind": "requests", "requests": [request, ...]} in arrival order:
        calls of one harness outstanding at once, served together), or its harness's end ({"kind": "exit", "code",
        "timed_out"}). A request taken for a concurrent execution waits `round_window_s` for others to join."""
        s = self.sessions[key]
        if s.exit is not None:
            return s.exit
        get = asyncio.ensure_future(s.queue.get())
        waits = {get}
        if s.proc is not None:
            waits.add(asyncio.ensure_future(s.proc.wait()))
        done, rest = await asyncio.wait(waits, timeout=max(0.0, s.deadline - time.monotonic()),
                                        return_when=asyncio.FIRST_COMPLETED)
        for t in rest:
            t.cancel()
        if get in done:
            return await self._round(s, get.result())
        if not s.queue.empty():
            return await self._round(s, s.queue.get_nowait())
        timed_out = not done
        return await self._end(s, timed_out)

    async def _round(self, s: Session, first: dict) -> dict:
        """`first` and the requests that join it: those queued after `round_window_s` (a concurrent execution), and
        up to `round_wait_s` more while fewer than the `parallel` its first announced are there."""
        if s.concurrent and self.cfg.round_window_s > 0:
            await asyncio.sleep(self.cfg.round_window_s)  # the calls sent with it arrive
        until = time.monotonic() + self.cfg.round_wait_s
        while 1 + s.queue.qsize() < first.get("parallel", 1) and time.monotonic() < until and not s.closed:
            await asyncio.sleep(0.002)
        more = []
        while not s.queue.empty():
            more.append(s.queue.get_nowait())
        return {"kind": "requests", "requests": [first, *more]} if more else first

    async def stop(self, key: str) -> dict:
        """End the execution's harness now (its work stays for scoring); its exit event."""
        s = self.sessions[key]
        return s.exit if s.exit is not None else await self._end(s, True)

    async def _end(self, s: Session, timed_out: bool) -> dict:
        if s.proc is not None and s.proc.returncode is None:
            try:
                os.killpg(s.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = await s.proc.wait() if s.proc is not None else None
        s.closed = True
        for fut in s.pending.values():
            if not fut.done():
                fut.set_exception(ProxyError(503, f"execution {s.key} ended"))
        s.pending.clear()
        s.exit = {"kind": "exit", "code": code, "timed_out": timed_out, "requests": s.n}
        return s.exit

    # --- HTTP ---
    def _auth(self, h) -> Session:
        auth = h.request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.startswith("Bearer ") else ""
        key = self.by_token.get(token)
        if key is None:
            raise ProxyError(401, "missing or unknown execution token (Authorization: Bearer <OPENAI_API_KEY>)")
        return self.sessions[key]

    def _error(self, h, err: ProxyError) -> None:
        h.set_status(err.status)
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}.get(
            err.status, "server_error")
        h.finish({"error": {"message": str(err), "type": kind, "param": err.param, "code": None}})

    def _parse(self, h, s: Session) -> tuple[list[int], str, int, bool, bool]:
        try:
            body = json.loads(h.request.body or b"")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProxyError(400, f"body: not JSON ({exc.msg if hasattr(exc, 'msg') else exc})", "body") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "body: expected a JSON object", "body")
        meta = body.get("metadata") or {}
        if not isinstance(meta, dict):
            raise ProxyError(400, "metadata: expected an object", "metadata")
        named = h.request.headers.get("X-Gyre-Execution") or meta.get("gyre_execution")
        if named is not None and str(named) != s.key:
            raise ProxyError(403, f"this token is execution {s.key}'s, not {named}'s", "X-Gyre-Execution")
        role = h.request.headers.get("X-Gyre-Role") or meta.get("gyre_role") or "main"
        if role not in PROXY_ROLES:
            roles = ", ".join(PROXY_ROLES)
            raise ProxyError(400, f"metadata.gyre_role (or the X-Gyre-Role header): expected one of {roles}, "
                                  f"got {role!r}", "metadata.gyre_role")
        if not isinstance(body.get("model"), str):
            raise ProxyError(400, "model: expected a string", "model")
        for name in ("stream", "logprobs"):
            if not isinstance(body.get(name, False), bool):
                raise ProxyError(400, f"{name}: expected true or false", name)
        max_new = s.max_new
        for name in ("max_completion_tokens", "max_tokens"):
            v = body.get(name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ProxyError(400, f"{name}: expected a positive integer, got {v!r}", name)
            max_new = min(max_new, v)
            break
        try:
            ids = self.codec.render(body.get("messages"), body.get("tools"), s.cache)
        except ChatFormatError as exc:
            raise ProxyError(400, str(exc), str(exc).split(":")[0]) from None
        if len(ids) + max_new > s.max_context:
            raise ProxyError(400, f"messages: {len(ids)} prompt tokens + {max_new} new exceed the context of "
                                  f"{s.max_context} tokens", "messages")
        par = h.request.headers.get("X-Gyre-Parallel", "1")
        if not (par.isdigit() and 1 <= int(par) <= 256):
            raise ProxyError(400, f"X-Gyre-Parallel: expected an integer in [1, 256], got {par!r}", "X-Gyre-Parallel")
        return ids, role, max_new, body.get("stream", False), body.get("logprobs", False), int(par)

    async def _chat(self, h) -> None:
        try:
            s = self._auth(h)
            ids, role, max_new, stream, want_lp, par = self._parse(h, s)
            if s.closed:
                raise ProxyError(503, f"execution {s.key} has ended")
            s.n += 1
            n = s.n
            fut = asyncio.get_running_loop().create_future()
            s.pending[n] = fut
            s.concurrent = s.concurrent or len(s.pending) > 1 or par > 1
            s.queue.put_nowait({"kind": "request", "n": n, "ids": ids, "role": role, "max_new": max_new,
                                "received": time.time(), "parallel": par})
            out = await fut
        except ProxyError as err:
            return self._error(h, err)
        reply = self.codec.decode(out["ids"], s.key, n, max_new)
        s.cache.remember(reply, out["ids"])
        self.served += 1
        pairs = zip(out["ids"], out["logprobs"])
        lp = {"content": [{"token": self.codec.tok.decode([t]), "logprob": p} for t, p in pairs]} if want_lp else None
        rid = f"chatcmpl-{s.key}-{n}"
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out["ids"]),
                 "total_tokens": len(ids) + len(out["ids"])}
        if not stream:
            msg = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
            if reply.tool_calls:
                msg["tool_calls"] = reply.tool_calls
            h.finish({"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.cfg.model_name,
                      "choices": [{"index": 0, "message": msg, "finish_reason": reply.finish_reason, "logprobs": lp}],
                      "usage": usage})
            return
        await _sse(h, rid, self.cfg.model_name, reply, self.codec.pieces(out["ids"], reply.content), lp, usage)


async def _sse(h, rid: str, model: str, reply: Reply, pieces: list[tuple[str, int]], lp, usage: dict) -> None:
    """The reply as server-sent events: one content delta per piece (ChatCodec.pieces: token-sized, cut at character
    boundaries; the first also carries the role), each with its tokens' log-probs when asked, then one delta per
    tool call, a finish chunk with `usage`, and `data: [DONE]`. Each chunk is flushed on its own."""
    h.set_header("Content-Type", "text/event-stream")
    h.set_header("Cache-Control", "no-cache")
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict, finish=None, logprobs=None, **more) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}], **more}

    chunks, start = [], 0
    for i, (text, end) in enumerate(pieces):
        delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
        chunks.append(chunk(delta, logprobs={"content": lp["content"][start:end]} if lp else None))
        start = end
    for k, c in enumerate(reply.tool_calls):
        chunks.append(chunk({"tool_calls": [{"index": k, **c}]}))
    chunks.append(chunk({}, reply.finish_reason, usage=usage))
    for c in chunks:
        h.write(f"data: {json.dumps(c)}\n\n")
        await h.flush()
    h.finish("data: [DONE]\n\n")
