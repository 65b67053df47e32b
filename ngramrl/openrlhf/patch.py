"""Turning ngramrl on inside OpenRLHF (driver side): the pool, the engine actor, the options."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, fields
from typing import Any

from ngramrl.config import NgramRLConfig, PrefetchConfig
from ngramrl.engine.vllm_proposer import CONFIG_ENV, config_to_env
from ngramrl.pipeline.pool import DrafterPool
from ngramrl.pipeline.pool_proposer import POOL_ENV, POOL_PROPOSER

logger = logging.getLogger(__name__)
WORKER_WRAP = "ngramrl.openrlhf.actor.NgramRLWorkerWrap"


@dataclass
class NgramRLOptions:
    """The ``--ngramrl.*`` options of ``python -m ngramrl.openrlhf``."""

    enable: bool = True                  # false: OpenRLHF exactly as without ngramrl
    num_speculative_tokens: int = 8
    shards: int = 4
    num_cpus_per_shard: float = 1.0
    prefetch_budget: int = 16
    sync_wait_ms: float = 20.0           # a step starting prompts waits this long for their history
    save_dir: str = "ngramrl_pool"       # pool snapshots (the keeper saves every save_every_s)
    save_every_s: float = 600.0
    namespace: str = "ngramrl-openrlhf"

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1 or self.shards < 1:
            raise ValueError("--ngramrl.num_speculative_tokens and --ngramrl.shards must be >= 1")
        if self.save_every_s <= 0 or self.prefetch_budget < 0 or self.sync_wait_ms < 0:
            raise ValueError("--ngramrl.save_every_s must be > 0, prefetch_budget and sync_wait_ms >= 0")


def split_args(argv: list[str]) -> tuple[NgramRLOptions, list[str]]:
    """Separate ``--ngramrl.NAME VALUE`` / ``--ngramrl.NAME=VALUE`` from OpenRLHF's own arguments."""
    known = {f.name: f.type for f in fields(NgramRLOptions)}
    values: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--ngramrl."):
            rest.append(arg)
            i += 1
            continue
        name, has_value, value = arg[len("--ngramrl."):].partition("=")
        if not has_value:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"{arg} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if name not in known:
            raise ValueError(f"unknown option --ngramrl.{name} (known: {', '.join(sorted(known))})")
        values[name] = _parse(name, value, known[name])
    return NgramRLOptions(**values), rest


def _parse(name: str, value: str, kind: Any) -> Any:
    kind = kind if isinstance(kind, str) else kind.__name__
    try:
        if kind == "bool":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        return value
    except ValueError:
        raise ValueError(f"--ngramrl.{name} must be a {kind}, got {value!r}") from None


class PoolKeeper:
    """Saves the pool now and then and restarts shards that died (a daemon thread in the driver)."""

    def __init__(self, pool: DrafterPool, every_s: float) -> None:
        self.pool = pool
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ngramrl-pool-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import time

        last_save = time.monotonic()
        while not self._stop.wait(min(self.every_s, 30.0)):
            try:
                self.pool.heal()
                if time.monotonic() - last_save >= self.every_s:
                    self.pool.save()
                    last_save = time.monotonic()
            except Exception as err:  # noqa: BLE001 - never take the training run down
                logger.warning("ngramrl pool keeper: %s", err)

    def stop(self) -> None:
        self._stop.set()


class _Launcher:
    """Stands in for OpenRLHF's ``RolloutRayActor``: ``.options(...).remote(...)`` builds ngramrl's
    actor with the proposer in its engine arguments and the pool's settings in its environment."""

    def __init__(self, integration: Integration) -> None:
        self.integration = integration

    def options(self, **options: Any) -> Any:
        integration = self.integration
        runtime_env = dict(options.pop("runtime_env", None) or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **integration.engine_env()}
        handle = integration.actor_class.options(runtime_env=runtime_env, **options)
        return _Remote(handle, integration)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.options().remote(*args, **kwargs)


class _Remote:
    def __init__(self, handle: Any, integration: Integration) -> None:
        self.handle = handle
        self.integration = integration

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.update(self.integration.engine_kwargs())
        return self.handle.remote(*args, **kwargs)


class Integration:
    """Install with ``install(options)``; OpenRLHF then creates ngramrl engines wherever it creates engines."""

    def __init__(self, options: NgramRLOptions) -> None:
        self.options = options
        self.pool: DrafterPool | None = None
        self.keeper: PoolKeeper | None = None
        self.config = NgramRLConfig(prefetch=PrefetchConfig(budget=options.prefetch_budget))
        self._original: Any = None
        from ngramrl.openrlhf.actor import remote_actor_class

        self.actor_class = remote_actor_class()

    def ensure_pool(self) -> DrafterPool:
        if self.pool is None:
            options = self.options
            self.pool = DrafterPool(options.shards, self.config, (), namespace=options.namespace,
                                    snapshot_dir=os.path.abspath(options.save_dir),
                                    name_prefix=f"ngramrl-{os.getpid()}", num_cpus=options.num_cpus_per_shard,
                                    sync_wait_ms=options.sync_wait_ms)
            self.keeper = PoolKeeper(self.pool, options.save_every_s)
        return self.pool

    def engine_env(self) -> dict[str, str]:
        pool = self.ensure_pool()
        return {POOL_ENV: pool.settings().to_json(), CONFIG_ENV: config_to_env(self.config)}

    def engine_kwargs(self) -> dict[str, Any]:
        return {"speculative_config": {"method": "custom_class", "model": POOL_PROPOSER,
                                       "num_speculative_tokens": self.options.num_speculative_tokens},
                "worker_extension_cls": WORKER_WRAP, "disable_log_stats": False}

    def install(self) -> None:
        from openrlhf.trainer.ray import vllm_engine

        if self._original is None:
            self._original = vllm_engine.RolloutRayActor
            vllm_engine.RolloutRayActor = _Launcher(self)

    def uninstall(self) -> None:
        from openrlhf.trainer.ray import vllm_engine

        if self._original is not None:
            vllm_engine.RolloutRayActor = self._original
            self._original = None
        if self.keeper is not None:
            self.keeper.stop()
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


def install(options: NgramRLOptions) -> Integration | None:
    """Make OpenRLHF's ``create_vllm_engines`` build ngramrl engines (nothing when disabled)."""
    from ngramrl.openrlhf import check_versions

    if not options.enable:
        return None
    check_versions()
    integration = Integration(options)
    integration.install()
    return integration
