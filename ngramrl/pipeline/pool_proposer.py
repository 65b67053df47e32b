"""The vLLM proposer that drafts from the Ray drafter pool instead of a history in the engine.

    speculative_config={"method": "custom_class", "num_speculative_tokens": k,
                        "model": "ngramrl.pipeline.pool_proposer.PoolProposer"}

Settings arrive in ``NGRAMRL_POOL`` (``PoolSettings`` as JSON). Each engine step sends every
request's committed tokens to the shard that owns its prompt (one call per shard, all shards at
once). While the target verifies, the shards look up the next drafts of the likeliest outcomes;
when the real outcome was among them, the next draft is ready without waiting for the pool.
Otherwise the proposer waits for the shard's answer up to ``draft_timeout_ms`` and drafts
nothing for a row whose answer is late or whose shard failed. Drafts only ever propose, so the
committed tokens are the same whatever the pool does.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ngramrl.config import PrefetchConfig
from ngramrl.core.batch import DraftingCore, make_core
from ngramrl.core.drafter import EMPTY, Draft
from ngramrl.core.outcome import DraftFollower
from ngramrl.core.rows import DraftBatch
from ngramrl.engine.sources import StepRows
from ngramrl.engine.vllm_proposer import NgramRLProposer
from ngramrl.pipeline.pool import PoolSettings, StepItem, StepReply, shard_of

POOL_ENV = "NGRAMRL_POOL"
POOL_PROPOSER = "ngramrl.pipeline.pool_proposer.PoolProposer"
MAX_FINISHED = 65536  # ended request ids kept for a shard that is down


@dataclass
class PoolRequest:
    req_id: str
    prompt_id: str
    prompt: list[int]
    output: list[int]
    shard: int
    synced_with: str | None = None   # the shard actor that knows this request
    verified: int | None = None      # length of the draft sent for verification last step


@dataclass
class PoolClientStats:
    calls: int = 0
    late_rows: int = 0       # rows whose draft did not come back within the timeout
    down_rows: int = 0       # rows whose shard was down (no draft)
    errors: int = 0          # failed calls to a shard
    reconnects: int = 0
    prefetch_late: int = 0   # prefetch answers not back by the next step
    wait_us: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # recent waits only: runs are long


def connect_ray(settings: PoolSettings) -> Any:
    """The engine may run in its own process: join the cluster the pool lives in."""
    import ray

    if not ray.is_initialized():
        ray.init(address=settings.address or "auto", namespace=settings.namespace, log_to_driver=False,
                 include_dashboard=False, configure_logging=False)
    return ray


class PoolProposer(NgramRLProposer):
    """``NgramRLProposer`` drafting from the Ray drafter pool (``PoolSource``)."""

    def _make_source(self) -> PoolSource:
        text = os.environ.get(POOL_ENV)
        if not text:
            raise RuntimeError(f"{POOL_ENV} is not set: PoolProposer drafts from a Ray drafter pool and needs its "
                               "settings (the rollout worker sets them)")
        return PoolSource(PoolSettings.from_json(text), self.config.prefetch, self.drafter_config.stop_tokens, self.k,
                          self.prefetching)


class CoreObserver:
    """A followed draft's outcome, learned by a drafting core's calibration."""

    def __init__(self, core: DraftingCore) -> None:
        self.core = core

    def observe(self, probs: list[float], accepted: int) -> None:
        self.core.observe(probs, [0, len(probs)], [accepted])


class PoolSource:
    """The Ray drafter pool's client as the proposer's draft source. The shards hold the history
    (and snapshot it themselves: ``DrafterPool.snapshot``); the acceptance calibration is learned
    here, by following every draft the shards send (cut ones too). ``stop_tokens``: this engine's
    end-of-sequence tokens (the shards may not know them); ``k``: the most draft tokens a step
    verifies per request; ``prefetch``: the forward leaves time for the shards' prefetch."""

    core = None
    offloads = False  # the shards' work runs in their actors whatever the proposer does

    def __init__(self, settings: PoolSettings, calibration: PrefetchConfig, stop_tokens: tuple[int, ...], k: int,
                 prefetch: bool) -> None:
        self.settings = settings
        self.ray = connect_ray(settings)
        from ray.exceptions import RayError

        self.ray_error = RayError
        self.stop_tokens = frozenset(stop_tokens)
        self.k = k
        self.prefetch = prefetch
        # The acceptance calibration and the choice of draft lengths are a drafting core's, as in
        # the engine's own (native where built); this one holds no history.
        self.acceptance = make_core(prefetch=calibration)
        self.follower = DraftFollower(CoreObserver(self.acceptance))
        shards = len(settings.names)
        self.handles: list[Any | None] = [None] * shards
        self.actor_ids: list[str | None] = [None] * shards
        self.retry_at = [0.0] * shards
        self.finished: list[list[str]] = [[] for _ in range(shards)]  # ended requests each shard may drop
        self.finished_for: list[str | None] = [None] * shards          # the shard actor they are meant for
        self.candidates: dict[str, dict[tuple[int, int], Draft]] = {}
        self.step_refs: list[tuple[int, Any]] = []
        self.prefetch_refs: list[tuple[int, Any]] = []
        self.client = PoolClientStats()

    # -- what the shards cannot do here -------------------------------------------------------

    def export_history(self) -> None:
        return None

    def restore_history(self, history: Any) -> int:
        raise NotImplementedError("the drafter pool's history is restored by DrafterPool.restore")

    def new_batch(self) -> None:
        """Between generate calls the pool may have restarted shards: look for them again now."""
        self.retry_at = [0.0] * len(self.retry_at)

    # -- acceptance -----------------------------------------------------------------------------

    def lengths(self, drafts: DraftBatch, scale: float, fit: tuple[float, ...], min_gain: float, adaptive: bool,
                probe_tokens: int) -> tuple[Any, float, bool, bool]:
        return self.acceptance.lengths(drafts.probs, drafts.offsets, scale, fit, min_gain, adaptive, probe_tokens)

    def followed(self) -> tuple[int, int]:
        return self.follower.resolved, self.follower.accepted

    def calibration_state(self) -> list[list[float]]:
        return self.acceptance.calibration_state()

    def load_calibration_state(self, state: list[list[float]]) -> None:
        self.acceptance.load_calibration_state(state)

    # -- shards -----------------------------------------------------------------------------

    def _handle(self, shard: int) -> Any | None:
        handle = self.handles[shard]
        if handle is not None or time.monotonic() < self.retry_at[shard]:
            return handle
        try:
            handle = self.ray.get_actor(self.settings.names[shard], namespace=self.settings.namespace)
        except ValueError:  # not (yet) restarted by the pool
            self.retry_at[shard] = time.monotonic() + self.settings.retry_after_s
            return None
        self.handles[shard] = handle
        self.actor_ids[shard] = handle._actor_id.hex()
        if self.actor_ids[shard] != self.finished_for[shard]:  # a new actor never knew those requests
            self.finished[shard] = []
            self.finished_for[shard] = self.actor_ids[shard]
        self.client.reconnects += 1
        return handle

    def _shard_failed(self, shard: int) -> None:
        self.client.errors += 1
        self.handles[shard] = None
        self.actor_ids[shard] = None
        self.retry_at[shard] = time.monotonic()  # look the name up again next step (the pool may have restarted it)

    def _get(self, shard: int, ref: Any) -> Any | None:
        try:
            return self.ray.get(ref, timeout=0)
        except self.ray_error:
            self._shard_failed(shard)
            return None

    # -- drafting -----------------------------------------------------------------------------

    def start_many(self, req_ids: list[str], prompt_ids: list[str], prompts: list[list[int]],
                   befores: list[list[int]]) -> list[PoolRequest]:
        shards = len(self.handles)
        return [PoolRequest(req_id, prompt_id, list(prompt), list(before), shard_of(prompt_id, shards))
                for req_id, prompt_id, prompt, before in zip(req_ids, prompt_ids, prompts, befores, strict=True)]

    def finish_many(self, requests: list[PoolRequest], epochs: list[int]) -> None:
        for request in requests:
            finished = self.finished[request.shard]
            finished.append(request.req_id)
            if len(finished) > MAX_FINISHED:  # a shard down for long: the oldest ids are not worth keeping
                del finished[:len(finished) // 2]
            self.candidates.pop(request.req_id, None)
            self.follower.drop(request.req_id)

    def begin_step(self) -> None:
        """Take the prefetch answers that came back during the forward; surface failed calls. (The
        shards hold the history: nothing here waits, the drafting state is always free to use.)"""
        refs = self.step_refs + self.prefetch_refs
        if refs:
            ready, _ = self.ray.wait([ref for _, ref in refs], num_returns=len(refs), timeout=0)
            ready_set = set(ready)
            for shard, ref in self.step_refs:
                if ref in ready_set:
                    self._get(shard, ref)
            for shard, ref in self.prefetch_refs:
                if ref not in ready_set:
                    self.client.prefetch_late += 1
                    continue
                found = self._get(shard, ref)
                for req_id, outcomes in (found or {}).items():
                    self.candidates[req_id] = {(j, b): Draft(tokens, probs, source="prompt")
                                               for j, b, tokens, probs in outcomes}
        self.step_refs, self.prefetch_refs = [], []

    def draft(self, rows: StepRows) -> DraftBatch:
        drafts: list[Draft] = [EMPTY] * len(rows)
        prefetched = [False] * len(rows)
        items: dict[int, list[StepItem]] = {}
        waiting: dict[int, list[int]] = {}
        for i, request in enumerate(rows.requests):
            request: PoolRequest
            committed = rows.sampled(i)
            self.follower.committed(request.req_id, committed)
            k = int(rows.ks[i])
            ready = None
            if k > 0:
                ready = self.candidates.pop(request.req_id, {}).get((len(committed) - 1, committed[-1]))
            handle = self._handle(request.shard)
            if handle is None:
                request.synced_with = None
                request.output.extend(committed)
                self.client.down_rows += k > 0 and ready is None
                continue
            item = StepItem(request.req_id, request.prompt_id, committed, k, verified=request.verified,
                            hit=ready is not None)
            if request.synced_with != self.actor_ids[request.shard]:
                item.prompt, item.before = request.prompt, list(request.output)
                request.synced_with = self.actor_ids[request.shard]
            request.output.extend(committed)
            items.setdefault(request.shard, []).append(item)
            if ready is not None:
                drafts[i] = self._usable(ready, k)
                prefetched[i] = True
            elif k > 0:
                waiting.setdefault(request.shard, []).append(i)
        refs: dict[int, Any] = {}
        for shard, shard_items in items.items():
            handle = self.handles[shard]
            refs[shard] = handle.step.remote(shard_items, self.finished[shard])
            self.finished[shard] = []
            self.client.calls += 1
        if waiting:
            self._wait_for_drafts(rows, drafts, refs, waiting)
        self.step_refs = [(shard, ref) for shard, ref in refs.items() if shard not in waiting]
        for req_id, draft in zip(rows.req_ids, drafts, strict=True):
            if draft.tokens:
                self.follower.offer(req_id, draft)
        return DraftBatch.from_drafts(drafts, prefetched)

    def _usable(self, draft: Draft, k: int) -> Draft:
        """At most ``k`` tokens, and nothing after this engine's end-of-sequence tokens: the shards
        may have been started without them (OpenRLHF's launch does not know the tokenizer)."""
        end = next((i + 1 for i, token in enumerate(draft.tokens[:k]) if token in self.stop_tokens), k)
        return draft.truncated(end)

    def _wait_for_drafts(self, rows: StepRows, drafts: list[Draft], refs: dict[int, Any],
                         waiting: dict[int, list[int]]) -> None:
        begin = time.perf_counter()
        pending = [refs[shard] for shard in waiting]
        ready, _ = self.ray.wait(pending, num_returns=len(pending), timeout=self.settings.draft_timeout_ms / 1000)
        self.client.wait_us.append((time.perf_counter() - begin) * 1e6)
        ready_set = set(ready)
        for shard, indices in waiting.items():
            if refs[shard] not in ready_set:
                self.client.late_rows += len(indices)
                continue
            replies: list[StepReply] | None = self._get(shard, refs[shard])
            if replies is None:  # the call failed: the shard is down
                self.client.down_rows += len(indices)
                continue
            by_id = {reply.request_id: reply for reply in replies}
            for i in indices:
                request: PoolRequest = rows.requests[i]
                reply = by_id.get(request.req_id)
                if reply is None:
                    continue
                if not reply.known:
                    request.synced_with = None  # the shard was replaced: send the whole request next step
                    continue
                drafts[i] = self._usable(Draft(reply.tokens, reply.probs, source="prompt"), int(rows.ks[i]))

    def end_step(self, rows: StepRows, sent: DraftBatch, looked_up: bool, prefetch_next: bool,
                 offload: bool = True) -> None:
        chosen = rows.prefetched(looked_up)
        prefetched = [True] * len(rows) if chosen is None else chosen.tolist()
        by_shard: dict[int, tuple[list[str], list[int]]] = {}
        for request, length, ahead in zip(rows.requests, np.diff(sent.offsets).tolist(), prefetched, strict=True):
            request: PoolRequest
            request.verified = length
            if ahead and self.handles[request.shard] is not None:
                req_ids, lengths = by_shard.setdefault(request.shard, ([], []))
                req_ids.append(request.req_id)
                lengths.append(length)
        if not (self.prefetch and prefetch_next):
            return
        for shard, (req_ids, lengths) in by_shard.items():
            handle = self.handles[shard]
            if handle is not None:
                self.prefetch_refs.append((shard, handle.prefetch.remote(req_ids, self.k, lengths)))

    def stats(self) -> dict[str, Any]:
        import statistics

        client = self.client
        return {"pool_calls": client.calls, "pool_late_rows": client.late_rows, "pool_down_rows": client.down_rows,
                "pool_errors": client.errors, "pool_reconnects": client.reconnects,
                "pool_prefetch_late": client.prefetch_late,
                "pool_wait_us_median": statistics.median(client.wait_us) if client.wait_us else None}
