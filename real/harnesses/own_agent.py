"""A short agent harness of Gyre's own: a standalone program that knows nothing of Gyre but an OpenAI endpoint.

It reads the standard environment (OPENAI_BASE_URL, OPENAI_API_KEY) and its task (GYRE_TASK), and talks plain
HTTP (urllib, standard library only) to /v1/chat/completions, as any harness would. Its loop, for `--turns`
turns: ask the model (offering one `sh` tool), run any tool call it makes (a shell command in the working
folder, with a time limit) and send the result back with the call re-formatted (indented, keys sorted: as
harnesses do), else keep the reply as its solution (`solution.py`); at turn `--subagent-at` spawn a sub-agent
(its own context, role `sub-agent`, then a summary of it, `sub-agent-summary`) whose summary joins the main
context, or with `--parallel N` N of them at once, each in a thread with a context of its own (their calls
overlap); once the history holds more than `--compact-after` messages, summarize it (`main-summary`) and start
over from the system prompt, the task and the summary (a compaction). Every other call is streamed (SSE).
It writes `transcript.jsonl` (one line per call: role, HTTP status, finish reason, whether the reply parsed, its
start and end in epoch seconds) for whoever checks it. Each call asks for `--max-tokens` tokens (24).
`--fault crash|hang[:SUFFIX]` writes `solution.py`, then exits with code 3 or hangs, after its first main call
(fault tests; with SUFFIX only in executions whose GYRE_EXECUTION ends with it; repeatable).
Roles travel as the `X-Gyre-Role` header, and parallel sub-agents' calls say `X-Gyre-Parallel: N` (served
together by Gyre's proxy), headers other servers ignore.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

SYSTEM = "You are a coding agent. Use the sh tool to inspect the folder; answer with Python code."
SH = {"type": "object", "properties": {"cmd": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "sh", "description": "run a shell command", "parameters": SH}}]


class Client:
    def __init__(self, max_tokens: int = 24) -> None:
        self.max_tokens = max_tokens
        self.base = os.environ["OPENAI_BASE_URL"].rstrip("/")
        self.key = os.environ["OPENAI_API_KEY"]
        self.calls = 0
        self.log = open("transcript.jsonl", "a")
        self.lock = threading.Lock()  # parallel sub-agents call from threads

    def chat(self, messages: list[dict], role: str, tools: list | None = None, parallel: int = 1) -> dict:
        with self.lock:
            self.calls += 1
            call = self.calls
        stream = call % 2 == 0
        body = {"model": "policy", "messages": messages, "max_tokens": self.max_tokens, "stream": stream}
        if tools:
            body["tools"] = tools
        req = urllib.request.Request(self.base + "/chat/completions", data=json.dumps(body).encode(), headers={
            "Authorization": f"Bearer {self.key}", "Content-Type": "application/json", "X-Gyre-Role": role,
            **({"X-Gyre-Parallel": str(parallel)} if parallel > 1 else {})})
        t0 = time.time()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                status, raw = r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read().decode()
        t1 = time.time()
        msg, finish = self._parse(raw, stream) if status == 200 else (None, None)
        with self.lock:
            self.log.write(json.dumps({"call": call, "role": role, "status": status, "stream": stream,
                                       "finish": finish, "ok": msg is not None, "s": round(t1 - t0, 4),
                                       "t0": t0, "t1": t1}) + "\n")
            self.log.flush()
        if msg is None:
            raise SystemExit(f"model call {call} failed: HTTP {status}: {raw[:200]}")
        return msg

    @staticmethod
    def _parse(raw: str, stream: bool):
        try:
            if not stream:
                choice = json.loads(raw)["choices"][0]
                return choice["message"], choice["finish_reason"]
            msg, finish = {"role": "assistant", "content": ""}, None
            lines = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
            if not lines or lines[-1] != "[DONE]":
                return None, None
            for ln in lines[:-1]:
                ch = json.loads(ln)["choices"][0]
                msg["content"] += ch["delta"].get("content") or ""
                for c in ch["delta"].get("tool_calls") or []:  # one chunk per call here; indexes say which
                    msg.setdefault("tool_calls", []).append({k: v for k, v in c.items() if k != "index"})
                finish = ch["finish_reason"] or finish
            return msg, finish
        except (ValueError, KeyError, IndexError, TypeError):
            return None, None


def run_tool(call: dict) -> str:
    try:
        cmd = json.loads(call["function"]["arguments"]).get("cmd", "")
        out = subprocess.run(["sh", "-c", str(cmd)], capture_output=True, text=True, timeout=5)
        return (out.stdout + out.stderr)[-500:]
    except Exception as exc:  # noqa: BLE001 - any failure is the tool's answer
        return f"error: {exc}"


def reformat(msg: dict) -> dict:
    """The assistant message as a harness keeps it: arguments re-serialized its own way."""
    calls = []
    for c in msg.get("tool_calls") or []:
        try:
            args = json.dumps(json.loads(c["function"]["arguments"]), indent=1, sort_keys=True)
        except ValueError:
            args = c["function"]["arguments"]
        calls.append({**c, "function": {**c["function"], "arguments": args}})
    return {"role": "assistant", "content": msg.get("content") or "", **({"tool_calls": calls} if calls else {})}


def subagent(client: Client, task: str, k: int, of: int, found: list) -> None:
    """One sub-agent: its own context (which detail of `of`), a call, then its summary into found[k]."""
    detail = f"Detail {k + 1} of {of} of: " if of > 1 else "Detail of: "
    sub = [{"role": "system", "content": "You are a sub-agent. Study one detail."},
           {"role": "user", "content": f"{detail}{task[:80]}"}]
    sub.append(reformat(client.chat(sub, "sub-agent", parallel=of)))
    sub.append({"role": "user", "content": "Summarize your finding."})
    found[k] = client.chat(sub, "sub-agent-summary", parallel=of).get("content") or ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--subagent-at", type=int, default=1)
    ap.add_argument("--compact-after", type=int, default=6)
    ap.add_argument("--parallel", type=int, default=1, help="sub-agents run at once (threads), each its own context")
    ap.add_argument("--max-tokens", type=int, default=24, help="each call's max_tokens")
    ap.add_argument("--fault", action="append", default=[], help="crash|hang[:SUFFIX] (SUFFIX: of GYRE_EXECUTION)")
    a = ap.parse_args()
    me = os.environ.get("GYRE_EXECUTION", "")
    faults = [f.partition(":") for f in a.fault]
    a.fault = next((kind for kind, _, suffix in faults if me.endswith(suffix)), None)
    if a.fault not in (None, "crash", "hang"):
        ap.error(f"--fault: expected crash or hang, got {a.fault!r}")
    task = os.environ.get("GYRE_TASK", "")
    client = Client(a.max_tokens)
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    history = list(base)
    for turn in range(a.turns):
        if turn == a.subagent_at:
            found = [""] * a.parallel
            threads = [threading.Thread(target=subagent, args=(client, task, k, a.parallel, found))
                       for k in range(a.parallel)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for text in found:
                history.append({"role": "user", "content": f"A sub-agent found: {text}"})
        reply = client.chat(history, "main", TOOLS)
        if a.fault:  # work first, then the fault
            with open("solution.py", "w") as f:
                f.write("# written before the fault\n")
            if a.fault == "crash":
                sys.exit(3)
            time.sleep(10**6)
        history.append(reformat(reply))
        if reply.get("tool_calls"):
            for c in reply["tool_calls"]:
                history.append({"role": "tool", "tool_call_id": c["id"], "content": run_tool(c)})
        else:
            with open("solution.py", "w") as f:
                f.write(reply.get("content") or "")
            history.append({"role": "user", "content": "Continue."})
        if len(history) > a.compact_after:
            history.append({"role": "user", "content": "Summarize the work so far."})
            summary = client.chat(history, "main-summary").get("content") or ""
            history = base + [{"role": "user", "content": f"Summary so far: {summary}"}]


if __name__ == "__main__":
    main()
