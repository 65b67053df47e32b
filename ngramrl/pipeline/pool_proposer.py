"""The vLLM proposer whose history comes from the Ray drafter pool instead of its own rollouts.

    speculative_config={"method": "custom_class", "num_speculative_tokens": k,
                        "model": "ngramrl.pipeline.pool_proposer.PoolProposer"}

Settings arrive in ``NGRAMRL_POOL`` (``PoolSettings`` as JSON). The engine drafts, prefetches and
learns acceptance in its own drafting core, as ``NgramRLProposer`` does, so an engine step costs
what it costs without the pool. The history is the pool's: the engine holds copies of the windows
of the prompts it runs and brings a prompt's copy up to date from the shard that owns it (the
rollouts it lacks, ``DrafterShard.sync``; one call per shard for many prompts) when a generate
call names its prompts (``new_batch``, before the first step), or else when a request starts with
no sibling running here (that step waits up to ``sync_wait_ms``; a later answer enters at a later
step). Until then, and while a shard is down, a prompt drafts from the copy it has. Finished
requests are not added here (the driver adds the finished rollouts to the pool; the next sync
brings them); their tokens serve their siblings until then, while a sibling may still run (one
runs here, or the generate call names the prompt). Drafts only ever propose, so the committed
tokens are the same whatever the pool does.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ngramrl.config import DrafterConfig, NgramRLConfig
from ngramrl.engine.sources import CoreSource
from ngramrl.engine.vllm_proposer import NgramRLProposer
from ngramrl.pipeline.pool import PoolSettings, ShardHandles, Synced, apply_sync, copies_held, shard_of

POOL_ENV = "NGRAMRL_POOL"
POOL_PROPOSER = "ngramrl.pipeline.pool_proposer.PoolProposer"


@dataclass
class PoolClientStats:
    calls: int = 0           # sync calls sent
    synced_prompts: int = 0  # prompts whose copy a sync brought up to date
    late: int = 0            # sync answers not back by the next step (they enter when they come)
    down_prompts: int = 0    # prompts left with the copy they had: their shard was down or its call failed
    errors: int = 0          # failed calls to a shard
    sync_us: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # ask to applied, recent ones
    batch_sync_us: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # new_batch's syncs


def connect_ray(settings: PoolSettings) -> Any:
    """The engine may run in its own process: join the cluster the pool lives in."""
    import ray

    if not ray.is_initialized():
        ray.init(address=settings.address or "auto", namespace=settings.namespace, log_to_driver=False,
                 include_dashboard=False, configure_logging=False)
    return ray


class PoolProposer(NgramRLProposer):
    """``NgramRLProposer`` whose history is the Ray drafter pool's (``PoolSource``)."""

    def _make_source(self) -> PoolSource:
        text = os.environ.get(POOL_ENV)
        if not text:
            raise RuntimeError(f"{POOL_ENV} is not set: PoolProposer drafts from a Ray drafter pool's history and "
                               "needs its settings (the rollout worker sets them)")
        return PoolSource(PoolSettings.from_json(text), self.config, self.drafter_config, self.k, self.prefetching,
                          self.budget_grows, self.draft_threads, self.prefetch_cores)


@dataclass
class _Sync:
    shard: int
    ref: Any
    prompts: dict[str, list[int]]  # the prompts asked for, with their tokens
    asked_at: float
    late: bool = False


class PoolSource(CoreSource):
    """The drafting core in the engine process (``CoreSource``) holding copies of the pool's
    windows of the prompts this engine runs. The shards hold the history and save it
    (``DrafterPool.save``); the acceptance calibration is learned here."""

    def __init__(self, settings: PoolSettings, config: NgramRLConfig, drafter: DrafterConfig, k: int,
                 background: bool, budget_grows: bool = False, threads: int = 1,
                 cores: Collection[int] = ()) -> None:
        super().__init__(config, drafter, k, background, budget_grows, threads, cores)
        self.settings = settings
        self.ray = connect_ray(settings)
        self.ray_error = self.ray.exceptions.RayError
        self.shards = ShardHandles(settings, self.ray)
        self.synced: dict[str, Synced] = {}       # each copy here: as of which sync
        self.live: dict[str, int] = {}            # live requests per prompt here
        self.prompt_of: dict[int, str] = {}       # core handle -> prompt id
        self.asked: set[str] = set()              # prompts with a sync in flight
        self.current: set[str] = set()            # prompts synced for this generate call
        self.named: set[str] = set()              # prompts this generate call runs
        # Prompts whose index may hold outputs of requests that ended here. The core's token cap
        # does not count those, so they stay only while a sibling may draft from them.
        self.lingering: set[str] = set()
        self.syncs: list[_Sync] = []
        self.client = PoolClientStats()

    # -- what the shards do instead -------------------------------------------------------------

    def export_history(self) -> None:
        return None

    def restore_history(self, history: Any) -> int:
        raise NotImplementedError("the drafter pool's history is restored by DrafterPool.restore")

    def new_batch(self, prompts: dict[str, list[int]] | None = None) -> None:
        """A generate call starts. The pool may have restarted shards: look for them again now.
        ``prompts`` (id -> prompt tokens; the driver adds rollouts only between generate calls):
        their copies are brought up to date and indexed now, before the first step (waiting up to
        ``batch_sync_s``: a shard that hangs delays the call that long, then its prompts' answers
        enter at a later step), and count as current until the next call (their requests start
        without a sync). Prompts it does not name, with no request running here, let go of the
        outputs of their requests that ended (``finish_many``)."""
        # The pool rebuilds a shard that died (or hung) under its name between generate calls, and
        # a handle to the lost actor would fail every sync of this call: look every shard up again.
        self.shards.look_up_all()
        self.current = set()
        self.named = set(prompts or ())
        self._let_go_of_ended(self.lingering - self.named - set(self.live))
        if prompts:
            begin = time.perf_counter()
            self._sync(prompts, self.settings.batch_sync_s)
            self.core.build_indexes()
            # not the prompts whose answers are late: those enter when they come, and a request of
            # such a prompt starting after that asks again
            self.current = set(prompts) - self.asked
            self.client.batch_sync_us.append((time.perf_counter() - begin) * 1e6)

    # -- shards -------------------------------------------------------------------------------

    def _shard_failed(self, shard: int) -> None:
        self.client.errors += 1
        self.shards.failed(shard)

    # -- requests -----------------------------------------------------------------------------

    def start_many(self, req_ids: list[str], prompt_ids: list[str], prompts: list[list[int]],
                   befores: list[list[int]]) -> list[int]:
        """Each prompt with no sibling running here (its copy may be behind the pool) is synced
        with its shard (the answers waited for up to ``sync_wait_ms``); then the requests start in
        the core."""
        self._sync({prompt_id: prompt for prompt_id, prompt in zip(prompt_ids, prompts, strict=True)
                    if not self.live.get(prompt_id) and prompt_id not in self.current},
                   self.settings.sync_wait_ms / 1000)
        handles = super().start_many(req_ids, prompt_ids, prompts, befores)
        for handle, prompt_id in zip(handles, prompt_ids, strict=True):
            self.live[prompt_id] = self.live.get(prompt_id, 0) + 1
            self.prompt_of[handle] = prompt_id
        return handles

    def finish_many(self, requests: list[int], epochs: list[int]) -> None:
        """The requests end without becoming rollouts here (the pool gets them from the driver, and
        the next sync brings them). Their tokens stay in their prompt's index while a sibling may
        draft from them: one running here, or one the generate call names and may still start
        (until the next call's ``new_batch``). The last request of any other prompt ends taking
        them all out: the prompt's next request syncs first, and the sync brings them from the pool."""
        prompt_ids = [self.prompt_of.pop(handle) for handle in requests]
        for prompt_id in prompt_ids:
            left = self.live[prompt_id] - 1
            if left:
                self.live[prompt_id] = left
            else:
                del self.live[prompt_id]
        kept = [prompt_id in self.live or prompt_id in self.named for prompt_id in prompt_ids]
        lingering = [handle for handle, keep in zip(requests, kept, strict=True) if keep]
        if lingering:
            self.core.finish_many(lingering, None, linger=True)
        if len(lingering) < len(requests):
            # a request ending without lingering drops its prompt's index (rebuilt from the window
            # alone at the prompt's next lookup), with every ended output in it
            self.core.finish_many([handle for handle, keep in zip(requests, kept, strict=True) if not keep], None)
        for prompt_id, keep in zip(prompt_ids, kept, strict=True):
            if keep:
                self.lingering.add(prompt_id)
            else:
                self.lingering.discard(prompt_id)

    def _let_go_of_ended(self, prompt_ids: set[str]) -> None:
        """The outputs of requests that ended here leave these prompts' indexes (none of their
        requests runs): each index is rebuilt from the window alone at the prompt's next lookup."""
        if prompt_ids:
            self.core.drop_ended(sorted(prompt_ids))
            self.lingering.difference_update(prompt_ids)

    def _sync(self, prompts: dict[str, list[int]], wait_s: float) -> None:
        """Ask the shards what the copies of ``prompts`` (id -> prompt tokens; those asked already
        excepted) lack, one call per shard, and wait up to ``wait_s`` for these answers (those in by
        then enter the core, with any earlier answer that came meanwhile). Answers still out from
        earlier calls are not waited for: a slow shard would hold up every later call that long."""
        by_shard: dict[int, dict[str, list[int]]] = {}
        for prompt_id, prompt in prompts.items():
            if prompt_id not in self.asked:
                by_shard.setdefault(shard_of(prompt_id, len(self.shards)), {})[prompt_id] = prompt
        refs = [ref for shard, asked in by_shard.items() if (ref := self._ask(shard, asked)) is not None]
        if refs and wait_s > 0:
            try:
                self.ray.wait(refs, num_returns=len(refs), timeout=wait_s)
            except self.ray_error:  # Ray itself failing: what came back is taken, the rest later or never
                self.client.errors += 1
            self._take_answers()

    def _ask(self, shard: int, prompts: dict[str, list[int]]) -> Any | None:
        """Send the shard its sync call; its answer's ref, None where the shard is down."""
        handle = self.shards.get(shard)
        if handle is None:
            self.client.down_prompts += len(prompts)
            return None
        try:
            ref = handle.sync.remote(list(prompts), copies_held(self.core, self.synced, list(prompts)))
        except self.ray_error:
            self._shard_failed(shard)
            self.client.down_prompts += len(prompts)
            return None
        self.client.calls += 1
        self.asked.update(prompts)
        self.syncs.append(_Sync(shard, ref, prompts, time.perf_counter()))
        return ref

    # -- steps --------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """After the core's own (``CoreSource.begin_step``): the sync answers that came back enter
        the core; none is waited for."""
        super().begin_step()
        self._take_answers()

    def _take_answers(self) -> None:
        if not self.syncs:
            return
        try:
            ready, _ = self.ray.wait([sync.ref for sync in self.syncs], num_returns=len(self.syncs), timeout=0)
        except self.ray_error:  # generation never stops for the pool: the answers wait for a later step
            self.client.errors += 1
            return
        ready_set = set(ready)
        waiting = []
        for sync in self.syncs:
            if sync.ref not in ready_set:
                self.client.late += not sync.late
                sync.late = True
                waiting.append(sync)
                continue
            self.asked.difference_update(sync.prompts)
            try:
                incarnation, updates = self.ray.get(sync.ref, timeout=0)
            except self.ray_error:
                self._shard_failed(sync.shard)
                self.client.down_prompts += len(sync.prompts)
                continue
            self.client.synced_prompts += apply_sync(self.core, self.synced, incarnation, sync.prompts, updates)
            # a rollout stored for a prompt, or its window replaced, drops its index with the ended outputs
            self.lingering.difference_update(prompt_id for prompt_id, update in zip(sync.prompts, updates, strict=True)
                                             if update is not None and (update[1] or update[2]))
            self.client.sync_us.append((time.perf_counter() - sync.asked_at) * 1e6)
        self.syncs = waiting
        if len(self.synced) > 2 * len(self.core) + 1024:  # prompts the core's token cap let go of
            known = set(self.core.prompt_ids())
            self.synced = {prompt_id: copy for prompt_id, copy in self.synced.items() if prompt_id in known}

    def stats(self) -> dict[str, Any]:
        import statistics

        client = self.client
        return {**super().stats(), "pool_calls": client.calls, "pool_synced_prompts": client.synced_prompts,
                "pool_late_syncs": client.late, "pool_down_prompts": client.down_prompts,
                "pool_errors": client.errors, "pool_reconnects": self.shards.reconnects,
                "pool_sync_us_median": statistics.median(client.sync_us) if client.sync_us else None,
                "pool_batch_sync_us_median": (statistics.median(client.batch_sync_us) if client.batch_sync_us
                                              else None)}
