"""The real backend's pieces without Ray: the agent task, the execution state machine, the torch engine."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gyre.real.nn.model import TinyLlamaConfig  # noqa: E402
from gyre.real import task as T  # noqa: E402
from gyre.real.agent import AgentTask  # noqa: E402
from gyre.real.task_api import Done, Generate, Tool  # noqa: E402
from gyre.real.engine_torch import TorchEngine  # noqa: E402
from gyre.real.trainer import Trainer, TrainerConfig  # noqa: E402

CFG = T.TaskConfig(fail_p=0.0, slow_tool_p=0.0)


def group(cfg=CFG, size=1, seed=0):
    g = AgentTask(cfg, seed).new_group(0, size)
    g.executions = g.episodes
    return g


def test_lookup_then_answer_earns_full_reward():
    """LOOKUP, then ANSWER with the looked-up digit, finishes with reward 1 and records both turns."""
    g = group()
    ex = g.executions[0]
    s = g.spec.secret
    req = ex.start(0.0)
    assert isinstance(req, Generate) and req.context == g.prompt, f"first request {req}"
    req = ex.on_generated([T.LOOKUP, T.SEP], [-1.0, -1.0], 0, 0.1)
    assert isinstance(req, Tool) and req.call.name == "lookup", f"expected a tool call, got {req}"
    out = T.run_tool(req.call)
    assert out == [T.RES, T.digit(s), T.SEP], f"lookup returned {out}"
    req = ex.on_tool(out, 0.2)
    assert isinstance(req, Generate) and req.context[-3:] == out, f"tool output not in context: {req}"
    done = ex.on_generated([T.ANSWER, T.digit(s), T.SEP], [-1.0] * 3, 0, 0.3)
    assert done == Done(truncated=False, reward=1.0) and ex.reward == 1.0, f"{done}, reward {ex.reward}"
    assert ex.cursor.status == "finished" and ex.turns == 2, f"status {ex.cursor.status}, turns {ex.turns}"


def test_failed_tool_call_retries_from_before_the_call():
    """A transient tool failure rolls the context back to before the call and records a retry branch."""
    g = group()
    ex = g.executions[0]
    ex.start(0.0)
    before = len(ex.ctx)
    req = ex.on_generated([T.LOOKUP, T.SEP], [-1.0, -1.0], 0, 0.1)
    req = ex.on_tool([T.ERR, T.SEP], 0.2)
    assert isinstance(req, Generate) and len(req.context) == before, f"context not rolled back: {req.context}"
    assert ex.retries == 1 and ("retry" in ex.branch_marks), f"no retry recorded: {ex.branch_marks}"
    assert len(g.recorder.tree.branch_leaf) == 1, "the abandoned attempt must be kept as a branch"


def test_delegate_runs_a_subagent_whose_result_returns_to_the_parent():
    """DELEGATE forks a sub-agent; its LOOKUP result becomes the parent's tool output."""
    g = group()
    ex = g.executions[0]
    ex.start(0.0)
    req = ex.on_generated([T.DELEGATE, T.SEP], [-1.0, -1.0], 0, 0.1)
    assert isinstance(req, Generate) and req.seq != "main" and req.context[-1] == T.SUB, f"sub request {req}"
    req = ex.on_generated([T.LOOKUP, T.SEP], [-1.0, -1.0], 0, 0.2)
    assert isinstance(req, Tool), f"sub-agent lookup should call the tool, got {req}"
    req = ex.on_tool(T.run_tool(req.call), 0.3)
    assert isinstance(req, Generate) and req.seq == "main", f"parent should resume, got {req}"
    assert T.seen_secret(ex.ctx, g.spec.secret), "the sub-agent's result must reach the parent's context"


def test_turn_cap_ends_capped_not_deadline():
    """An execution that reaches max_turns before its deadline ends truncated with the capped code (1)."""
    g = group(T.TaskConfig(max_turns=1, fail_p=0.0))
    ex = g.executions[0]
    ex.start(0.0)
    req = ex.on_generated([T.LOOKUP, T.SEP], [-1.0, -1.0], 0, 0.1)
    done = ex.on_tool(T.run_tool(req.call), 0.2)
    assert done == Done(truncated=True, end=1, reward=0.1), f"expected a turn-cap truncation (finish code 1), got {done}"


def test_context_past_the_limit_is_compacted():
    """Invalid turns grow the context; past context_limit it restarts from a compacted root."""
    cfg = T.TaskConfig(context_limit=8, max_turns=10, fail_p=0.0)
    g = group(cfg)
    ex = g.executions[0]
    ex.start(0.0)
    for i in range(3):
        req = ex.on_generated([T.DIGIT0, T.SEP], [-1.0, -1.0], 0, 0.1 * i)
    assert ("compact" in ex.branch_marks), f"no compaction: {ex.branch_marks}"
    assert req.context[:2] == [T.BOS, T.SUM] and len(req.context) <= 8, f"compacted context {req.context}"
    assert ex.cursor.contexts == 2, f"recorder contexts {ex.cursor.contexts}"


def test_deadline_truncates_with_partial_credit():
    """Past its deadline an execution ends truncated, scored by what it reached (partial credit)."""
    g = group()
    ex = g.executions[0]
    ex.start(0.0)
    req = ex.on_generated([T.LOOKUP, T.SEP], [-1.0, -1.0], 0, 0.1)
    done = ex.on_tool(T.run_tool(req.call), CFG.deadline_s + 1)
    assert done == Done(truncated=True, end=2, reward=CFG.partial_seen), f"expected a deadline truncation (finish code 2), got {done}"
    assert ex.reward == CFG.partial_seen and ex.cursor.status == "truncated", f"reward {ex.reward}"


def _engine(seed=0):
    cfg = TinyLlamaConfig(vocab_size=T.VOCAB_SIZE)
    tr = Trainer(cfg, TrainerConfig(), seed=seed)
    eng = TorchEngine(cfg)
    asyncio.run(eng.wake(tr.weights(), 0))
    return eng


def test_engine_batched_decode_matches_one_at_a_time():
    """Sequences decoded together in one batch get the same tokens as decoded alone (same seeds)."""
    ctxs = [[T.BOS, T.digit(i), T.SEP] + [T.DIGIT0 + j for j in range(i)] for i in range(4)]

    async def together(eng):
        return await asyncio.gather(*[eng.generate(str(i), c, 6, [], 100 + i) for i, c in enumerate(ctxs)])

    async def alone(eng):
        return [await eng.generate(str(i), c, 6, [], 100 + i) for i, c in enumerate(ctxs)]

    a, b = asyncio.run(together(_engine())), asyncio.run(alone(_engine()))
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b], "batching changed sampled tokens"
    np.testing.assert_allclose([r["logprobs"] for r in a], [r["logprobs"] for r in b], atol=1e-4,
                               err_msg="batching changed log-probs")


def test_engine_reuses_cache_and_reprefills_a_moved_context():
    """A follow-up turn prefills only new tokens; the same context on a fresh engine is re-prefilled fully."""
    async def turns(eng, other):
        r1 = await eng.generate("x", [T.BOS, T.digit(3), T.SEP], 3, [T.SEP], 1)
        ctx = [T.BOS, T.digit(3), T.SEP] + r1["tokens"] + [T.RES, T.digit(5), T.SEP]
        r2 = await eng.generate("x", ctx, 3, [T.SEP], 2)
        r3 = await other.generate("x", ctx, 3, [T.SEP], 2)
        return r2, r3

    r2, r3 = asyncio.run(turns(_engine(), _engine()))
    assert r2["prefill_tokens"] == 3, f"follow-up turn prefilled {r2['prefill_tokens']} tokens, expected 3"
    assert r3["prefill_tokens"] > 3, "a moved context must be prefilled in full"
    assert r2["tokens"] == r3["tokens"], "re-prefill on another engine must continue identically"
    np.testing.assert_allclose(r2["logprobs"], r3["logprobs"], atol=1e-4)


def test_trainer_step_raises_good_samples_probability():
    """One trainer step on a group raises the log-prob of the rewarded execution's tokens."""
    cfg = TinyLlamaConfig(vocab_size=T.VOCAB_SIZE)
    tr = Trainer(cfg, TrainerConfig(lr=1e-2), seed=0)
    g = group(size=2)
    good, bad = g.executions
    for ex, toks in ((good, [T.LOOKUP, T.SEP]), (bad, [T.DIGIT0, T.SEP])):
        ex.start(0.0)
        ex.on_generated(toks, [float(np.log(1 / T.VOCAB_SIZE))] * 2, 0, 0.0)
    ids = torch.tensor([g.prompt])
    before = torch.log_softmax(tr.model(ids, torch.arange(3)[None])[0, -1], -1)[T.LOOKUP].item()
    tree = g.recorder.tree
    for ex in g.executions:
        ex.cursor.hit_deadline()
    tr.train([(tree.preorder(), np.array([1.0, -1.0]))])
    after = torch.log_softmax(tr.model(ids, torch.arange(3)[None])[0, -1], -1)[T.LOOKUP].item()
    assert after > before, f"log-prob of the rewarded action fell: {before:.3f} -> {after:.3f}"
    assert tr.version == 1, f"trainer version {tr.version} after one step"


@pytest.mark.parametrize("args, needle", [
    (["run", "--policy", "nope"], "unknown policy"),
    (["run", "--policy", "colocate", "--preset", "huge"], "unknown real preset"),
    (["run", "--policy", "colocate", "--steps", "0"], "--steps must be >= 1"),
])
def test_cli_user_errors_are_one_line(args, needle):
    """A user's mistake exits 2 with one line naming it, before Ray starts."""
    from typer.testing import CliRunner

    from gyre.real.cli import app

    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and needle in res.output, f"exit {res.exit_code}: {res.output}"
    assert "Traceback" not in res.output, "a user error must not print a traceback"


def test_bad_config_file_names_the_field(tmp_path):
    """A TOML config with an unknown field fails with the file and the dotted field name."""
    from gyre.real.config import RealConfigError
    from gyre.real.config_file import load_config

    p = tmp_path / "run.toml"
    p.write_text('preset = "tiny-cpu"\n[cluster.task]\nmax_turn = 3\n')
    with pytest.raises(RealConfigError, match=r"run.toml: unknown field 'cluster.task.max_turn'"):
        load_config(p)


def test_example_gpu_config_parses():
    """configs/real_gpu_example.toml builds a vLLM run config."""
    from pathlib import Path

    from gyre.real.config_file import load_config

    cfg = load_config(Path(__file__).parents[1] / "configs" / "real_gpu_example.toml")
    assert cfg.pool.engine == "vllm" and cfg.pool.n_gpus == 16, f"parsed {cfg.pool}"


def test_tool_plans_depend_only_on_seed_and_execution():
    """An execution's tool latencies and failures are the same whatever order executions call tools in."""
    a, b = group(size=3, seed=5), group(size=3, seed=5)
    fwd = [T.plan_lookup(a.spec, CFG, x.rng) for x in a.executions]
    rev = [T.plan_lookup(b.spec, CFG, x.rng) for x in reversed(b.executions)][::-1]
    assert fwd == rev, "tool plans changed with call order"
    assert len({c.latency_s for c in fwd}) == 3, "executions must draw different latencies"
