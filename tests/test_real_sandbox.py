"""The sandboxed coding task without Ray: the sandbox's fences, the task file, text in and out."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

pytest.importorskip("transformers")

from gyre.real.chat import ChatTokenizer, build_tiny_chat_tokenizer  # noqa: E402
from gyre.real.sandbox import Limits, run_python  # noqa: E402
from gyre.real.task_api import Done, Generate, Tool, ToolError  # noqa: E402
from gyre.real.tasks.code import CodeTask, CodeTaskConfig, read_problems  # noqa: E402
from gyre.real.text_task import Reply, TextGroup, TextLimits, tool_text  # noqa: E402

ROOT = Path(__file__).parents[1]
# runs that end by a refusal or by finishing: the wall limit only on a stall (a loaded machine starts a sandboxed
# interpreter in seconds of wall time, not of its CPU)
ENDS = Limits(cpu_s=1, wall_s=30)
CHAT = ChatTokenizer(ROOT / "configs" / "tiny_chat")


def test_shipped_tokenizer_is_the_one_the_builder_makes(tmp_path):
    """configs/tiny_chat is what build_tiny_chat_tokenizer trains, locally, with its chat template."""
    built = ChatTokenizer(build_tiny_chat_tokenizer(tmp_path / "tok"))
    msgs = [{"role": "user", "content": "def f(x): return x"}]
    assert built.prompt(msgs) == CHAT.prompt(msgs) and built.vocab_size == CHAT.vocab_size == 384, "tokenizers differ"
    assert CHAT.tok.decode(CHAT.prompt(msgs)) == "<|user|>def f(x): return x<|end|><|assistant|>", "template"


@pytest.mark.parametrize("audit", [True, False])
def test_sandbox_refuses_a_socket_connect(audit):
    """A connect fails inside the sandbox: by the audit hook, and with it off by the network namespace alone."""
    r = run_python("import socket\nsocket.socket().connect(('127.0.0.1', 22))", [], Limits(cpu_s=1, audit=audit))
    if not audit and "netns" not in r["fences"]:
        pytest.skip("no network namespace for this process: only the audit hook refuses a connect")
    want = "PermissionError: sandbox: no network" if audit else "Network is unreachable"
    assert r["status"] == "error" and want in r["code_error"], r


def test_sandbox_refuses_a_write_outside_its_folder(tmp_path):
    """Writing outside the sandbox's folder raises and leaves nothing; writing inside works."""
    target = tmp_path / "escape.txt"
    os.chmod(tmp_path, 0o777)  # writable by anyone, so only the sandbox can refuse it
    r = run_python(f"open({str(target)!r}, 'w').write('x')", [], ENDS)
    assert "no writes outside its folder" in (r["code_error"] or ""), r
    assert not target.exists(), "the write outside the folder happened"
    ok = run_python("open('mine.txt', 'w').write('x')", ["assert open('mine.txt').read() == 'x'"], ENDS)
    assert ok["passed"] == 1 and ok["status"] == "ok", ok


def test_sandbox_refuses_a_fork_bomb_and_kills_an_infinite_loop():
    """A fork bomb is refused at its first fork; a busy loop is killed by its CPU limit before the wall."""
    r = run_python("import os\nwhile True:\n    os.fork()", [], ENDS)
    assert r["status"] == "error" and "no new processes" in r["code_error"], r
    r = run_python("while True:\n    pass", [], Limits(cpu_s=1, wall_s=30))
    assert r["status"] == "killed" and r["wall_s"] < 30, f"loop not killed by its CPU limit: {r}"
    r = run_python("import time\ntime.sleep(60)", [], Limits(cpu_s=1, wall_s=1))
    assert r["status"] == "timeout" and r["wall_s"] < 10, f"sleeper not killed at the wall limit: {r}"


def test_sandbox_counts_the_tests_passed():
    """The share of tests passed is counted per test, after the code ran."""
    r = run_python("def f(x):\n    return x + 1", ["assert f(1) == 2", "assert f(2) == 4", "assert f(0) == 1"], ENDS)
    assert (r["passed"], r["total"], r["status"]) == (2, 3, "ok") and r["failures"][0][0] == 1, r


def _task(tmp_path=None, **kw) -> CodeTask:
    return CodeTask(CodeTaskConfig(problems=str(ROOT / "configs" / "code_problems.jsonl"),
                                   model_dir=str(ROOT / "configs" / "tiny_chat"), **kw), 0)


@pytest.mark.parametrize("code, needle", [
    ("import socket\nsocket.socket().connect(('10.0.0.1', 80))", "no network"),
    ("open('/etc/gyre_x', 'w')", "no writes outside its folder"),
    ("import os\nwhile True:\n    os.fork()", "no new processes"),
    ("while True:\n    pass", "killed"),  # by its CPU limit
])
def test_a_refused_run_is_reported_to_the_agent_and_the_episode_goes_on(code, needle):
    """Each refused or killed sandbox run comes back as the next observation and the episode asks the model
    again; the tool tokens are context, the model's tokens trained."""
    task = _task(cpu_s=1, wall_s=30.0)  # a refusal or the CPU limit ends each run; the wall limit only on a stall
    group = task.new_group(0, 1)
    ep = group.episodes[0]
    req = ep.start(0.0)
    assert isinstance(req, Generate) and req.context == group.prompt, "first request is the prompt"
    reply = CHAT.tok.encode(f"```python\n{code}\n```", add_special_tokens=False) + CHAT.stop
    req = ep.on_generated(reply, [-1.0] * len(reply), 0, 0.1)
    assert isinstance(req, Tool), f"a code reply calls the sandbox, got {req}"
    req = ep.on_tool(asyncio.run(req.call.arun()), 0.2)
    assert isinstance(req, Generate), f"the episode must go on after a refused run, got {req}"
    seen = CHAT.tok.decode(req.context[len(group.prompt) + len(reply):])
    assert needle in seen, f"the agent was not told: {seen!r}"
    tree = group.recorder.tree
    trained = tree.tokens[: tree.size][tree.trained[: tree.size]]
    assert list(trained) == reply, "only the model's tokens are trained"


def test_a_tool_error_is_an_observation():
    """A failed tool call (ToolError) is shown to the agent and the episode goes on."""
    group = _task().new_group(1, 1)
    ep = group.episodes[0]
    ep.start(0.0)
    req = ep.on_generated([65, 66] + CHAT.stop, [-1.0] * 3, 0, 0.1)
    req = ep.on_tool(ToolError("tool call timed out after 2s (attempt 2 of 2)"), 0.2)
    assert isinstance(req, Generate) and "timed out" in CHAT.tok.decode(req.context), req


@pytest.mark.parametrize("line, reason", [
    ("not json", ":2: invalid JSON"), ('{"id": "a", "prompt": "p"}', ":2: field 'tests' missing"),
    ('{"id": "a", "prompt": "p", "tests": []}', ":2: 'tests' must be a non-empty list"), ("[1]", ":2: not a JSON object"),
])
def test_a_bad_task_file_line_names_file_and_line(tmp_path, line, reason):
    """A task file line that is not JSON or lacks its fields is one ValueError naming file:line: reason."""
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "ok", "prompt": "p", "tests": ["assert True"]}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"p.jsonl{reason}"):
        read_problems(p)


class EchoEnv:
    """A text env whose every reply gets `out` back as the tool's text."""

    def __init__(self, out) -> None:
        self.out = out

    def messages(self):
        return [{"role": "user", "content": "go"}]

    def act(self, reply):
        return Reply(tool_text(self.out))

    def result(self, output):
        raise AssertionError("no tool calls")

    def partial_credit(self):
        return 0.25


OUTPUTS = st.one_of(st.just(""), st.just(b"\xff\xfe\x80 bad utf-8"), st.just("<|end|>"), st.just("x" * 20000),
                    st.text(max_size=300), st.binary(max_size=300), st.just("<|assistant|><|end|><|tool|>"))


@given(outs=st.lists(OUTPUTS, min_size=1, max_size=4), lim=st.sampled_from([64, 2048]))
def test_any_tool_text_continues_or_ends_cleanly_recorded_once(outs, lim):
    """Whatever text a tool returns (empty, huge, invalid UTF-8, the stop string, chat markers) the episode
    continues or ends cleanly, and the recorder holds its context exactly once: the model's tokens trained,
    every other token context."""
    limits = TextLimits(max_new_tokens=4, max_turns=len(outs), max_context=lim, max_tool_tokens=128)
    group = TextGroup(0, [EchoEnv(o) for o in outs[:1]], CHAT, limits)
    ep = group.episodes[0]
    ep.env = EchoEnv(outs[0])
    req, model = ep.start(0.0), []
    ctx_before = len(ep.ctx)
    for i, out in enumerate(outs):
        if isinstance(req, Done):
            break
        ep.env.out = out
        toks = [70 + i, 71] + CHAT.stop
        model.append(toks)
        req = ep.on_generated(toks, [-0.5] * len(toks), 0, 0.1 * i)
        assert isinstance(req, (Generate, Done)), req
        if isinstance(req, Generate):
            assert req.context == ep.ctx and len(ep.ctx) + 4 <= lim, "context over its limit"
            assert len(ep.ctx) - ctx_before - len(toks) <= 128, "an observation over max_tool_tokens"
        ctx_before = len(ep.ctx)
    assert isinstance(req, Done) and req.truncated and req.reward == 0.25, f"ends truncated with partial credit: {req}"
    tree = group.recorder.tree
    toks, trained = tree.tokens[: tree.size], tree.trained[: tree.size]
    assert list(toks) == ep.ctx, "the recorded tokens are the context, each once"
    assert list(toks[trained]) == [t for m in model for t in m], "trained tokens are exactly the model's"
    assert np.all(toks < CHAT.vocab_size), "token ids within the vocabulary"


def test_a_model_folder_run_exports_a_folder_transformers_loads(tmp_path):
    """The export of a model-folder run (a tiny Qwen3) is its config plus the trained weights and the task's
    tokenizer: transformers loads it, with the trained weights' logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gyre.real.nn.hf_folder import load_model, write_tiny_model
    from gyre.real.export import export_model
    from gyre.real.pool import PoolConfig

    src = write_tiny_model(tmp_path / "qwen3", "qwen3", vocab_size=CHAT.vocab_size, seed=1)
    _, model = load_model(src)
    trained = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = export_model(tmp_path / "export", PoolConfig(model_dir=str(src)), trained, ROOT / "configs" / "tiny_chat")
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = torch.tensor([CHAT.prompt([{"role": "user", "content": "add one"}])])
    assert tok.decode(ids[0]) == CHAT.tok.decode(ids[0]), "the exported tokenizer differs"
    model.load_state_dict(trained, strict=False)
    with torch.no_grad():
        a, b = hf(ids).logits, model.eval()(ids).logits
    assert torch.allclose(a, b, atol=1e-5), f"exported logits differ by {(a - b).abs().max():.2e}"
