"""A real vLLM serving run, read and checked: the input of `gyre-sim calibrate-engine`.

A run directory holds three files (the layout of LLMServingSim's vLLM validation runs):

- `meta.json`: `model` (a Hugging Face name), `engine_kwargs` (`tensor_parallel_size`,
  `data_parallel_size`, `enable_expert_parallel`, `max_num_seqs`, `max_num_batched_tokens`; optional
  `pipeline_parallel_size`, `dtype`), optionally `kv_cache` (`num_gpu_blocks`, `block_size`,
  `gpu_memory_utilization`) and `hardware.device_name`. The model and GPU presets are resolved from
  these, a config.json beside the run, or flags (gyre.sim.vllm_check.run_presets).
- `requests.jsonl`: one request a line: `input_toks`, `output_toks` and the engine's monotonic
  `queued_ts`, `scheduled_ts`, `first_token_ts`, `last_token_ts` (seconds); `arrival_time` (the
  client's wall clock) is not used: replay starts each request at its `queued_ts`.
- `timeseries.csv` (optional): per second `t`, `running`, `waiting` (and throughputs, KV use).

Every malformed input raises RunError with one line, `file:line: reason` or `file: field: reason`.
`setup` derives the run's own step cost and scheduler arguments, what both replays of it use (the step
loop, gyre.sim.vllm_check.engine_fit; the simulator's engine, gyre.sim.vllm_check.sim_replay).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from gyre.config import ConfigError
from gyre.jsonl import json_objects
from gyre.datasheets import GpuConfig, ModelConfig
from gyre.hardware import engine_roofline
from gyre.roofline import Coefficients, EngineRoofline
from gyre.sim.vllm_check.vllm_scheduler import SchedulerArgs

REQUEST_FIELDS = ("input_toks", "output_toks", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts")


class RunError(ValueError):
    """A malformed run directory; the message is one line naming the file and line or field."""


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """The vLLM engine arguments the replay needs (one replica; `data_parallel` replicas share arrivals)."""

    tensor_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: bool = False  # vLLM's enable_expert_parallel: MoE experts spread over all DP x TP GPUs
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_blocks: int | None = None  # per replica, as vLLM logged it; None: derive from memory
    gpu_memory_utilization: float = 0.9


@dataclass(frozen=True, kw_only=True)
class Requests:
    """Per-request arrays in arrival (queued_ts) order; times in seconds from the first arrival."""

    ids: tuple[str, ...]
    input_toks: np.ndarray
    output_toks: np.ndarray
    queued: np.ndarray
    scheduled: np.ndarray
    first_token: np.ndarray
    last_token: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def e2e(self) -> np.ndarray:
        return self.last_token - self.queued

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.queued

    @property
    def makespan(self) -> float:
        return float(self.last_token.max() - self.queued.min())

    def take(self, idx: np.ndarray) -> Requests:
        return Requests(ids=tuple(self.ids[i] for i in idx), input_toks=self.input_toks[idx],
                        output_toks=self.output_toks[idx], queued=self.queued[idx], scheduled=self.scheduled[idx],
                        first_token=self.first_token[idx], last_token=self.last_token[idx])


@dataclass(frozen=True, kw_only=True)
class Run:
    path: Path
    model: str  # the name the run gives (meta.json's id), else the preset's
    gpu: str
    engine: EngineArgs
    model_cfg: ModelConfig
    gpu_cfg: GpuConfig
    requests: Requests
    timeseries: dict[str, np.ndarray] | None  # column -> values, `t` in seconds from the run's start


def _num(obj: dict, key: str, where: str, *, integer: bool = False, positive: bool = True) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RunError(f"{where}: field {key!r} is {'missing' if v is None else f'not a number ({v!r})'}")
    if integer and v != int(v):
        raise RunError(f"{where}: field {key!r} must be an integer, got {v!r}")
    if positive and v <= 0:
        raise RunError(f"{where}: field {key!r} must be > 0, got {v!r}")
    return int(v) if integer else float(v)


def _flag(obj: dict, key: str, where: str) -> bool:
    v = obj.get(key, False)
    if v is None or isinstance(v, bool):
        return bool(v)
    raise RunError(f"{where}: field {key!r} must be true or false, got {v!r}")


def read_json(path: Path, missing: str = "missing") -> Any:
    """The JSON document in `path`; RunError naming the file (and line) if it is missing, unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RunError(f"{path}: {missing}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise RunError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None


def read_meta(path: Path) -> tuple[str | None, str | None, EngineArgs]:
    """(model id or None, GPU device name or None, engine arguments) from a meta.json."""
    meta = read_json(path, "missing (a run directory holds meta.json, requests.jsonl, timeseries.csv)")
    if not isinstance(meta, dict):
        raise RunError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    model = meta.get("model") or (meta.get("engine_kwargs") or {}).get("model")
    if not isinstance(model, str) or not model:
        model = None
    kw = meta.get("engine_kwargs")
    if not isinstance(kw, dict):
        raise RunError(f"{path}: field 'engine_kwargs' is missing or not an object")
    where = f"{path}: engine_kwargs"
    pp = kw.get("pipeline_parallel_size", 1)
    if pp not in (None, 1):
        raise RunError(f"{where}: field 'pipeline_parallel_size' = {pp!r} is not supported (only 1)")
    kv = meta.get("kv_cache") if isinstance(meta.get("kv_cache"), dict) else {}
    blocks = kv.get("num_gpu_blocks")
    args = EngineArgs(
        tensor_parallel=_num(kw, "tensor_parallel_size", where, integer=True),
        data_parallel=(_num(kw, "data_parallel_size", where, integer=True)
                       if kw.get("data_parallel_size") is not None else 1),
        expert_parallel=_flag(kw, "enable_expert_parallel", where),
        max_num_seqs=_num(kw, "max_num_seqs", where, integer=True),
        max_num_batched_tokens=_num(kw, "max_num_batched_tokens", where, integer=True),
        block_size=_num(kv, "block_size", f"{path}: kv_cache", integer=True) if "block_size" in kv else 16,
        kv_blocks=None if blocks is None else _num(kv, "num_gpu_blocks", f"{path}: kv_cache", integer=True),
        gpu_memory_utilization=(_num(kv, "gpu_memory_utilization", f"{path}: kv_cache")
                                if "gpu_memory_utilization" in kv else 0.9),
    )
    hw = meta.get("hardware") if isinstance(meta.get("hardware"), dict) else {}
    device = hw.get("device_name")
    return model, device if isinstance(device, str) and device else None, args


def read_requests(path: Path) -> Requests:
    """requests.jsonl -> Requests sorted by queued_ts, times shifted so the first arrival is 0."""
    rows: list[tuple[float, ...]] = []
    ids: list[str] = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise RunError(f"{path}: missing (a run directory holds meta.json, requests.jsonl, timeseries.csv)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"{path}: cannot read: {exc}") from None

    def bad(n: int, reason: str) -> None:
        raise RunError(f"{path}:{n}: {reason}")

    for n, rec in json_objects(lines, bad):
        where = f"{path}:{n}"
        vals = [_num(rec, f, where, integer=f.endswith("_toks"), positive=f.endswith("_toks")) for f in REQUEST_FIELDS]
        _, _, q, s, f1, fl = vals
        if s < q:
            raise RunError(f"{where}: scheduled_ts {s} is before queued_ts {q}")
        if f1 < s:
            raise RunError(f"{where}: first_token_ts {f1} is before scheduled_ts {s}")
        if fl < f1:
            raise RunError(f"{where}: last_token_ts {fl} is before first_token_ts {f1}")
        rows.append(tuple(vals))
        ids.append(str(rec.get("request_id", n)))
    if not rows:
        raise RunError(f"{path}: no requests")
    a = np.array(rows, dtype=float)
    order = np.argsort(a[:, 2], kind="stable")
    a = a[order]
    t0 = a[0, 2]
    return Requests(ids=tuple(ids[i] for i in order), input_toks=a[:, 0].astype(np.int64),
                    output_toks=a[:, 1].astype(np.int64), queued=a[:, 2] - t0, scheduled=a[:, 3] - t0,
                    first_token=a[:, 4] - t0, last_token=a[:, 5] - t0)


def read_timeseries(path: Path) -> dict[str, np.ndarray] | None:
    """timeseries.csv -> {column: float array}; None when the file is absent. Needs `t` and `running`."""
    if not path.exists():
        return None
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            cols = reader.fieldnames or []
            for need in ("t", "running"):
                if need not in cols:
                    raise RunError(f"{path}:1: no column {need!r} (columns: {', '.join(cols) or 'none'})")
            data: dict[str, list[float]] = {c: [] for c in cols}
            for n, row in enumerate(reader, 2):
                for c in cols:
                    try:
                        data[c].append(float(row[c]))
                    except (TypeError, ValueError):
                        raise RunError(f"{path}:{n}: column {c!r} is not a number ({row[c]!r})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"{path}: cannot read: {exc}") from None
    return {c: np.array(v) for c, v in data.items()}


def read_run(run_dir: Path, *, model: str | None = None, model_config: Path | None = None,
             gpu: str | None = None) -> Run:
    """Read and check a run directory (see the module docstring); `model`, `model_config` and `gpu` are the
    flags that name the model preset, a Hugging Face config.json and the GPU preset (run_presets)."""
    from gyre.sim.vllm_check.run_presets import resolve_gpu, resolve_model

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: not a directory (a run directory holds meta.json, requests.jsonl, timeseries.csv)")
    meta = run_dir / "meta.json"
    model_id, device, engine = read_meta(meta)
    try:
        model_cfg = resolve_model(meta, model_id, model, model_config)
        gpu_cfg = resolve_gpu(meta, device, gpu)
    except ConfigError as exc:
        raise RunError(str(exc)) from None
    return Run(path=run_dir, model=model_id or model_cfg.name, gpu=gpu or device or gpu_cfg.name, engine=engine,
               model_cfg=model_cfg, gpu_cfg=gpu_cfg, requests=read_requests(run_dir / "requests.jsonl"),
               timeseries=read_timeseries(run_dir / "timeseries.csv"))


def split_by_arrival(n: int, frac: float) -> tuple[np.ndarray, np.ndarray]:
    """(first `frac` of requests by arrival, the rest) as index arrays into arrival-ordered requests."""
    if not 0.0 < frac < 1.0:
        raise RunError(f"--split must be in (0, 1), got {frac}")
    k = min(max(1, int(round(n * frac))), n - 1)
    idx = np.arange(n)
    return idx[:k], idx[k:]


def setup(run: Run, coef: Coefficients) -> tuple[EngineRoofline, SchedulerArgs]:
    """The step cost and scheduler arguments of the run's own GPU, model and engine arguments."""
    model, gpu = run.model_cfg, run.gpu_cfg
    e = run.engine
    coef = replace(coef, gpu_memory_utilization=e.gpu_memory_utilization)
    roof = engine_roofline(model, gpu, e.tensor_parallel, coef, e.max_num_batched_tokens,
                           ep_gpus=e.tensor_parallel * e.data_parallel if e.expert_parallel else 0)
    blocks = e.kv_blocks if e.kv_blocks is not None else roof.kv_capacity_tokens // e.block_size
    if blocks <= 0:
        raise RunError(f"{run.path / 'meta.json'}: {model.name} ({model.infer_weight_bytes / 1e9:.1f} GB of weights) "
                       f"leaves no KV memory on {e.tensor_parallel} x {gpu.name}")
    args = SchedulerArgs(max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                         block_size=e.block_size, kv_blocks=blocks)
    return roof, args
