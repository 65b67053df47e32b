"""The adaptive fan-out prefetcher for asyncio loops.

While the target verifies draft d, the CPU predicts the likely outcomes (j, b) and looks up the
next draft for each in advance, on worker threads behind the ``LookupWorker`` interface. (The
engine proposer and the drafter pool prefetch with the batched core instead:
``ngramrl.core.batch``, docs/native.md.) When the real outcome arrives, a finished lookup for it is the next
draft; anything else (not predicted, still running, failed) falls back to the ordinary lookup.

Prefetched and ordinary lookups are the same function of the same index and the same tokens
(``NgramDrafter.lookup``), so a hit returns exactly the draft the ordinary lookup would have made:
prefetching changes when a draft is computed, never which draft, and never a committed token.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from ngramrl.config import PrefetchConfig
from ngramrl.core.drafter import Draft, NgramDrafter, RequestState
from ngramrl.core.estimate import Source
from ngramrl.core.outcome import AcceptanceCalibration, Outcome, plan_outcomes


class LookupWorker(Protocol):
    async def lookup(self, request: RequestState, after: list[int], k: int) -> Draft: ...


class ThreadLookupWorker:
    """Runs the drafter's lookup on a thread pool."""

    def __init__(self, drafter: NgramDrafter, executor: Executor | None = None, workers: int = 2) -> None:
        self.drafter = drafter
        self.executor = executor or ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ngramrl-prefetch")

    async def lookup(self, request: RequestState, after: list[int], k: int) -> Draft:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.drafter.lookup, request, k, after)


@dataclass
class PrefetchStats:
    steps: int = 0
    hits: int = 0
    dispatched: int = 0
    failed: int = 0
    late: int = 0
    # Per request per step: predicting outcomes and allocating the budget (and, for ``Prefetcher``,
    # starting the lookups); recent steps only, runs are long.
    plan_ns: deque[int] = field(default_factory=lambda: deque(maxlen=4096))

    @property
    def coverage(self) -> float:
        return self.hits / self.steps if self.steps else 0.0


@dataclass
class _Pending:
    draft: Draft
    k: int
    tasks: dict[tuple[int, int], asyncio.Task]


def _retrieve(task: asyncio.Future) -> None:
    """Mark a failed lookup's exception as seen: a failed prefetch is a miss, not an error."""
    if not task.cancelled():
        task.exception()


def choose_outcomes(drafter: NgramDrafter, sent: list[tuple[RequestState, Draft]], calibration: AcceptanceCalibration,
                    config: PrefetchConfig, last_cut: float = 0.0) -> tuple[dict[str, list[Outcome]], float]:
    """The outcomes to prefetch, per request id, for drafts just sent for verification: the
    outcome model's likeliest (j, b) for each (above ``config.plan_floor`` x ``last_cut``, the last
    prefetch's cut), then the budget allocator across the batch; and this prefetch's cut
    (``budget_cut``): ``plan_outcomes``, as the batched cores plan."""
    planned: dict[str, tuple[list[Source], Draft]] = {}
    for request, draft in sent:
        index = drafter.index(request) if request.known and config.budget else None
        if index is None:
            continue
        drafter.catch_up(request, index)
        planned[request.request_id] = (drafter.outcome_sources(request), draft)
    return plan_outcomes(planned, calibration, config, last_cut)


class Prefetcher:
    def __init__(self, drafter: NgramDrafter, config: PrefetchConfig | None = None,
                 worker: LookupWorker | None = None, calibration: AcceptanceCalibration | None = None) -> None:
        self.drafter = drafter
        self.config = config or PrefetchConfig()
        self.worker = worker or ThreadLookupWorker(drafter, workers=self.config.workers)
        self.calibration = calibration or AcceptanceCalibration(self.config.prior_strength,
                                                                self.config.calibration_decay)
        self.stats = PrefetchStats()
        self._pending: dict[str, _Pending] = {}
        self._last_cut = 0.0

    def dispatch(self, batch: list[tuple[RequestState, Draft, int]]) -> None:
        """Drafts (request, draft, k) were just sent for verification: start lookups for their
        likeliest outcomes."""
        begin = time.perf_counter_ns()
        requests = {request.request_id: (request, draft, k) for request, draft, k in batch}
        chosen, self._last_cut = choose_outcomes(self.drafter,
                                                 [(request, draft) for request, draft, _ in requests.values()],
                                                 self.calibration, self.config, self._last_cut)
        for rid, (request, draft, k) in requests.items():
            self.cancel(rid)
            tasks = {}
            for outcome in chosen.get(rid, []):
                after = draft.tokens[:outcome.accepted] + [outcome.token]
                task = asyncio.ensure_future(self.worker.lookup(request, after, k))
                task.add_done_callback(_retrieve)
                tasks[outcome.key] = task
            self._pending[rid] = _Pending(draft, k, tasks)
            self.stats.dispatched += len(tasks)
        self.stats.plan_ns.append((time.perf_counter_ns() - begin) // max(1, len(requests)))

    def next_draft(self, request: RequestState, accepted: int, emitted: int) -> tuple[Draft, bool]:
        """The outcome is known: commit it and return the next draft (prefetched on a hit)."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            raise KeyError(f"no draft of request {request.request_id!r} was dispatched")
        draft = pending.draft
        tokens = draft.tokens[:accepted] + [emitted]
        self.drafter.commit(request, tokens)
        self.calibration.observe(draft.probs, accepted)
        self.stats.steps += 1
        task = pending.tasks.pop((accepted, emitted), None)
        result: Draft | None = None
        if task is not None:
            if not task.done():
                self.stats.late += 1
            elif task.cancelled() or task.exception() is not None:
                self.stats.failed += 1
            else:
                result = task.result()
        for other in pending.tasks.values():
            other.cancel()
        hit = result is not None
        if hit:
            self.stats.hits += 1
        else:
            result = self.drafter.lookup(request, pending.k)
        self.drafter.absorb(request)
        return result, hit

    def cancel(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            for task in pending.tasks.values():
                task.cancel()
