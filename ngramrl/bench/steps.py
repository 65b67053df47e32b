"""Engine steps simulated on a trace: proposers driven as vLLM's model runner drives them.

A rollout phase is the requests of one epoch, submitted at once; at most B are in flight, and a
finished request's slot goes to the next one (continuous batching). Each step:

1. The forward verifies each row's draft against the trace: the longest prefix equal to the
   recorded tokens is accepted, then the recorded next token is the target's own; that is what
   exact verification commits, the recorded tokens being what the target sampled. A request that
   joins runs its prefill in this step and samples its first token.
2. The forward takes the time a step-cost model (``StepTimes``, e.g. a ``StepProfile``) gives
   for the step's shape; a synchronous scheduler adds the host's work per step, an asynchronous
   one hides it behind the forward. The simulated clock, from which the proposer's step-cost
   model learns, advances by that much.
3. Meanwhile, for real: a pass over a buffer larger than the caches stands for the forward's
   memory traffic (it leaves the drafter's data out of the caches, as a forward does), and the
   forward's length passes in real time (spinning; ``bench-steps``; ``project`` goes on once the
   drafting core's background is idle, as its runs would otherwise take their simulated time for
   real), during which the drafting core's background work runs (inserts and prefetch, where the
   proposer prefetches on the native core).
4. The proposer is called with each row's committed tokens (vLLM's ``propose`` convention, on
   ``StandInRunner``); its time is measured (real CPU time, on the critical path of a
   synchronous engine) and its drafts go to the next forward.

A phase runs with the objects that exist when it starts frozen out of the cycle collector's
reach, as vLLM's workers freeze their heap once warm (``vllm.utils.gc_utils.freeze_gc_heap``):
the collections the proposer's own allocations trigger then scan what an engine's would, not the
replay's traces.

Both ``ngramrl bench-steps`` (the proposer's time per step) and ``ngramrl project`` (the
rollout phase's simulated time) run on this.
"""

from __future__ import annotations

import gc
import importlib
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ngramrl.bench.replay import accepted_prefix
from ngramrl.core.profile import HostOverhead
from ngramrl.core.trace import MAX_TOKEN_ID, Rollout, Trace
from ngramrl.engine.standin import StandInRunner


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive now collected once and frozen (what vLLM's workers do once warm), for
    as long as the block runs."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class VirtualClock:
    """Simulated time in nanoseconds: it stands still, except while CPU work runs under
    ``running`` (then it moves with real time, times ``cpu_scale``: a CPU that much slower or
    faster than this one) and when ``advance`` adds a simulated span."""

    def __init__(self, cpu_scale: float = 1.0) -> None:
        if cpu_scale < 0:
            raise ValueError(f"cpu_scale must be >= 0, got {cpu_scale}")
        self.cpu_scale = cpu_scale
        self._base = 0
        self._since: int | None = None

    def __call__(self) -> int:
        if self._since is None:
            return self._base
        return self._base + int(self.cpu_scale * (time.perf_counter_ns() - self._since))

    def advance(self, seconds: float) -> None:
        self._base += int(round(seconds * 1e9))

    @contextmanager
    def running(self) -> Iterator[None]:
        self._since = time.perf_counter_ns()
        try:
            yield
        finally:
            self._base += int(self.cpu_scale * (time.perf_counter_ns() - self._since))
            self._since = None


class StepTimes(Protocol):
    host: HostOverhead

    def forward_seconds(self, requests: int, tokens: int, context: float, prefill_tokens: int = 0) -> float: ...


@dataclass
class PhaseRequest:
    req_id: str
    prompt_id: str
    epoch: int
    prompt: list[int]
    output: list[int]


@dataclass
class Workload:
    """A trace made ready for rollout phases: the history before the first replayed epoch and one
    phase of requests per replayed epoch (a rollout with an empty output has no token to sample and
    makes no request). Where the trace has fewer rollouts per epoch than a phase needs, its prompts
    are copied: copy c of a prompt is a new prompt, its id the original's with a suffix no id of the
    trace has, whose token ids (but the end-of-sequence ones) are the trace's distinct ids renumbered
    into the c-th block above the vocabulary (32-bit ids however large the vocabulary), so that no
    copy ever drafts from another copy's tokens; every copy has the same history and rollouts as
    the original."""

    history: list[Rollout]
    phases: list[list[PhaseRequest]]
    copies: int
    eos_token_ids: tuple[int, ...]


def prepare_workload(trace: Trace, first_epoch: int, copies: int = 1, last_epoch: int | None = None) -> Workload:
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    keep = frozenset(trace.header.eos_token_ids)
    distinct = sorted({t for r in trace.rollouts for t in (*r.prompt, *r.output)} - keep)
    dense = {token: i for i, token in enumerate(distinct)}
    base = max(trace.header.vocab_size, 1 + max(distinct, default=0), 1 + max(keep, default=0))
    if base + (copies - 1) * len(distinct) - 1 > MAX_TOKEN_ID:
        raise ValueError(f"{trace.path}: {copies} copies of its {len(distinct)} distinct token ids above its "
                         f"vocabulary of {base} would pass the 32-bit token ids engines take; replay a smaller "
                         f"batch or pass fewer copies")

    def shifted(tokens: list[int], copy: int) -> list[int]:
        if copy == 0:
            return list(tokens)
        offset = base + (copy - 1) * len(distinct)
        return [t if t in keep else offset + dense[t] for t in tokens]

    ids = {r.prompt_id for r in trace.rollouts}
    marker = "~"
    while any(f"{prompt_id}{marker}{copy}" in ids for prompt_id in ids for copy in range(1, copies)):
        marker += "~"

    def named(prompt_id: str, copy: int) -> str:
        return prompt_id if copy == 0 else f"{prompt_id}{marker}{copy}"

    epochs = sorted({r.epoch for r in trace.rollouts if r.epoch >= first_epoch
                     and (last_epoch is None or r.epoch <= last_epoch)})
    if not epochs:
        raise ValueError(f"{trace.path}: no rollouts of epoch {first_epoch} or later to replay")
    history = [Rollout(named(r.prompt_id, c), r.epoch, r.sample, shifted(r.prompt, c), shifted(r.output, c),
                       r.finish_reason) for c in range(copies) for r in trace.rollouts if r.epoch < first_epoch]
    phases = []
    for epoch in epochs:
        rollouts = [r for r in trace.rollouts if r.epoch == epoch and r.output]
        phases.append([PhaseRequest(f"{named(r.prompt_id, c)}/{epoch}/{r.sample}", named(r.prompt_id, c), epoch,
                                    shifted(r.prompt, c), shifted(r.output, c))
                       for c in range(copies) for r in rollouts])
    return Workload(history, phases, copies, tuple(trace.header.eos_token_ids))


def copies_for(trace: Trace, epoch: int, requests: int) -> int:
    """Copies of the trace's prompts that give a phase of ``epoch`` at least ``requests`` requests."""
    per_epoch = sum(1 for r in trace.rollouts if r.epoch == epoch and r.output)
    if per_epoch == 0:
        raise ValueError(f"{trace.path}: no rollout of epoch {epoch} has an output token to replay")
    return max(1, math.ceil(requests / per_epoch))


@dataclass
class StepRecord:
    rows: int            # requests in the batch
    decode_rows: int     # of them, rows that decoded (the others ran their prefill)
    draft_tokens: int    # draft tokens the forward verified
    committed: int       # tokens the step committed
    forward_s: float     # simulated
    host_s: float        # simulated host work per step
    critical_ns: int     # the proposer's call, real time (times the clock's cpu_scale)
    offpath_ns: int      # the drafting core's background work during this step's forward, real time

    def seconds(self, synchronous: bool) -> float:
        """The step's time: a synchronous engine runs the host's work, the forward and the
        proposer one after another; an asynchronous one overlaps the host's work with the forward."""
        span = self.forward_s + self.host_s if synchronous else max(self.forward_s, self.host_s)
        return span + self.critical_ns / 1e9


@dataclass
class _Live:
    request: PhaseRequest
    position: int = 0
    started: bool = False
    draft: list[int] = field(default_factory=list)


class SimulatedEngine:
    """One engine for a sequence of rollout phases. ``proposer``: anything with vLLM's proposer
    calling convention (``bind_runner``, ``propose``), built on ``clock``; None: no speculation.
    ``seed_history`` loads the rollouts of the epochs before the first phase into it."""

    def __init__(self, proposer: Any, clock: VirtualClock, times: StepTimes, synchronous: bool,
                 flush_bytes: int = 32 << 20, seed_history: Callable[[Any, list[Rollout]], None] | None = None,
                 wait_out: bool = True, on_close: Callable[[], None] | None = None) -> None:
        self.proposer = proposer
        self.on_close = on_close  # what else the proposer needs let go of (the drafter pool's actors)
        self.wait_out = wait_out  # each forward's length passes in real time before the proposer's call
        self.clock = clock
        self.times = times
        self.synchronous = synchronous
        self.runner = StandInRunner()
        self.seed_history = seed_history
        self.batch_ns: list[int] = []  # each generate call's new_batch, real time
        self._flush = np.ones(max(0, flush_bytes) // 4, dtype=np.float32) if flush_bytes > 0 else None
        if proposer is not None:
            proposer.bind_runner(self.runner)

    def add_history(self, rollouts: list[Rollout]) -> None:
        if self.proposer is not None and self.seed_history is not None:
            self.seed_history(self.proposer, rollouts)

    def _background(self) -> Any:
        """The proposer's drafting core where its work runs during the forward (the native core,
        prefetching), else None: the reference core and a proposer without prefetch do all their
        work in the call, on the critical path."""
        core = getattr(self.proposer, "core", None)
        if core is None or not getattr(self.proposer, "prefetching", False) or not core.native:
            return None
        return core

    def run_phase(self, requests: list[PhaseRequest], batch: int, waves: bool = False) -> list[StepRecord]:
        """Generate every request of the phase, at most ``batch`` at once; ``waves``: in groups of
        ``batch`` that each drain before the next is submitted (as a loop of generate calls does),
        instead of continuous batching."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        with frozen_heap():
            return self._run(requests, batch, waves)

    def _new_batch(self, requests: Any) -> None:
        """A generate call starts with ``requests``: the proposer is told their prompts, as a rollout
        worker tells it (``NgramRLProposer.new_batch``); ``batch_ns`` keeps what each call took."""
        new_batch = getattr(self.proposer, "new_batch", None)
        if new_batch is not None:
            begin = time.perf_counter_ns()
            new_batch({request.prompt_id: request.prompt for request in requests})
            self.batch_ns.append(time.perf_counter_ns() - begin)

    def _run(self, requests: list[PhaseRequest], batch: int, waves: bool) -> list[StepRecord]:
        runner = self.runner
        queue = deque(requests)
        live: dict[str, _Live] = {}
        records: list[StepRecord] = []
        if not waves:
            self._new_batch(requests)
        background = self._background()
        returned = time.perf_counter()  # when the proposer's last call returned
        busy = background_ns(background)  # the core's background work until then
        while queue or live:
            if not waves or not live:
                if waves and queue:
                    self._new_batch(list(queue)[:batch])
                while len(live) < batch and queue:
                    request = queue.popleft()
                    runner.add(request.req_id, request.prompt_id, request.prompt, request.epoch)
                    live[request.req_id] = _Live(request)
            if self._flush is not None and self.proposer is not None:
                # The forward's memory traffic (what it does to the proposer's data). It runs before
                # the tokens it samples exist: vLLM hands the proposer lists made after the forward.
                self._flush.sum()
            rows = list(runner.input_batch.req_ids)
            sampled, lengths = [], []
            decode_rows = tokens = prefill = drafted = committed_tokens = 0
            context = 0
            for req_id in rows:
                state = live[req_id]
                request = state.request
                if not state.started:  # its prefill runs in this step and samples its first token
                    state.started = True
                    prefill += len(request.prompt)
                    committed = request.output[:1]
                else:
                    draft = state.draft
                    accepted = accepted_prefix(draft, request.output[state.position:])
                    committed = request.output[state.position:state.position + accepted + 1]
                    decode_rows += 1
                    tokens += 1 + len(draft)
                    drafted += len(draft)
                    context += len(request.prompt) + state.position
                runner.requests[req_id].output_token_ids.extend(committed)
                state.position += len(committed)
                committed_tokens += len(committed)
                sampled.append(committed)
                lengths.append(len(request.prompt) + state.position)
            forward = self.times.forward_seconds(decode_rows, tokens, context / max(1, decode_rows), prefill)
            host = self.times.host.seconds(len(rows))
            self.clock.advance(forward + host if self.synchronous else max(forward, host))
            critical = offpath = 0
            if self.proposer is not None:
                # The proposer is called a forward's length after its last call returned (this
                # loop's own work included), spinning meanwhile as a host thread waiting on the
                # GPU does (CUDA's default wait spins), whatever the method: what the wait does to
                # the caches and the threads is the same for all. A prefetching core's background
                # works during it (its budget follows the time it had: next_budget), and the
                # proposer's call stops it, as at the forward's end in an engine (what is left of
                # the row in hand is on the critical path).
                # (In this machine's seconds: simulated CPU time is its real time times cpu_scale;
                # with drafting free, cpu_scale 0, the forward's own length.)
                wall = forward / self.clock.cpu_scale if self.clock.cpu_scale > 0 else forward
                if background is not None:
                    background.wait_idle(max(0.0, wall - (time.perf_counter() - returned)))
                while self.wait_out and time.perf_counter() - returned < wall:
                    pass
                with self.clock.running():
                    begin = time.perf_counter_ns()
                    drafts = self.proposer.propose(sampled, lengths, None)
                    critical = int(self.clock.cpu_scale * (time.perf_counter_ns() - begin))
                returned = time.perf_counter()
                if background is not None:
                    done = background_ns(background)
                    offpath, busy = done - busy, done  # what it did during this forward (and the call)
            else:
                drafts = [[] for _ in rows]
            records.append(StepRecord(len(rows), decode_rows, drafted, committed_tokens, forward, host, critical,
                                      offpath))
            for req_id, draft in zip(rows, drafts, strict=True):
                state = live[req_id]
                state.draft = list(draft)
                if state.position >= len(state.request.output):  # finished: it leaves the batch
                    runner.remove(req_id)
                    del live[req_id]
        return records

    def close(self) -> None:
        """Let the proposer's last drafts go (its core's background work, if any, stops), and
        whatever it drafted from."""
        core = getattr(self.proposer, "core", None)
        if core is not None:
            core.stop(cancel=True)
        if self.on_close is not None:
            self.on_close()
            self.on_close = None


BACKGROUND_TIMINGS = ("absorb_ns", "plan_ns", "prefetch_lookup_ns")  # a prefetching native core's background work


def background_ns(core: Any) -> int:
    """The work time the native core's background has spent so far (0 without one)."""
    if core is None:
        return 0
    timings = core.timings()
    return sum(timings[name] for name in BACKGROUND_TIMINGS)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


@dataclass
class StepSummary:
    steps: int
    step_us_median: float
    step_us_mean: float
    step_us_p99: float
    request_us_mean: float
    offpath_us_mean: float
    tokens_per_forward: float


def summarize_steps(records: list[StepRecord], batch: int) -> StepSummary:
    """The proposer's critical path per step over the steps with ``batch`` requests in flight
    (all steps, when none had); tokens per forward over every step."""
    full = [r for r in records if r.rows == batch] or records
    critical = [r.critical_ns / 1000.0 for r in full]
    rows = sum(r.rows for r in full)
    row_steps = sum(r.rows for r in records)
    return StepSummary(
        steps=len(full), step_us_median=statistics.median(critical), step_us_mean=statistics.fmean(critical),
        step_us_p99=percentile(critical, 0.99), request_us_mean=sum(critical) / max(1, rows),
        offpath_us_mean=statistics.fmean(r.offpath_ns / 1000.0 for r in full),
        tokens_per_forward=sum(r.committed for r in records) / max(1, row_steps))


ENGINE_METHODS = ("none", "pld", "suffix", "ngramrl", "ngramrl-prefetch")
# ngramrl drafting from the Ray drafter pool, as `ngramrl train` runs it: real shard actors on a
# local Ray instance (a few seconds to start), so only where asked for
POOL_METHOD = "ngramrl-pool"
SYNCHRONOUS = {"none": False}  # vLLM schedules asynchronously only without an n-gram-style drafter


# How an ngramrl-pool engine is made: (workload, k, config, clock, pool) -> (proposer, how the
# history reaches the pool, how the pool is let go of).
PoolStart = Callable[["Workload", int, Any, "VirtualClock", "PoolBench"],
                     tuple[Any, Callable[[Any, list[Rollout]], None], Callable[[], None]]]


POOL_START_MISSING = (f"{POOL_METHOD} needs PoolBench(start=...): the pipeline's start_pool_engine "
                      "(ngramrl.pipeline.pool_bench), which the CLI passes")


@dataclass
class PoolBench:
    """The drafter pool whose history an ``ngramrl-pool`` engine copies: ``shards`` actors, a
    step that starts prompts waiting up to ``sync_wait_ms`` for their windows (PoolSection's).
    ``start`` makes the engine and its pool: the pipeline's ``start_pool_engine``, handed in by
    the caller (the CLI), since the pool is the pipeline's and the benchmarks sit below it."""

    shards: int = 2
    sync_wait_ms: float = 20.0
    start: PoolStart | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"pool shards must be >= 1, got {self.shards}")
        if self.sync_wait_ms < 0:
            raise ValueError(f"pool sync wait must be >= 0 ms, got {self.sync_wait_ms}")


# the module a method needs beyond the project's core, and what to say where it is missing
METHOD_MODULES = {"suffix": ("arctic_inference.suffix_decoding", "arctic-inference (SuffixDecoding)"),
                  POOL_METHOD: ("ray", "ray (the drafter pool's actors)")}


def method_available(method: str) -> str | None:
    """Why ``method`` cannot run here (a missing package), or None."""
    if method not in METHOD_MODULES:
        return None
    module, package = METHOD_MODULES[method]
    try:
        importlib.import_module(module)
    except ImportError:
        return f"{package} is not installed"
    return None


def _seed_ngramrl(proposer: Any, rollouts: list[Rollout]) -> None:
    core = proposer.core
    for rollout in rollouts:
        core.add_rollout(rollout.prompt_id, rollout.prompt, rollout.output, epoch=rollout.epoch)
    core.build_indexes()  # now, not in the first steps


def _seed_baseline(proposer: Any, rollouts: list[Rollout]) -> None:
    proposer.add_history(rollouts)


def build_engine(method: str, workload: Workload, k: int, times: StepTimes, threads: int = 1,
                 flush_bytes: int = 32 << 20, config: Any = None, cpu_scale: float = 1.0,
                 wait_out: bool = True, pool: PoolBench | None = None) -> SimulatedEngine:
    """A simulated engine drafting with ``method``, its history the workload's earlier epochs.
    ``config``: the ``NgramRLConfig`` for the ngramrl methods (its prefetch and draft-thread
    settings are set from the method and ``threads``). ``cpu_scale``: the proposers' CPU time
    counts this many times what it takes here (the engine host's CPU against this one).
    ``wait_out``: each forward's length passes in real time before the proposer is called (False:
    at once, or once a prefetching core's background is idle, so the prefetch's budget grows only
    into the time the replay's own work between two calls gives it). ``pool``: the drafter pool
    of ``ngramrl-pool`` (its ``start`` starts it, on a local Ray instance unless one is running;
    the engine's ``close`` stops it)."""
    from dataclasses import replace

    from ngramrl.bench.proposers import PromptLookupProposer, SuffixProposer
    from ngramrl.config import NgramRLConfig
    from ngramrl.engine.standin import standin_vllm_config
    from ngramrl.engine.vllm_proposer import NgramRLProposer

    if method not in (*ENGINE_METHODS, POOL_METHOD):
        raise ValueError(f"unknown method {method!r}; choose from {', '.join((*ENGINE_METHODS, POOL_METHOD))}")
    clock = VirtualClock(cpu_scale)
    seed: Callable[[Any, list[Rollout]], None] = _seed_baseline
    close: Callable[[], None] | None = None
    proposer: Any = None
    if method == "pld":
        proposer = PromptLookupProposer(k)
    elif method == "suffix":
        proposer = SuffixProposer(k)
    elif method.startswith("ngramrl"):
        base = config or NgramRLConfig()
        # ngramrl-prefetch and the pool: as a GPU engine runs it by default ("auto": the step's work
        # goes to the background where that is faster); ngramrl: all of it in the call
        engine = replace(base.engine, prefetch="off" if method == "ngramrl" else "auto", draft_threads=threads)
        if method == POOL_METHOD:
            if pool is None or pool.start is None:
                raise ValueError(POOL_START_MISSING)
            proposer, seed, close = pool.start(workload, k, replace(base, engine=engine), clock, pool)
        else:
            proposer = NgramRLProposer(standin_vllm_config(k, workload.eos_token_ids, device_type="cuda"),
                                       config=replace(base, engine=engine), clock=clock)
            seed = _seed_ngramrl
    simulated = SimulatedEngine(proposer, clock, times, SYNCHRONOUS.get(method, True), flush_bytes, seed, wait_out,
                                close)
    try:
        simulated.add_history(workload.history)
    except BaseException:
        simulated.close()  # the pool's actors (and its Ray instance) do not outlive a failed start
        raise
    return simulated
