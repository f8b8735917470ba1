"""The tool service on local Ray: bounded, timed out, retried; a failed call is a ToolError; a dead worker replaced.

Also the sandboxed coding task end to end on local Ray with every policy."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import os
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from gyre.real.task_api import ToolError  # noqa: E402
from gyre.real.tools import ToolConfig, ToolService  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")
ROOT = Path(__file__).parents[1]


@dataclasses.dataclass(frozen=True)
class Sleep:
    s: float
    value: str = "ok"

    async def arun(self):
        await asyncio.sleep(self.s)
        return self.value


@dataclasses.dataclass(frozen=True)
class Blocking:
    s: float

    def run(self):
        t0 = time.time()
        time.sleep(self.s)
        return (t0, time.time())


@dataclasses.dataclass(frozen=True)
class Boom:
    def run(self):
        raise ValueError("bad input to the tool")


@dataclasses.dataclass(frozen=True)
class DieOnce:
    """Kills its worker process on the first attempt (a marker file says it ran), answers on the second."""

    marker: str

    async def arun(self):
        if not os.path.exists(self.marker):
            Path(self.marker).write_text("died")
            os._exit(1)
        return "second attempt"


class Loop:
    """The part of the real run loop a ToolService needs: Ray futures and timers, on the driver."""

    def __init__(self) -> None:
        self.pending, self.timers, self.seq = {}, [], 0

    def submit(self, ref, fn) -> None:
        self.pending[ref] = fn

    def after(self, s, fn) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (time.monotonic() + s, self.seq, fn))

    def run(self, until, limit: float = 60.0, each=None) -> None:
        t0 = time.monotonic()
        while not until():
            assert time.monotonic() - t0 < limit, "the tool service never answered"
            while self.timers and self.timers[0][0] <= time.monotonic():
                heapq.heappop(self.timers)[2]()
            if each:
                each()
            ready, _ = ray.wait(list(self.pending), timeout=0.02) if self.pending else ([], [])
            for ref in ready:
                fn = self.pending.pop(ref)
                try:
                    val, err = ray.get(ref), None
                except ray.exceptions.RayError as exc:
                    val, err = None, exc
                fn(val, err)


@pytest.fixture(scope="module")
def by_value(local_ray):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def service(cfg: ToolConfig, workers=None):
    loop = Loop()
    return ToolService(cfg, workers if workers is not None else [], loop.submit, loop.after), loop


def call_all(svc, loop, calls, each=None) -> list:
    out = [None] * len(calls)
    for i, c in enumerate(calls):
        svc.call(c, lambda r, i=i: out.__setitem__(i, r))
    loop.run(lambda: all(o is not None for o in out), each=each)
    return out


def test_calls_run_concurrently_within_the_bound(by_value):
    """Blocking calls run in parallel threads of one worker, never more than max_inflight at once (from the
    intervals the calls ran in, on the worker)."""
    svc, loop = service(ToolConfig(workers=1, max_inflight=2, timeout_s=30))
    peak = [0]
    out = call_all(svc, loop, [Blocking(0.3) for _ in range(5)],
                   each=lambda: peak.__setitem__(0, max(peak[0], svc.inflight)))
    assert all(isinstance(o, tuple) for o in out), out
    edges = sorted([(t0, 1) for t0, _ in out] + [(t1, -1) for _, t1 in out], key=lambda e: (e[0], e[1]))
    running = [sum(d for _, d in edges[: i + 1]) for i in range(len(edges))]
    assert max(running) == 2, f"{max(running)} calls ran at once on the worker, the bound is 2"
    assert peak[0] == 2, f"{peak[0]} calls in flight at once on the driver, the bound is 2"


def test_a_raising_and_a_hung_call_are_tool_errors(by_value):
    """A call that raises is a ToolError at once (no retry); a hung one times out on every attempt; the
    others still answer."""
    svc, loop = service(ToolConfig(workers=1, max_inflight=8, timeout_s=0.5, retries=1))
    hang_s = 100.0
    t0 = time.monotonic()
    boom, hung, fine = call_all(svc, loop, [Boom(), Sleep(hang_s), Sleep(0.1, "fine")])
    assert isinstance(boom, ToolError) and "bad input to the tool" in boom.message, boom
    assert isinstance(hung, ToolError) and "timed out after 0.5s (attempt 2 of 2)" in hung.message, hung
    assert fine == "fine", fine
    assert svc.counts["retries"] == 1 and svc.counts["timeouts"] == 2, svc.counts
    # held up = waited for the hung call; the service answers before it would have ended (the time taken
    # beyond the two 0.5 s attempts is a worker's replacement, which a loaded machine stretches past seconds)
    assert time.monotonic() - t0 < hang_s / 2, "the hung call held the service up"


def test_a_worker_killed_mid_call_is_replaced_and_the_call_retried(by_value, tmp_path):
    """A call whose worker process dies mid-call is retried on a replacement worker, which answers it."""
    workers: list = []
    svc, loop = service(ToolConfig(workers=1, max_inflight=4, timeout_s=30, retries=1), workers)
    first = workers[0]
    (out,) = call_all(svc, loop, [DieOnce(str(tmp_path / "marker"))])
    assert out == "second attempt", out
    assert workers[0] is not first and svc.counts["replaced"] == 1, "the dead worker was not replaced"
    assert ray.get(workers[0].ping.remote()), "the replacement answers"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """Where the shipped config's tiny Qwen3 and its tokenizer are written on first use (not in the repo)."""
    return tmp_path_factory.mktemp("models") / "tiny-qwen3-chat"


def code_cfg(folder, policy_steps: int = 1):
    """configs/sandbox_code_cpu.toml on 2 logical GPUs, one group of 2 per step, its model folder at `folder`."""
    from gyre.real.config_file import load_config

    cfg = load_config(ROOT / "configs" / "sandbox_code_cpu.toml")
    assert cfg.pool.model_dir == cfg.cluster.task.model_dir, "the task's tokenizer is the model folder's"
    task = dataclasses.replace(cfg.cluster.task, problems=str(ROOT / "configs" / "code_problems.jsonl"),
                               model_dir=str(folder), max_new_tokens=16)
    pool = dataclasses.replace(cfg.pool, n_gpus=2, model_dir=str(folder), tiny_tokenizer=str(ROOT / cfg.pool.tiny_tokenizer))
    return dataclasses.replace(cfg, steps=policy_steps, pool=pool, cluster=dataclasses.replace(
        cfg.cluster, groups_per_step=1, group_size=2, task=task))


@pytest.mark.parametrize("policy", ["colocate", "async", "elastic"])
def test_the_coding_task_runs_on_ray_with_every_policy(local_ray, model_folder, policy):
    """Every policy runs the sandboxed coding task on the shipped config's tiny Qwen3 (written on first use with
    its tokenizer): each reply run in the sandbox on a tool worker, scored by its tests, trained on."""
    from gyre.real.pool import ActorPool
    from gyre.real.runner import run_real

    cfg = code_cfg(model_folder, 2)
    r = run_real(cfg, policy, pool=ActorPool.shared(cfg.pool))
    assert len(r.metrics.steps) == 2, f"{policy}: {len(r.metrics.steps)} steps"
    rewards = [x[3] for x in r.log if x[0] == "note" and x[2] == "reward"]
    assert len(rewards) == 4 and all(0.0 <= x["reward"] <= 1.0 for x in rewards), rewards
    calls = r.cluster.tools.counts
    assert calls["calls"] >= 4 and calls["errors"] == 0, f"{policy}: sandbox calls {calls}"
    scored = [x[3]["group"] for x in r.log if x[0] == "note" and x[2] == "scored"]
    assert sorted(scored) == sorted(r.cluster.groups), f"{policy}: groups scored on the tool workers {scored}"
    assert all(x.segs and x.turns >= 1 for x in r.cluster.executions.values()), "every execution generated"


class Killed(RuntimeError):
    """Stands for the run being killed."""


def test_a_killed_run_leaves_its_metrics_and_resumes_with_the_next_prompt(local_ray, model_folder, tmp_path):
    """A run killed after its first step leaves that step's metrics (CSV, JSONL, TensorBoard) and its log on
    disk; rerun from its checkpoint it continues the trainer's version and the task sequence (next prompt); the
    finished run's exported model loads with transformers, with the trainer's logits."""
    from gyre.real.pool import ActorPool
    from gyre.real.runner import run_real

    cfg = code_cfg(model_folder, 3)
    ck = str(tmp_path / "ck" / "trainer.pt")
    (tmp_path / "ck").mkdir()
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, checkpoint=ck))
    pool = ActorPool.shared(cfg.pool)

    def kill(c):
        if c.version >= 1 and not c.live():
            raise Killed("killed after step 1")

    out1 = tmp_path / "run1"
    with pytest.raises(Killed):
        run_real(cfg, "colocate", pool=pool, out=out1, on_tick=kill)
    rows = (out1 / "metrics_colocate.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].startswith("1,1,"), f"metrics on disk after the kill: {rows}"
    assert (out1 / "failed_colocate.txt").read_text().startswith("Killed"), "the error is kept"
    assert list((out1 / "tb" / "colocate").glob("events.out.tfevents.*")), "no TensorBoard event file"
    tasks1 = [x[3] for x in _log(out1) if x[0] == "group"]
    drawn = len(tasks1)
    r2 = run_real(cfg, "colocate", pool=pool, out=tmp_path / "run2", steps=1)
    assert r2.cluster.base_version == 1 and r2.cluster.trainer_version == 2, "the trainer did not resume"
    first = min(g.task_id for g in r2.cluster.groups.values())
    assert first == drawn >= 1, f"resumed at task {first}; the killed run drew {drawn} tasks"
    rows = (tmp_path / "run2" / "metrics_colocate.csv").read_text().splitlines()
    assert rows[1].split(",")[1] == "2", f"resumed step's version: {rows}"
    r3 = run_real(cfg, "colocate", pool=pool, out=out1, steps=1)  # resumed into the same folder: metrics go on
    rows = (out1 / "metrics_colocate.csv").read_text().splitlines()
    assert [r.split(",")[1] for r in rows[1:]] == ["1", "3"], f"metrics of the resumed run: {rows}"
    assert min(g.task_id for g in r3.cluster.groups.values()) > first, "a second resume repeats tasks"
    check_export(out1 / "model" / "colocate", r3, cfg)


def check_export(folder, r, cfg) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gyre.real.nn.hf_folder import load_model

    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = tok.apply_chat_template([{"role": "user", "content": "add one"}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    _, ours = load_model(cfg.pool.model_dir)  # the run's model folder, with the trainer's weights
    ours.load_state_dict({k: v.float() for k, v in r.cluster.trainer_weights().items()}, strict=False)
    with torch.no_grad():
        a, b = hf(ids).logits, ours(ids).logits
    assert torch.allclose(a, b, atol=1e-4), f"exported logits differ by {(a - b).abs().max():.2e}"
    assert hf.config.model_type == "qwen3", f"exported {hf.config.model_type}"


def _log(out):
    import json

    return [json.loads(line) for line in (out / "log_colocate.jsonl").read_text().splitlines()]
