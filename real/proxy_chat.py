"""Chat requests to token ids and generated ids back to chat replies, exactly: the text side of the model proxy.

What it models: an OpenAI-style chat request (messages, tools) is rendered with the served model's chat
template (a transformers tokenizer, gyre.real.chat) into the token ids the engine is sent, and the ids the
engine generated are decoded into the reply the harness sees (text and tool calls). Three rules keep the
ids exact, so every request of an execution prefix-matches the ids the model actually saw:

- every message's content is rendered as a sentinel and encoded on its own: template text with the
  tokenizer's special tokens, harness content with `split_special_tokens` (a harness or a tool cannot forge
  a chat marker or a stop token);
- an assistant message the proxy itself answered (found by one of its tool-call ids, else by its exact text)
  is replaced by the exact ids the engine generated for it (its trailing stop token stands for the template's
  end-of-turn marker, which is then not encoded twice): a decode/re-encode round trip never changes what the
  model saw;
- tool-call payloads are cached by call id (`CallCache`) and restored before rendering: a harness that
  re-formats an earlier call's arguments (other spacing, key order) still sends the same history.

The tool-call format the decoder parses is Hermes/Qwen's: `<tool_call>{"name": NAME, "arguments": {...}}
</tool_call>` anywhere in the generated text (one block per call; a block that is not such JSON stays text).
The reply's content is the text outside the blocks; each call gets the id `call_<execution>_<n>_<k>` (request
n of the execution, k-th call) and its arguments as compact JSON. `TOOLS_TEMPLATE` is a small template that
renders tools and tool calls in this format (the tests' tiny tokenizer uses it).

Simplifications: a template that drops, reorders or rewrites a message's content (so a sentinel does not appear
once, in order) is rendered as plain text without splicing (a request then branches where it differs); the
template's rewriting of earlier assistant turns (e.g. dropping their reasoning) is not applied to a spliced
turn: the model's own ids are kept.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}{% else %}"
    "{{ c['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatFormatError(ValueError):
    """A request field that cannot be rendered: the message names the field (the proxy's HTTP 400)."""


@dataclass
class Reply:
    """What the harness sees for one generation: text and tool calls (OpenAI's shape)."""

    content: str
    tool_calls: list[dict]
    finish_reason: str  # "stop", "length" or "tool_calls"


@dataclass
class CallCache:
    """One execution's answered replies: tool-call payloads by call id, exact output ids by call id or text."""

    calls: dict[str, dict] = field(default_factory=dict)  # call id -> {"name", "arguments"} as the proxy sent it
    ids_by_call: dict[str, list[int]] = field(default_factory=dict)  # call id -> the reply's generated ids
    ids_by_text: dict[str, list[int]] = field(default_factory=dict)  # a call-less reply's content -> its ids

    def remember(self, reply: Reply, ids: list[int]) -> None:
        for c in reply.tool_calls:
            self.calls[c["id"]] = dict(c["function"])
            self.ids_by_call[c["id"]] = list(ids)
        if not reply.tool_calls:
            self.ids_by_text.setdefault(reply.content, list(ids))

    def restore(self, message: dict) -> dict:
        """`message` with each tool call the proxy issued carrying its original payload."""
        calls = message.get("tool_calls") or []
        if not any(isinstance(c, dict) and c.get("id") in self.calls for c in calls):
            return message
        fixed = [{**c, "function": dict(self.calls[c["id"]])} if c.get("id") in self.calls else c for c in calls]
        return {**message, "tool_calls": fixed}

    def exact_ids(self, message: dict) -> list[int] | None:
        """The generated ids of an assistant message the proxy answered (None: not one of its replies)."""
        for c in message.get("tool_calls") or []:
            if isinstance(c, dict) and c.get("id") in self.ids_by_call:
                return self.ids_by_call[c["id"]]
        if not message.get("tool_calls"):
            return self.ids_by_text.get(_text(message.get("content"), "content"))
        return None


def _text(content, where: str) -> str:
    """A message's content as text: a string, None, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatFormatError(f"{where}[{i}]: only text parts are served ({{'type': 'text', 'text': str}})")
            out.append(part["text"])
        return "".join(out)
    raise ChatFormatError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}")


def check_messages(messages) -> None:
    """A ChatFormatError naming the first bad field of a request's `messages` and their tool calls."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages: expected a non-empty list of messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError(f"{where}: expected an object")
        if m.get("role") not in ROLES:
            raise ChatFormatError(f"{where}.role: expected one of {', '.join(ROLES)}, got {m.get('role')!r}")
        _text(m.get("content"), f"{where}.content")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise ChatFormatError(f"{where}.tool_calls: only an assistant message has a list of tool calls")
        for k, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            ok = isinstance(fn, dict) and isinstance(fn.get("name"), str)
            if not (ok and isinstance(fn.get("arguments"), (str, dict))):
                raise ChatFormatError(f"{where}.tool_calls[{k}].function: expected {{'name': str, 'arguments': str}}")


def check_tools(tools) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ChatFormatError("tools: expected a list")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str)):
            raise ChatFormatError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': str, ...}}}}")


class ChatCodec:
    """Renders requests into ids and decodes replies with one transformers tokenizer (see the module docstring)."""

    def __init__(self, tok) -> None:
        self.tok = tok  # a transformers tokenizer with a chat template
        if not tok.chat_template:
            raise ValueError("the served model's tokenizer has no chat template")
        if tok.eos_token_id is None:
            raise ValueError("the served model's tokenizer has no eos token")
        self.stop = [int(tok.eos_token_id)]
        self._stop_text = {s: tok.decode([s]) for s in self.stop}

    def render(self, messages: list[dict], tools: list | None, cache: CallCache) -> list[int]:
        """The ids of the conversation up to the generation prompt (a ChatFormatError names a bad field)."""
        check_messages(messages)
        check_tools(tools)
        sents, fill, plain, marked = [], [], [], []
        for i, m in enumerate(messages):
            m = cache.restore(m) if m["role"] == "assistant" else m
            plain.append({**m, "content": _text(m.get("content"), f"messages[{i}].content")})
            exact = cache.exact_ids(m) if m["role"] == "assistant" else None
            sents.append(f"\x00GYRE{i}\x00")
            if exact is not None:
                fill.append(("ids", exact))
                marked.append({"role": "assistant", "content": sents[-1]})
            else:
                fill.append(("text", plain[-1]["content"]))
                marked.append({**plain[-1], "content": sents[-1]})
        text = self._apply(marked, tools)
        pieces = re.split("(\x00GYRE\\d+\x00)", text)
        if pieces[1::2] != sents:  # the template dropped, repeated or reordered a message: plain text
            return self._encode(self._apply(plain, tools))
        ids = self._encode(pieces[0])
        for (kind, val), tail in zip(fill, pieces[2::2]):
            if kind == "ids":
                ids += val
                end = self._stop_text.get(val[-1]) if val else None
                if end and tail.startswith(end):
                    tail = tail[len(end):]
            else:
                ids += self.tok.encode(val, add_special_tokens=False, split_special_tokens=True)
            ids += self._encode(tail)
        return ids

    def _apply(self, messages, tools) -> str:
        try:
            return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's (jinja raises many kinds)
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ChatFormatError(f"messages: the chat template cannot render them: {why}") from None

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) if text else []

    def pieces(self, ids: list[int], content: str) -> list[tuple[str, int]]:
        """The reply's `content` cut where its tokens end, for streaming: (text, end) pairs, `end` the number of
        `ids` the pieces up to this one cover; the texts concatenate to `content` exactly. A cut falls after token
        k where the first k tokens decode to a prefix of `content` that does not end in a partial character (a
        byte-level token holding half of one decodes to U+FFFD: it joins the next piece); tokens past the last
        cut (tool-call blocks, the stop token) go with the remainder, which is the last piece (possibly empty)."""
        out, done, cut = [], 0, 0
        for k in range(1, len(ids) + 1):
            at = max(0, cut - 4)  # a few tokens of context before the last cut: decoders that strip a leading space
            base = self.tok.decode(ids[at:cut], skip_special_tokens=True)
            head = self.tok.decode(ids[at:k], skip_special_tokens=True)
            new = head[len(base):] if head.startswith(base) else None
            if new is None or new.endswith("\ufffd"):
                continue  # half a character so far: it joins the next token
            if not content.startswith(new, done):
                break  # the content left the decoded text (a tool-call block was cut out): the rest is one piece
            if new:
                out.append((new, k))
                done, cut = done + len(new), k
        rest = content[done:]
        if rest or not out:
            out.append((rest, len(ids)))
        else:
            out[-1] = (out[-1][0], len(ids))
        return out

    def decode(self, ids: list[int], execution: str, n: int, max_new: int) -> Reply:
        """The reply of generated `ids` (the n-th request of `execution`, at most `max_new` tokens)."""
        stopped = bool(ids) and ids[-1] in self.stop
        text = self.tok.decode(ids, skip_special_tokens=True)
        calls, kept = [], []
        last = 0
        for m in CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                continue
            args = obj.get("arguments", {})
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append({"id": f"call_{execution}_{n}_{len(calls)}", "type": "function",
                          "function": {"name": obj["name"], "arguments": args if isinstance(args, str)
                                       else json.dumps(args, separators=(",", ":"))}})
        kept.append(text[last:])
        finish = "tool_calls" if calls else ("stop" if stopped or len(ids) < max_new else "length")
        return Reply(content="".join(kept).strip() if calls else text, tool_calls=calls, finish_reason=finish)
