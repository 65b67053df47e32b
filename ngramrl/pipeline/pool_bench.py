"""``ngramrl bench-steps --method ngramrl-pool``: a simulated engine whose proposer is the rollout
workers' ``PoolProposer``, drafting from the copies it syncs from a new drafter pool (docs/pipeline.md,
"What the pool costs an engine step"). The pool is the pipeline's, so its start lives here and the
caller hands it to the benchmark (``PoolBench(start=start_pool_engine)``)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import ray

from ngramrl.bench.steps import PoolBench, VirtualClock, Workload
from ngramrl.core.trace import Rollout
from ngramrl.engine.standin import standin_vllm_config
from ngramrl.pipeline.pool import DrafterPool
from ngramrl.pipeline.pool_proposer import POOL_ENV, PoolProposer


def start_pool_engine(workload: Workload, k: int, config: Any, clock: VirtualClock, pool: PoolBench,
                      ) -> tuple[Any, Callable[[Any, list[Rollout]], None], Callable[[], None]]:
    """``PoolProposer`` drafting from a new drafter pool of ``pool.shards`` actors (on a local Ray
    instance unless one is running), how the history reaches the pool, and how the pool (and that
    Ray instance) is let go of."""
    started = not ray.is_initialized()
    namespace = f"ngramrl-bench-{uuid.uuid4().hex[:8]}"
    if started:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local instance for this run alone
        ray.init(num_cpus=os.cpu_count() or 1, namespace=namespace, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    snapshots = tempfile.mkdtemp(prefix="ngramrl-bench-pool-")
    drafters = DrafterPool(pool.shards, config, tuple(workload.eos_token_ids), namespace=namespace,
                           snapshot_dir=snapshots, name_prefix=namespace, num_cpus=0, sync_wait_ms=pool.sync_wait_ms)
    settings = drafters.settings()
    previous = os.environ.get(POOL_ENV)
    os.environ[POOL_ENV] = settings.to_json()  # how PoolProposer finds its pool, as in a rollout worker
    try:
        proposer = PoolProposer(standin_vllm_config(k, workload.eos_token_ids, device_type="cuda"), config=config,
                                clock=clock)
    finally:
        if previous is None:
            os.environ.pop(POOL_ENV, None)
        else:
            os.environ[POOL_ENV] = previous

    def close() -> None:
        drafters.shutdown()
        if started:
            ray.shutdown()
        shutil.rmtree(snapshots, ignore_errors=True)

    # the pool takes the history; the engine copies it when the phase's generate call starts
    return proposer, lambda _, rollouts: drafters.add_rollouts(rollouts), close
