"""Ray resources of a real run: the GPU placement group and long-lived engine, trainer and tool actors.

What it models: GPUs are Ray resources. The pool reserves the cluster's GPUs as one placement group
of engine-sized bundles ({"GPU": gpus_per_engine} each), so an engine on policy GPUs (g, ..) is an
actor pinned to bundle g // gpus_per_engine: on a multi-node cluster the policy's GPU index names a
real device. Each GPU g also has a trainer worker (gyre.real.trainer), pinned to the same bundle and
holding a Ray GPU share of it: a training step on GPUs G runs data-parallel on the workers of G. Both
roles of a GPU live in it at once, as veRL's colocated workers do, and the policy's role says which is
busy (`engine_gpu_share`):
- one GPU per engine: the engine and the worker hold `1 - share` and `share` of the bundle's GPU, so Ray
  gives both the same device;
- k > 1 GPUs per engine: Ray shares only a single GPU fractionally, so the k workers hold one whole GPU
  each and the engine, pinned to the bundle with no GPU of its own, is shown the workers' devices
  (CUDA_VISIBLE_DEVICES, which Ray then leaves alone).
On a machine without GPUs, `ray.init(num_gpus=N)` gives N logical GPUs and the same code path runs.
Actors are created once and reused across role changes and across runs (an engine's `sleep`/`wake` is
the role switch, as vLLM's sleep mode), because starting a torch process costs seconds; a pool that differs
only in its model (`model_dir`, `init_checkpoint`) or trainer and torch-engine settings keeps them too
(`set_model`). A killed engine
actor is replaced by `respawn` (a new member for the collective groups: `GroupBook.forget`).

Simplifications: tool workers are kept here but managed by gyre.real.tools.ToolService; trainer worker 0 serves the
TCPStore of the collective groups (workers live as long as the pool).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gyre.real.nn.hf_folder import ModelFolderError, check_dtype, check_model_folder, spec_mismatch
from gyre.real.nn.hf_llama import check_hf_llama, config_mismatch
from gyre.real.nn.model import TinyLlamaConfig
from gyre.real.collective import GroupBook
from gyre.real.component_config import PoolConfig
from gyre.real.engine_torch import TorchEngine
from gyre.real.trainer import Trainer


def with_init_checkpoint(cfg: PoolConfig, path: str) -> PoolConfig:
    """`cfg` whose trainers start from the Llama model directory `path`, with the model config read from it."""
    return replace(cfg, init_checkpoint=str(Path(path).resolve()), model=check_hf_llama(path))


def check_init_checkpoint(cfg: PoolConfig) -> None:
    """A one-line ValueError unless `init_checkpoint` is a loadable Llama directory of model `cfg.model`."""
    if not cfg.init_checkpoint:
        return
    bad = config_mismatch(cfg.model, check_hf_llama(cfg.init_checkpoint))
    if bad:
        raise ValueError(f"PoolConfig.model differs from init_checkpoint {cfg.init_checkpoint}: {bad} "
                         f"(gyre.real.pool.with_init_checkpoint reads the model from the checkpoint)")


def trained_model(cfg: PoolConfig) -> TinyLlamaConfig | str:
    """What the trainer workers build (and the torch engines serve): the model folder, or TinyLlama's config."""
    return str(Path(cfg.model_dir).resolve()) if cfg.model_dir else cfg.model


def served_model(cfg: PoolConfig) -> str:
    """The folder a vLLM engine serves: vllm_model, else the trained model folder."""
    return cfg.vllm_model or cfg.model_dir


def serve_dtype(cfg: PoolConfig) -> str:
    """The engines' serving dtype: what trainer workers cast their published weights to."""
    return str(dict(cfg.vllm_args).get("dtype", "bfloat16")) if cfg.engine == "vllm" else cfg.engine_config.dtype


def ensure_model_dir(cfg: PoolConfig) -> None:
    """Write the tiny random-init model `tiny_model` names into `model_dir` (with the tokenizer of `tiny_tokenizer`)
    unless a folder is there already."""
    if not cfg.tiny_model:
        return
    if not cfg.model_dir:
        raise ValueError("PoolConfig.tiny_model needs model_dir: the folder the tiny model is written to")
    if not Path(cfg.model_dir).exists():
        from gyre.real.nn.hf_folder import write_tiny_model

        from gyre.real.export import TOKENIZER_FILES

        tok = [Path(cfg.tiny_tokenizer) / f for f in TOKENIZER_FILES] if cfg.tiny_tokenizer else []
        if cfg.tiny_tokenizer and not any(f.is_file() for f in tok):
            raise ValueError(f"PoolConfig.tiny_tokenizer = {cfg.tiny_tokenizer!r}: no tokenizer files there")
        try:
            write_tiny_model(cfg.model_dir, cfg.tiny_model, vocab_size=cfg.model.vocab_size)
        except ModelFolderError as exc:
            raise ValueError(f"PoolConfig.tiny_model: {exc}") from None
        for f in tok:
            if f.is_file():
                shutil.copyfile(f, Path(cfg.model_dir) / f.name)


def check_models(cfg: PoolConfig) -> None:
    """One ValueError line naming the field unless the trained and served models load and are one network, in
    dtypes their devices run; reads config.json and safetensors headers only, before any actor starts."""
    try:
        if cfg.model_dir and cfg.init_checkpoint:
            raise ValueError("PoolConfig: set model_dir (any transformers causal LM) or init_checkpoint (TinyLlama "
                             "from a Llama folder), not both")
        trained = check_model_folder(cfg.model_dir) if cfg.model_dir else None
        check_dtype(cfg.trainer_config.dtype, cfg.trainer_config.device, field="pool.trainer_config.dtype")
        check_dtype(serve_dtype(cfg), "cpu" if cfg.engine == "torch" else cfg.collective.device,
                    field="pool.engine_config.dtype" if cfg.engine == "torch" else "pool.vllm_args.dtype")
        if cfg.engine != "vllm":
            return
        served = served_model(cfg)
        if not Path(served).is_dir():
            raise ValueError(f"PoolConfig.vllm_model = {served!r}: not a local model folder (the served model is "
                             f"checked against the trained one before any actor starts)")
        if trained is not None:
            bad = spec_mismatch(trained, check_model_folder(served))
        else:  # TinyLlama trained: the served folder must be the Llama it computes
            bad = config_mismatch(cfg.model, check_hf_llama(served))
        if bad:
            raise ValueError(f"PoolConfig: the served model {served} is not the trained one ({bad})")
    except ModelFolderError as exc:
        raise ValueError(str(exc)) from None


def _retargetable(have: PoolConfig, want: PoolConfig) -> bool:
    """Whether a pool of `have` can run `want` by rebuilding its models only (same shape; a vLLM engine serves
    one folder for life)."""
    same = replace(have, init_checkpoint=want.init_checkpoint, model_dir=want.model_dir, tiny_model=want.tiny_model,
                   tiny_tokenizer=want.tiny_tokenizer,
                   trainer_config=want.trainer_config, engine_config=want.engine_config) == want
    return same and (want.engine == "torch" or served_model(have) == served_model(want))


def ensure_ray(cfg: PoolConfig) -> None:
    """Connect to `cfg.address`, or start a local Ray with logical GPUs (idempotent)."""
    if ray.is_initialized():
        return
    if cfg.address:
        ray.init(address=cfg.address, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(num_cpus=cfg.local_cpus, num_gpus=cfg.n_gpus, include_dashboard=False, log_to_driver=False)


_SHARED: dict[PoolConfig, ActorPool] = {}


class ActorPool:
    @classmethod
    def shared(cls, cfg: PoolConfig) -> ActorPool:
        """The live pool of this process for `cfg` (created on first use): warm actors, one placement group."""
        pool = _SHARED.get(cfg)  # PoolConfig is frozen and hashable
        if pool is None and ray.is_initialized():  # only the model or initial weights differ: keep the warm actors
            same = [p for c, p in _SHARED.items() if _retargetable(c, cfg)]
            if same:
                pool = same[0]
                pool.set_model(cfg)
                _SHARED.clear()
                _SHARED[cfg] = pool
        if pool is None or not ray.is_initialized():
            for old in list(_SHARED.values()):  # a different shape: release the GPUs first
                old.shutdown()
            _SHARED.clear()
            pool = _SHARED[cfg] = cls(cfg)
        return pool

    def __init__(self, cfg: PoolConfig) -> None:
        if cfg.engine not in ("torch", "vllm"):
            raise ValueError(f"PoolConfig.engine must be 'torch' or 'vllm', got {cfg.engine!r}")
        if cfg.engine == "vllm" and not served_model(cfg):
            raise ValueError("PoolConfig.vllm_model (or model_dir) must name the served model when engine = 'vllm'")
        if cfg.n_gpus % cfg.gpus_per_engine:
            raise ValueError(f"PoolConfig.n_gpus={cfg.n_gpus} is not a multiple of gpus_per_engine={cfg.gpus_per_engine}")
        if not 0 < cfg.engine_gpu_share < 1:
            raise ValueError(f"PoolConfig.engine_gpu_share must be in (0, 1), got {cfg.engine_gpu_share}")
        check_init_checkpoint(cfg)
        ensure_model_dir(cfg)
        check_models(cfg)
        ensure_ray(cfg)
        have = ray.cluster_resources().get("GPU", 0)
        if have < cfg.n_gpus:
            raise ValueError(f"Ray cluster has {have:g} GPUs, the run needs {cfg.n_gpus}")
        self.cfg = cfg
        k = cfg.gpus_per_engine
        self.pg = placement_group([{"GPU": k} for _ in range(cfg.n_gpus // k)], strategy="PACK")
        if not self.pg.wait(cfg.pg_timeout_s):
            raise TimeoutError(f"placement group of {cfg.n_gpus} GPUs not ready after {cfg.pg_timeout_s}s")
        self._engines: dict[int, ray.actor.ActorHandle] = {}
        self._incarnation: dict[int, int] = {}
        self.respawns = 0
        self.startup_profile = None  # (what was profiled, its CostEstimate, seconds): gyre.real.profile
        worker_gpus = 1 - cfg.engine_gpu_share if k == 1 else 1
        self._worker = ray.remote(num_cpus=0, num_gpus=worker_gpus, concurrency_groups={"sync": 4},
                                  max_restarts=0)(Trainer)
        self.trainers = [self._spawn_trainer(g) for g in range(cfg.n_gpus)]  # one data-parallel worker per GPU
        self.tools: list = []  # tool worker actors (gyre.real.tools), started by the first run's ToolService
        self._devices = [ray.get([t.gpu_ids.remote() for t in self.trainers[s * k:(s + 1) * k]])
                         for s in range(cfg.n_gpus // k)] if k > 1 else []
        for slot in range(cfg.n_gpus // k):  # start every engine process now, in parallel
            self._engines[slot] = self._spawn(slot)
        # a local Ray of one node: every member is on this machine, so the weight-sync store listens on loopback
        self._local = not cfg.address and sum(n["Alive"] for n in ray.nodes()) == 1
        store = ray.get(self.serve_store())
        self.book = GroupBook(store, cfg.collective, ray.get(self.trainers[0].layout.remote()))
        ray.get([e.ping.remote() for e in self._engines.values()] + [t.ping.remote() for t in self.trainers]
                )

    def _spawn_trainer(self, g: int):
        cfg = self.cfg
        init = str(Path(cfg.init_checkpoint).resolve()) if cfg.init_checkpoint else ""
        return self._worker.options(scheduling_strategy=self._bundle(g // cfg.gpus_per_engine)).remote(
            trained_model(cfg), cfg.trainer_config, init_checkpoint=init, serve_dtype=serve_dtype(cfg))

    def serve_store(self):
        """Have trainer worker 0 serve the weight-sync store; an object ref of its (address, port)."""
        return self.trainers[0].serve_store.remote(self.cfg.collective.timeout_s, local=self._local)

    def respawn_trainer(self, g: int):
        """A fresh trainer worker for GPU g (its actor died). Worker 0 serves the collective store: after its
        respawn the caller has it serve a new one (`GroupBook.new_store`)."""
        self.book.forget(f"t{g}")
        self.trainers[g] = self._spawn_trainer(g)
        self.respawns += 1
        return self.trainers[g]

    def set_model(self, cfg: PoolConfig) -> None:
        """Take `cfg` (this pool's shape; another model folder, `init_checkpoint`, trainer or torch-engine settings):
        trainer workers and torch engines build it for later runs (an engine between runs is asleep, so its next
        wake builds it)."""
        if not _retargetable(self.cfg, cfg):
            raise ValueError("set_model: the pool's shape differs; make a new pool")
        check_init_checkpoint(cfg)
        ensure_model_dir(cfg)
        check_models(cfg)
        init = str(Path(cfg.init_checkpoint).resolve()) if cfg.init_checkpoint else ""
        ray.get([t.set_model.remote(trained_model(cfg), init, cfg.trainer_config, serve_dtype(cfg))
                 for t in self.trainers])
        if cfg.engine == "torch":
            ray.get([e.set_model.remote(trained_model(cfg), cfg.engine_config) for e in self._engines.values()])
        self.book.layout = ray.get(self.trainers[0].layout.remote())  # what broadcasts now carry
        self.cfg = cfg

    def _bundle(self, slot: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=slot)

    def _spawn(self, slot: int):
        cfg = self.cfg
        self._incarnation[slot] = self._incarnation.get(slot, -1) + 1
        if cfg.engine == "vllm":
            from gyre.real.engine_vllm import VllmEngine, VllmEngineConfig

            vcfg = VllmEngineConfig(model=served_model(cfg), tensor_parallel_size=cfg.gpus_per_engine, **dict(cfg.vllm_args))
            cls, args = VllmEngine, (vcfg,)
        else:
            cls, args = TorchEngine, (trained_model(cfg), cfg.engine_config)
        opts: dict = {"scheduling_strategy": self._bundle(slot)}
        if cfg.gpus_per_engine == 1:
            opts["num_gpus"] = cfg.engine_gpu_share
        else:  # the bundle's devices, held by its trainer workers
            devices = ",".join(str(d) for ids in self._devices[slot] for d in ids)
            opts["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": devices}}
        actor = ray.remote(num_cpus=0, num_gpus=0, max_concurrency=1000, max_restarts=0)(cls)
        return actor.options(**opts).remote(*args)

    def slot(self, gpus: tuple[int, ...]) -> int:
        return gpus[0] // self.cfg.gpus_per_engine

    def engine(self, gpus: tuple[int, ...]):
        return self._engines[self.slot(gpus)]

    def member(self, gpus: tuple[int, ...]) -> str:
        """The engine of these GPUs as a collective-group member: one name per actor incarnation."""
        slot = self.slot(gpus)
        return f"e{slot}.{self._incarnation[slot]}"

    def kill(self, gpus: tuple[int, ...]) -> None:
        """Fault injection: kill the engine process on these GPUs (no restart)."""
        ray.kill(self.engine(gpus), no_restart=True)

    def respawn(self, gpus: tuple[int, ...]):
        """A fresh engine actor on the slot of a dead one (its bundle's GPUs are free again)."""
        slot = self.slot(gpus)
        self.book.forget(self.member(gpus))
        self._engines[slot] = self._spawn(slot)
        self.respawns += 1
        return self._engines[slot]

    def heal(self) -> list[str]:
        """Replace every dead trainer worker and engine actor (a liveness probe each); returns their names."""
        dead = []
        for g, actor in enumerate(list(self.trainers)):
            try:
                ray.get(actor.ping.remote())
            except ray.exceptions.RayActorError:
                dead.append(f"t{g}")
                self.respawn_trainer(g)
                if g == 0:
                    self.book.new_store(tuple(ray.get(self.serve_store())))
        for slot, actor in list(self._engines.items()):
            try:
                ray.get(actor.ping.remote())
            except ray.exceptions.RayActorError:
                gpus = (slot * self.cfg.gpus_per_engine,)
                dead.append(self.member(gpus))
                self.respawn(gpus)
        return dead

    def shutdown(self) -> None:
        for a in [*self._engines.values(), *self.trainers, *self.tools]:
            ray.kill(a)
        remove_placement_group(self.pg)
