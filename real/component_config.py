"""The real backend's component configs: the cluster (batch shape, task, weight route), the actor pool, the
trainer workers and the tool workers.

Plain frozen dataclasses that validate their own fields and import no Ray: building any real config (a preset,
gyre.real.config; a TOML file, gyre.real.config_file) needs no Ray, only the actors and the cluster that use them
do (gyre.real.backend, gyre.real.pool, gyre.real.trainer, gyre.real.tools re-export their config from here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gyre.faults import parse_faults
from gyre.hardware import check_fill, check_move_at
from gyre.real.nn.model import TinyLlamaConfig
from gyre.real import task as T
from gyre.real.collective import CollectiveConfig
from gyre.real.engine_torch import TorchEngineConfig
from gyre.real.task_api import DEFAULT_TASK
from gyre.trajectory.sample import SamplingConfig

WEIGHT_SYNC = ("object_store", "collective")


@dataclass(kw_only=True, frozen=True)
class ToolConfig:
    workers: int = 2  # tool worker actors
    max_inflight: int = 64  # calls running at once over all workers
    timeout_s: float = 60.0  # per attempt
    retries: int = 1  # further attempts after a timeout or a lost worker
    # further evaluations of a group whose scoring failed (for some of its executions); what still fails after
    # them leaves training (gyre.real.verify)
    eval_retries: int = 1

    def __post_init__(self) -> None:
        for name in ("workers", "max_inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"ToolConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"ToolConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.retries < 0:
            raise ValueError(f"ToolConfig.retries must be >= 0, got {self.retries}")
        if isinstance(self.eval_retries, bool) or not isinstance(self.eval_retries, int) or self.eval_retries < 0:
            raise ValueError(f"ToolConfig.eval_retries must be an integer >= 0, got {self.eval_retries!r}")


@dataclass(kw_only=True, frozen=True)
class TrainerConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    max_pack_tokens: int = 512
    normalization: str = "sequence"
    # which paths train (gyre.trajectory.sample): "exact" every branch, or "roles" role-bounded with j_max
    sampling: SamplingConfig = SamplingConfig()
    clip: float = 0.2
    grad_clip: float = 1.0
    epochs: int = 2  # optimizer steps per batch (PPO-style; the clipped ratio bounds each move)
    # trust region (PPO's target-KL early stop): before each epoch after the first, if the weights have moved
    # the batch's log-probs by more than this (mean |change| per trained token since the step began), the
    # step ends there (0: never)
    max_drift: float = 0.0
    threads: int = 1
    device: str = "cpu"  # "cuda": the worker's Ray GPU (its gradient all-reduce then needs backend "nccl")
    # compute dtype: "bfloat16" runs forward and backward under torch.autocast; weights, gradients and AdamW
    # state stay fp32 (the master copy), so the update is the fp32 update of bf16-computed gradients
    dtype: str = "float32"
    grad_checkpointing: bool = False  # recompute each decoder layer in the backward instead of keeping activations
    # tokens per forward/backward: packs are concatenated up to this budget, gradients accumulate over the
    # micro-batches (0: one pack per micro-batch)
    micro_batch_tokens: int = 4096
    logprob_chunk: int = 1024  # trained rows per log-softmax chunk (full-vocabulary logits never for a whole pack)
    # "sdpa": boolean ancestor mask (T^2 bytes a micro-batch); "flex": FlexAttention BlockMask built from the tree
    # (O(T + (T / 128)^2), CUDA only)
    attention: str = "sdpa"
    # "dp": every rank of a step holds the whole model and AdamW state (replicas, gradients all-reduced);
    # "fsdp": FSDP2 over the step's ranks (gyre.real.fsdp), re-sharded whenever the step's ranks change
    sharding: str = "dp"
    offload: bool = True  # fsdp on CUDA: shards, gradients and AdamW state in host memory (CPUOffloadPolicy)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"TrainerConfig.dtype = {self.dtype!r}: expected 'float32' or 'bfloat16' (float16 "
                             f"would need loss scaling)")
        if self.sharding not in ("dp", "fsdp"):
            raise ValueError(f"TrainerConfig.sharding = {self.sharding!r}: expected 'dp' or 'fsdp'")
        if self.attention not in ("sdpa", "flex"):
            raise ValueError(f"TrainerConfig.attention = {self.attention!r}: expected 'sdpa' or 'flex'")
        if self.attention == "flex" and self.device == "cpu":
            raise ValueError("TrainerConfig.attention = 'flex': FlexAttention has no backward on CPU (use 'sdpa')")
        if self.micro_batch_tokens < 0 or self.logprob_chunk < 1:
            raise ValueError(f"TrainerConfig: micro_batch_tokens = {self.micro_batch_tokens} must be >= 0 and "
                             f"logprob_chunk = {self.logprob_chunk} >= 1")


@dataclass(kw_only=True, frozen=True)
class PoolConfig:
    """Ray address (None: a local Ray with `local_gpus` logical GPUs) and the actors' shape."""

    n_gpus: int = 4
    gpus_per_engine: int = 1
    address: str | None = None
    local_cpus: int = 2
    engine: str = "torch"  # or "vllm" (gyre.real.engine_vllm)
    # the trained (and, by the torch engine, served) model: a model folder of any causal LM transformers knows
    # (config.json + *.safetensors, gyre.real.nn.hf_folder); "": gyre's TinyLlama of shape `model`, random init
    model_dir: str = ""
    # a family of gyre.real.nn.hf_folder.write_tiny_model ("qwen3", "qwen2", "llama"): when model_dir does not exist
    # yet, the run first writes a tiny random-init model of that family there (vocabulary: model.vocab_size; no
    # download; a CPU demo)
    tiny_model: str = ""
    # with tiny_model: a tokenizer folder (e.g. configs/tiny_chat) copied into model_dir beside the tiny model, so
    # the folder holds its own tokenizer and chat template (a text task's model_dir may then name it)
    tiny_tokenizer: str = ""
    model: TinyLlamaConfig = field(default_factory=TinyLlamaConfig)
    engine_config: TorchEngineConfig = field(default_factory=TorchEngineConfig)
    trainer_config: TrainerConfig = field(default_factory=TrainerConfig)
    vllm_model: str = ""  # engine == "vllm": the served model folder ("": model_dir); checked to be the trained one
    # a Llama model directory (config.json + *.safetensors, e.g. vllm_model's): trainer workers start every run
    # from its weights instead of random ones; `model` must be its config (with_init_checkpoint sets both)
    init_checkpoint: str = ""
    vllm_args: tuple[tuple[str, object], ...] = ()  # more gyre.real.engine_vllm.VllmEngineConfig fields
    pg_timeout_s: float = 60.0
    engine_gpu_share: float = 0.5  # one GPU per engine: the engine's share of it, the trainer worker has the rest
    collective: CollectiveConfig = field(default_factory=CollectiveConfig)


@dataclass(kw_only=True, frozen=True)
class RealClusterConfig:
    groups_per_step: int = 4
    group_size: int = 8
    min_train_gpus: int = 1
    kv_capacity: int = 4096  # tokens per engine
    task: Any = field(default_factory=T.TaskConfig)  # the task class's config_class (gyre.real.task_api)
    task_class: str = DEFAULT_TASK  # dotted path of the task (gyre.real.task_api.Task)
    tools: ToolConfig = field(default_factory=ToolConfig)
    first_task: int = 0  # index of the run's first task in the task sequence (a resumed run continues it)
    redraw: tuple[int, ...] = ()  # drawn first, before first_task on (gyre.real.run_state: drawn, never trained)
    normalize_std: bool = True
    seed: int = 0
    max_wall_s: float = 1800.0
    checkpoint: str | None = None  # trainer checkpoint path: saved every `checkpoint_every` steps, resumed from
    # steps between trainer checkpoints (None: 1 with a `checkpoint` path, else none); without a path they go to a
    # temporary file, used only to rebuild a lost trainer state (with none, that replays every step of the run)
    checkpoint_every: int | None = None
    faults: tuple[str, ...] = ()  # injected faults (gyre.faults), e.g. ("kill-engine@1.5", "random-engines:3")
    weight_sync: str = "object_store"  # or "collective": a broadcast from the trainer worker of record
    # the cost estimate policies may read (gyre.estimate): "profile" measures it at start-up on this run's own
    # engine and trainer (gyre.real.profile; the default: the figures are this hardware's and this model's, for
    # a few seconds stated in the output); a path reads a calibration file (`gyre-real calibrate --estimate-out`);
    # "none": no estimate (a policy that reads one stops with one line)
    estimate: str = "profile"
    admission_fill: float = 1.0  # share of KV the admission limit commits (gyre.hardware.admission_limit)
    steps_per_burst: int = 1  # mu: training steps per weight publication (engines serve every mu-th version)
    # streaming steps (gyre.cluster.StepView): GPUs in one training cell (0: min_train_gpus), and the standalone
    # rollout pool's GPUs (the last ones, never training); checked against the pool by gyre.real.config
    cell_gpus: int = 0
    standalone_gpus: int = 0
    # when a decoding execution migrates or parks (as gyre.hardware.CostConfig.move_at): "tool" at its next tool-call
    # boundary; "request": at once, its engine request cancelled and re-issued at the destination (re-prefilled)
    move_at: str = "tool"

    @property
    def move_in_flight(self) -> bool:
        return self.move_at == "request"

    def __post_init__(self) -> None:
        check_move_at(self.move_at, "RealClusterConfig.move_at")
        for name, least in (("steps_per_burst", 1), ("cell_gpus", 0), ("standalone_gpus", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"RealClusterConfig.{name} must be an integer >= {least}, got {v!r}")
        if self.cell_gpus and self.cell_gpus < self.min_train_gpus:
            raise ValueError(f"RealClusterConfig.cell_gpus={self.cell_gpus} cannot hold the core's training state "
                             f"(min_train_gpus={self.min_train_gpus})")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise ValueError(f"RealClusterConfig.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        parse_faults(self.faults)  # a bad spec is a one-line ValueError
        check_fill(self.admission_fill, "RealClusterConfig.admission_fill")
        if not isinstance(self.estimate, str) or not self.estimate:
            raise ValueError(f"RealClusterConfig.estimate must be 'profile', 'none' or a calibration file's path, got "
                             f"{self.estimate!r}")
        if self.weight_sync not in WEIGHT_SYNC:
            raise ValueError(f"RealClusterConfig.weight_sync must be one of {WEIGHT_SYNC}, got {self.weight_sync!r}")
