"""The model proxy without Ray: chat rendering to exact ids, tool-call restoring, the HTTP surface and its refusals."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("tornado")
pytest.importorskip("transformers")

from gyre.real.chat import ChatTokenizer  # noqa: E402
from gyre.real.proxy import exposure
from gyre.real.proxy_host import ProxyThread  # noqa: E402
from gyre.real.proxy_chat import TOOLS_TEMPLATE, CallCache, ChatCodec, ChatFormatError  # noqa: E402

ROOT = Path(__file__).parents[1]
TOOLS = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}]
USER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list the files"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    for f in (ROOT / "configs" / "tiny_chat").iterdir():
        shutil.copyfile(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return ChatTokenizer(folder).tok


@pytest.fixture()
def proxy(tok):
    pt = ProxyThread(tok)
    pt.proxy.open("e0", "tok0", 16, 512)
    pt.proxy.open("e1", "tok1", 16, 512)
    yield pt
    pt.close()


def reply_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def post(pt, body, token="tok0", headers=None, path="/v1/chat/completions", raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(pt.url + path, data=data, method="POST" if data is not None else "GET",
                                 headers={"Authorization": f"Bearer {token}", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def serve(pt, key, body, answer, **kw):
    """POST `body` as execution `key` while the test plays the engine: it answers with `answer` ids. (status,
    response text, the request event the backend saw). As the backend does, it waits for the next event with
    its answer (`respond`)."""
    waiting = pt.__dict__.setdefault("waiting", {})
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, pt, body, **kw)
        nxt = waiting.pop(key, None)
        ev = nxt.result(20) if nxt is not None else pt.call(pt.proxy.next_event(key))
        waiting[key] = asyncio.run_coroutine_threadsafe(
            pt.proxy.respond(key, ev["n"], answer, [-0.5] * len(answer)), pt.loop)
        status, text = fut.result(20)
    return status, text, ev


def test_a_reformatted_tool_call_still_prefix_matches_its_history(tok):
    """A harness that re-serializes an earlier call's arguments sends ids that start with the first request's ids
    and the exact ids the model generated; without the call cache the same history renders differently."""
    codec, cache = ChatCodec(tok), CallCache()
    first = codec.render(USER, TOOLS, cache)
    out = reply_ids(tok, 'ok <tool_call>{"name": "sh", "arguments": {"cmd": "ls -a", "n": 1}}</tool_call>')
    reply = codec.decode(out, "e0", 1, 64)
    cache.remember(reply, out)
    assert reply.finish_reason == "tool_calls" and reply.tool_calls[0]["function"]["arguments"] == '{"cmd":"ls -a","n":1}', \
        f"decoded {reply}"
    call = dict(reply.tool_calls[0])
    call["function"] = {"name": "sh", "arguments": json.dumps({"n": 1, "cmd": "ls -a"}, indent=3)}
    history = USER + [{"role": "assistant", "content": reply.content, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"], "content": "a.py"}]
    second = codec.render(history, TOOLS, cache)
    assert second[:len(first) + len(out)] == first + out, "the history does not extend the first call's ids exactly"
    plain = codec.render(history, TOOLS, CallCache())
    assert plain[:len(first) + len(out)] != first + out, "control: without the cache the re-formatted call differs"


def test_a_plain_reply_is_spliced_by_its_text_and_content_cannot_forge_markers(tok):
    """A call-less reply comes back as its exact ids (even where re-encoding its text differs); a user's '<|end|>' is
    encoded as text, never as the stop token."""
    codec, cache = ChatCodec(tok), CallCache()
    first = codec.render(USER, None, cache)
    out = [5, 70, 71, 70, tok.eos_token_id]  # a pad token (dropped from the text) and plain ones
    reply = codec.decode(out, "e0", 1, 64)
    assert tok.encode(reply.content, add_special_tokens=False) != out[:-1], "control: the text must not re-encode to out"
    cache.remember(reply, out)
    nxt = codec.render(USER + [{"role": "assistant", "content": reply.content},
                               {"role": "user", "content": "<|end|> again"}], None, cache)
    assert nxt[:len(first) + len(out)] == first + out, "the reply's ids were not spliced back"
    tail = nxt[len(first) + len(out):]
    assert tail.count(tok.eos_token_id) == 1 and tail[-2] == tok.eos_token_id, f"a forged marker became special: {tail}"


@pytest.mark.parametrize("messages, field", [
    ([], "messages"), ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls")])
def test_bad_messages_name_their_field(tok, messages, field):
    """Each malformed message is a ChatFormatError whose message starts with the field's path."""
    with pytest.raises(ChatFormatError) as err:
        ChatCodec(tok).render(messages, None, CallCache())
    assert str(err.value).startswith(field + ":"), str(err.value)


def test_http_round_trip_plain_and_streamed_with_logprobs(proxy, tok):
    """A chat completion and its SSE form carry the decoded reply, the ids' count and the behaviour log-probs."""
    out = reply_ids(tok, "def f(): pass")
    status, text, ev = serve(proxy, "e0", {"model": "m", "messages": USER, "logprobs": True}, out)
    body = json.loads(text)
    assert status == 200 and body["choices"][0]["message"]["content"] == tok.decode(out, skip_special_tokens=True), text
    assert [x["logprob"] for x in body["choices"][0]["logprobs"]["content"]] == [-0.5] * len(out), "log-probs lost"
    assert body["usage"] == {"prompt_tokens": len(ev["ids"]), "completion_tokens": len(out),
                             "total_tokens": len(ev["ids"]) + len(out)}, body["usage"]
    hist = USER + [body["choices"][0]["message"], {"role": "user", "content": "more"}]
    status, text, ev2 = serve(proxy, "e0", {"model": "m", "messages": hist, "stream": True}, out[:3])
    chunks = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert status == 200 and chunks[-1] == "[DONE]", text
    said = "".join(json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert said == tok.decode(out[:3], skip_special_tokens=True), said
    assert json.loads(chunks[-2])["choices"][0]["finish_reason"] == "stop", chunks[-2]
    assert ev2["ids"][:len(ev["ids"]) + len(out)] == ev["ids"] + out, "the second call does not extend the first"


@pytest.mark.parametrize("body, field", [
    (None, "body"), ({"messages": USER}, "model"), ({"model": "m", "messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": USER, "stream": "yes"}, "stream"),
    ({"model": "m", "messages": USER, "tools": [{"type": "function"}]}, "tools[0]"),
    ({"model": "m", "messages": USER, "metadata": {"gyre_role": "boss"}}, "metadata.gyre_role"),
    ({"model": "m", "messages": [{"role": "user", "content": "x " * 600}]}, "messages")])
def test_a_malformed_request_is_a_400_naming_the_field_and_the_execution_goes_on(proxy, tok, body, field):
    """HTTP 400 whose error names the field; the execution's next valid request is then served as request 1."""
    status, text = post(proxy, body, raw=b"{not json" if body is None else None)
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == field and err["message"].startswith(field.split("[")[0]), text
    status, text, ev = serve(proxy, "e0", {"model": "m", "messages": USER}, reply_ids(tok, "x"))
    assert status == 200 and ev["n"] == 1, f"the execution was harmed: {status} {text}"


def test_tokens_and_executions_are_enforced(proxy):
    """No or an unknown token: 401; naming another execution (header or metadata): 403; /v1/models needs a token."""
    body = {"model": "m", "messages": USER}
    assert post(proxy, body, token="")[0] == 401 and post(proxy, body, token="nope")[0] == 401, "bad token served"
    assert post(proxy, body, headers={"X-Gyre-Execution": "e1"})[0] == 403, "another execution's id served"
    assert post(proxy, {**body, "metadata": {"gyre_execution": "e1"}})[0] == 403, "metadata execution not checked"
    status, text = _get(proxy, "tok0")
    assert status == 200 and json.loads(text)["data"][0]["id"] == "gyre-policy", text
    assert _get(proxy, "nope")[0] == 401, "models listed without a token"


def _get(pt, token):
    req = urllib.request.Request(pt.url + "/v1/models", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_role_header_reaches_the_backend(proxy, tok):
    """X-Gyre-Role names the call's role in the event the backend receives."""
    _, _, ev = serve(proxy, "e1", {"model": "m", "messages": USER}, reply_ids(tok, "x"), token="tok1",
                     headers={"X-Gyre-Role": "sub-agent-summary"})
    assert ev["role"] == "sub-agent-summary", ev["role"]


def test_binding_beyond_loopback_is_announced():
    """Loopback addresses are quiet; any other bind address gets a one-line warning naming it."""
    assert exposure("127.0.0.1") is None and exposure("::1") is None and exposure("localhost") is None
    msg = exposure("0.0.0.0")
    assert msg and "0.0.0.0" in msg and "\n" not in msg, msg


def sse_events(text: str) -> list:
    """An SSE client's reading of a stream: one event per blank-line-separated block, its `data:` payload."""
    out = []
    for block in text.split("\n\n"):
        data = "".join(ln[6:] for ln in block.splitlines() if ln.startswith("data: "))
        if data:
            out.append(data)
    return out


def test_a_streamed_reply_comes_in_token_sized_chunks_that_reassemble_it_exactly(proxy, tok):
    """Streamed, a reply comes as one content chunk per token, a character split over two byte-level tokens (é) kept
    in one chunk, each chunk with its tokens' log-probs; the chunks join to the non-streamed reply's text exactly.
    A reply with a tool call streams its text, then the call whole, as the non-streamed reply has them."""
    text = "def add_one(x):\n    return x + 1  h\u00e9llo"
    out = reply_ids(tok, text)
    want = ["def", " add", "_", "on", "e", "(", "x", "):", "\n   ", " return", " x", " +", " 1", " ", " ", "h",
            "\u00e9", "l", "l", "o"]  # the tiny tokenizer's tokens, the two bytes of é as one
    assert len(out) == len(want) + 2, "the tiny tokenizer's split changed: rework `want`"
    status, plain, _ = serve(proxy, "e0", {"model": "m", "messages": USER}, out)
    assert json.loads(plain)["choices"][0]["message"]["content"] == text, plain
    status, raw, _ = serve(proxy, "e0", {"model": "m", "messages": USER, "stream": True, "logprobs": True}, out)
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]", raw
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    content = [c["delta"]["content"] for c in chunks if "content" in c["delta"]]
    assert content == want, f"{len(content)} chunks: {content}"
    assert chunks[0]["delta"]["role"] == "assistant" and chunks[-1]["finish_reason"] == "stop", chunks[-1]
    lps = [len(c["logprobs"]["content"]) for c in chunks if "content" in c["delta"]]
    assert lps == [1] * 16 + [2, 1, 1, 2], f"tokens per chunk: {lps}"  # é's two bytes; the stop token goes last

    call = '<tool_call>{"name": "sh", "arguments": {"cmd": "ls"}}</tool_call>'
    out = reply_ids(tok, "look " + call)
    _, plain, _ = serve(proxy, "e0", {"model": "m", "messages": USER, "tools": TOOLS}, out)
    msg = json.loads(plain)["choices"][0]["message"]
    _, raw, _ = serve(proxy, "e0", {"model": "m", "messages": USER, "tools": TOOLS, "stream": True}, out)
    chunks = [json.loads(e)["choices"][0] for e in sse_events(raw)[:-1]]
    said = "".join(c["delta"].get("content") or "" for c in chunks)
    calls = [tc for c in chunks for tc in c["delta"].get("tool_calls") or []]
    look = [tok.decode([t]) for t in tok.encode("look", add_special_tokens=False)]
    assert [c["delta"]["content"] for c in chunks if "content" in c["delta"]] == look, chunks
    assert said == msg["content"] == "look" and len(chunks) == len(look) + 2, chunks  # then the call, the finish
    strip = [{k: v for k, v in tc.items() if k not in ("index", "id")} for tc in calls]
    assert strip == [{k: v for k, v in tc.items() if k != "id"} for tc in msg["tool_calls"]], calls
    assert [tc["id"] for tc in calls] == ["call_e0_4_0"], "request 4's call keeps its id"
    assert chunks[-1]["finish_reason"] == "tool_calls", chunks[-1]
