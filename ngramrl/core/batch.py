"""The batched drafting core: one call per engine step for all rows, plain arrays in and out.

Every consumer (the in-engine proposer, a drafter pool shard, the replay benchmark) drives
drafting through this interface. Two implementations give identical results:

- ``ReferenceCore`` (here): the pure-Python reference over ``RolloutHistory``, ``NgramDrafter``
  and the outcome model, one row after the other;
- ``NativeCore`` (``ngramrl._native``, C++): the same state machine in a compact layout, with
  the rows of a step spread over threads and the index inserts and the prefetch run in the
  background while the target's forward runs.

``make_core`` picks the native one when the extension is importable and falls back to the
reference otherwise (with one logged line).

What a step means (both implementations)
----------------------------------------
A request is an integer handle from ``start``. ``step(handles, tokens, offsets, ks)`` gives row
i the committed tokens ``tokens[offsets[i]:offsets[i + 1]]`` and room for ``ks[i]`` draft tokens:

1. if any row drafts (k > 0), every row's tokens still pending from earlier steps enter its
   prompt's index, row after row in this step's order;
2. each row with k > 0 commits its tokens and drafts; a row with k <= 0 only keeps its tokens
   (they wait for the next step that drafts: inserting a backlog at once is cheaper).

The lookups of one step read the index as it stands after 1, so they are independent of each
other (rows of the same prompt included) and run in parallel. The step's own committed tokens
enter the index at ``absorb`` (the native core does it in the background) or at 1 of the next
step, always in row order, so the index, and every draft made from it, is a pure function of the
calls made, never of timing.

``prefetch`` (after ``absorb``) predicts the likeliest verification outcomes (j, b) of the drafts
just sent, spends the budget on them (``allocate``) and looks up the next draft of each: exactly
the lookup the next ``step`` makes if the row commits ``draft[:j] + [b]``; the prefetch reads
without changing anything. That step takes the prefetched draft (``DraftBatch.prefetched``) when
the indexes it read are unchanged since (no request started or finished, no rollout added),
otherwise it looks up again, so a prefetched draft is always the synchronous one.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from ngramrl.config import DrafterConfig, HistoryConfig, PrefetchConfig
from ngramrl.core.cost import choose_draft_lengths, probe_lengths, step_cost
from ngramrl.core.drafter import EMPTY, Draft, NgramDrafter, RequestState
from ngramrl.core.estimate import MatchState, advance
from ngramrl.core.extension import native_module
from ngramrl.core.history import RolloutHistory, token_ids
from ngramrl.core.native import NativeCore
from ngramrl.core.outcome import AcceptanceCalibration, DraftFollower, PrefetchSpan, Survival, plan_outcomes
from ngramrl.core.rows import DraftBatch, OutcomeBatch


class DraftingCore(Protocol):
    """What ``ReferenceCore`` and ``NativeCore`` both provide."""

    native: bool

    def add_rollout(self, prompt_id: str, prompt: Any, output: Any, epoch: int) -> None: ...
    def start(self, prompt_id: str, prompt: Any, output: Any = (), register: bool = False) -> int: ...
    def start_many(self, prompt_ids: Sequence[str], prompts: Sequence[Any], outputs: Sequence[Any],
                   register: bool = False) -> list[int]: ...
    def finish(self, handle: int, epoch: int | None = None, linger: bool = False) -> None: ...
    def finish_many(self, handles: Sequence[int], epochs: Sequence[int] | None = None,
                    linger: bool = False) -> None: ...
    def drop_ended(self, prompt_ids: Sequence[str]) -> None: ...
    def step(self, handles: Any, tokens: Any, offsets: Any, ks: Any) -> DraftBatch: ...
    def absorb(self, handles: Any, now: bool = False) -> None: ...
    def prefetch(self, handles: Any, tokens: Any, offsets: Any, probs: Any, k: int, absorb: Any = ()) -> None: ...
    def wait_idle(self, seconds: float) -> bool: ...
    def stop(self, cancel: bool = False) -> None: ...
    def collect(self, cancel: bool = False) -> OutcomeBatch: ...
    def set_budget(self, budget: int) -> None: ...
    def take_span(self) -> PrefetchSpan | None: ...
    def observe(self, probs: Any, offsets: Any, accepted: Any) -> None: ...
    def chances(self, probs: Any, offsets: Any) -> np.ndarray: ...
    def lengths(self, probs: Any, offsets: Any, scale: float, fit: Sequence[float], min_gain: float,
                adaptive: bool = True, probe_tokens: int = 0) -> tuple[np.ndarray, float, bool, bool]: ...
    def calibration_state(self) -> list[list[float]]: ...
    def load_calibration_state(self, state: list[list[float]]) -> None: ...
    def continuations(self, prompt_id: str, prompt: Any, output: Any, m: int) -> list[tuple[int, int]]: ...
    def lookup_context(self, prompt_id: str, prompt: Any, output: Any, k: int) -> Draft: ...


def as_rows(handles: Any, tokens: Any, offsets: Any, ks: Any | None = None,
            what: str = "committed tokens") -> tuple[np.ndarray, ...]:
    """The step's arrays as the core reads them, checked (shape, bounds, token ids, each handle once)."""
    handles = np.ascontiguousarray(handles, dtype=np.int64).reshape(-1)
    tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
    if len(offsets) != len(handles) + 1:
        raise ValueError(f"offsets has {len(offsets)} entries; {len(handles)} rows need {len(handles) + 1}")
    if len(handles) and (offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0)):
        raise ValueError(f"offsets must rise from 0 to the {len(tokens)} tokens given")
    if len(tokens) and tokens.min() < 0:  # the automaton takes a negative id for "no continuation"
        at = int(np.argmax(tokens < 0))
        raise ValueError(f"{what}[{at}] = {tokens[at]} is negative (token ids are >= 0)")
    if len(np.unique(handles)) != len(handles):
        raise ValueError("a request handle appears twice in one step")
    if ks is None:
        return handles, tokens, offsets
    ks = np.ascontiguousarray(ks, dtype=np.int32).reshape(-1)
    if len(ks) != len(handles):
        raise ValueError(f"ks has {len(ks)} entries for {len(handles)} rows")
    return handles, tokens, offsets, ks


def _check_probabilities(probs: np.ndarray) -> None:
    bad = ~((probs >= 0.0) & (probs <= 1.0))  # NaN too
    if bad.any():
        at = int(np.argmax(bad))
        raise ValueError(f"estimates[{at}] = {probs[at]} is not a probability in [0, 1]")


def checked_estimates(probs: Any, offsets: Any) -> tuple[list[float], list[int]]:
    """Drafts' estimates (flat) and each draft's offsets (rows + 1, rising from 0 to the
    estimates given), as lists; a ValueError before anything is read otherwise."""
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    if len(offsets) == 0:
        raise ValueError("offsets needs rows + 1 entries, got none")
    if offsets[0] != 0 or offsets[-1] != len(probs) or np.any(np.diff(offsets) < 0):
        raise ValueError(f"offsets must rise from 0 to the {len(probs)} estimates given")
    _check_probabilities(probs)
    return probs.tolist(), offsets.tolist()


def arrival_order(handles: np.ndarray) -> list[int]:
    """The rows in the order their requests started (handles rise with it). Whatever changes the
    history goes in this order, so a step's drafts do not depend on the order of its rows (an
    engine's batch order is its own: vLLM moves rows when requests finish)."""
    return np.argsort(handles, kind="stable").tolist()


def take_match_states(request: RequestState, looked_up: RequestState) -> None:
    """A request served a prefetched draft takes the match states that draft's lookup caught up to:
    the indexes are unchanged since (the stamp), so they are the states its own lookup would
    leave. Left behind instead, a run of hits would end in a catch-up over all of the run's tokens,
    which re-matches the cross-prompt index from the recent context past ``rematch_tokens``, and
    the drafts after the run would depend on which steps hit the prefetch."""
    request.match, request.behind = looked_up.match, list(looked_up.behind)
    request.global_index, request.global_match = looked_up.global_index, looked_up.global_match
    request.global_behind = list(looked_up.global_behind)


class ReferenceCore:
    """The batch interface over the pure-Python drafter, one row after the other."""

    native = False

    def __init__(self, history: HistoryConfig | None = None, drafter: DrafterConfig | None = None,
                 prefetch: PrefetchConfig | None = None, threads: int = 1, follow: bool = False,
                 cores: Collection[int] = ()) -> None:
        self.history = RolloutHistory(history)
        self.drafter = NgramDrafter(self.history, drafter)
        self.prefetch_config = prefetch or PrefetchConfig()
        self.calibration = AcceptanceCalibration(self.prefetch_config.prior_strength,
                                                 self.prefetch_config.calibration_decay)
        self.threads = threads
        self.cores = frozenset(cores)  # nothing runs beside the caller here: kept for the interface
        # With ``follow``, every draft made calibrates acceptance by following the committed tokens.
        self.follower = DraftFollower(self.calibration) if follow else None
        # The live requests by handle; handles keep rising (they rank the requests by arrival).
        self._requests: dict[int, RequestState] = {}
        self._next_handle = 0
        # (handle, j, b) -> the next draft, the stamp of what its lookup read, and the request as
        # that lookup left it (its match states caught up over the outcome's tokens)
        self._cache: dict[tuple[int, int, int], tuple[Draft, tuple, RequestState]] = {}
        self._outcomes = OutcomeBatch.empty()
        self._last_cut = 0.0  # the last prefetch's (outcome.budget_cut)

    # -- history ---------------------------------------------------------------------------

    def add_rollout(self, prompt_id: str, prompt: Any, output: Any, epoch: int) -> None:
        self.history.add_rollout(prompt_id, _listed(prompt), _listed(output), int(epoch))

    def export(self, prompt_ids: list[str] | None = None) -> list[list]:
        return self.history.export(prompt_ids)

    def restore(self, exported: list[list], replace: bool = False) -> None:
        self.history.restore(exported, replace)

    def clear(self) -> None:
        self.history.clear()

    @property
    def stored_tokens(self) -> int:
        return self.history.stored_tokens

    def __len__(self) -> int:
        return len(self.history)

    def prompt_ids(self) -> list[str]:
        return self.history.prompt_ids()

    def rollout_count(self, prompt_id: str) -> int:
        return self.history.rollout_count(prompt_id)

    def counters(self) -> dict[str, int]:
        history = self.history
        return {"layout": history.layout, "rebuilds": history.rebuilds, "global_builds": history.global_builds,
                "evicted_prompts": history.evicted_prompts}

    def index_prompt(self, prompt_id: str) -> bool:
        """Build the prompt's index now (it becomes the most recently used); False if unknown."""
        return self.history.index_of(prompt_id) is not None

    def build_indexes(self) -> None:
        """Build every index now (between steps), not in the next lookup that needs it."""
        for prompt_id in self.history.prompt_ids():
            self.history.index_of(prompt_id)
        if self.drafter.config.use_global:
            self.history.global_index()

    def index_shape(self, prompt_id: str | None = None) -> tuple[int, int, int]:
        """(states, tokens, sequences) of a prompt's index (None: the cross-prompt one); -1s when not built."""
        if prompt_id is None:
            index = self.history.built_global_index()
        else:
            entry = self.history._prompts.get(prompt_id)  # noqa: SLF001 - read without building or touching
            index = entry.index if entry is not None else None
        return (-1, -1, -1) if index is None else (index.num_states, index.num_tokens, index.num_sequences)

    # -- requests --------------------------------------------------------------------------

    def start(self, prompt_id: str, prompt: Any, output: Any = (), register: bool = False) -> int:
        return self.start_many([prompt_id], [prompt], [output], register)[0]

    def start_many(self, prompt_ids: Sequence[str], prompts: Sequence[Any], outputs: Sequence[Any],
                   register: bool = False) -> list[int]:
        """Requests start in the order given (their handles rise with it; ``outputs``: each one's
        tokens so far). Every request's tokens are checked before any starts."""
        if not len(prompt_ids) == len(prompts) == len(outputs):
            raise ValueError(f"start got {len(prompt_ids)} prompt ids, {len(prompts)} prompts and "
                             f"{len(outputs)} outputs")
        checked = [(token_ids(_listed(prompt), f"prompts[{i}]"), token_ids(_listed(output), f"outputs[{i}]"))
                   for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True))]
        handles = []
        for prompt_id, (prompt, output) in zip(prompt_ids, checked, strict=True):
            handles.append(self._next_handle)
            self._next_handle += 1
            self._requests[handles[-1]] = self.drafter.start(str(handles[-1]), str(prompt_id), prompt, output,
                                                             register=register)
        return handles

    def finish(self, handle: int, epoch: int | None = None, linger: bool = False) -> None:
        self.finish_many([handle], None if epoch is None else [epoch], linger)

    def finish_many(self, handles: Sequence[int], epochs: Sequence[int] | None = None, linger: bool = False) -> None:
        """The requests end in the order given: their outputs become rollouts of ``epochs`` (None:
        dropped; with ``linger`` they stay in the index until the prompt's next finished rollout).
        Every handle is checked before any request ends."""
        handles = [int(h) for h in handles]
        if epochs is not None and len(epochs) != len(handles):
            raise ValueError(f"finish got {len(epochs)} epochs for {len(handles)} requests")
        for i, handle in enumerate(handles):
            self._request(handle)
            if epochs is not None and (isinstance(epochs[i], bool) or int(epochs[i]) < 0):
                raise ValueError(f"epoch must be >= 0, got {epochs[i]!r}")
        if len(set(handles)) != len(handles):
            twice = next(h for h in handles if handles.count(h) > 1)
            raise ValueError(f"request handle {twice} is finished twice")
        for i, handle in enumerate(handles):
            self.drafter.finish(self._requests[handle], epoch=None if epochs is None else int(epochs[i]),
                                linger=linger)
            if self.follower is not None:
                self.follower.drop(handle)
            del self._requests[handle]

    def drop_ended(self, prompt_ids: Sequence[str]) -> None:
        """The outputs of requests of these prompts that ended lingering leave their indexes now
        (``RolloutHistory.drop_ended``; unknown prompts are skipped)."""
        for prompt_id in prompt_ids:
            self.history.drop_ended(str(prompt_id))

    def known(self, handle: int) -> bool:
        return self._request(handle).known

    def _request(self, handle: int) -> RequestState:
        handle = int(handle)
        request = self._requests.get(handle)
        if request is None:
            raise ValueError(f"request handle {handle} is not a live request of this core")
        return request

    # -- steps -----------------------------------------------------------------------------

    def step(self, handles: Any, tokens: Any, offsets: Any, ks: Any) -> DraftBatch:
        handles, tokens, offsets, ks = as_rows(handles, tokens, offsets, ks)
        requests = [self._request(h) for h in handles]
        drafter = self.drafter
        order = arrival_order(handles)
        if self.follower is not None:
            for i in order:
                self.follower.committed(int(handles[i]), tokens[offsets[i]:offsets[i + 1]].tolist())
        if np.any(ks > 0):
            for i in order:
                drafter.absorb(requests[i])
        drafts, hits = [EMPTY] * len(requests), [False] * len(requests)
        for i in order:
            request = requests[i]
            committed = tokens[offsets[i]:offsets[i + 1]].tolist()
            k = int(ks[i])
            if k <= 0:
                drafter.defer(request, committed)
                continue
            drafter.commit(request, committed)
            ready = self._cache.get((int(handles[i]), len(committed) - 1, committed[-1])) if committed else None
            if ready is not None and request.known and ready[1] == self._stamp(request):
                drafts[i] = ready[0].truncated(k)
                hits[i] = True
                take_match_states(request, ready[2])
            else:
                drafts[i] = drafter.lookup(request, k)
        self._cache = {}
        if self.follower is not None:
            for handle, k, draft in zip(handles.tolist(), ks.tolist(), drafts, strict=True):
                if k > 0:
                    self.follower.offer(handle, draft)
        return DraftBatch.from_drafts(drafts, hits)

    def followed(self) -> tuple[int, int]:
        """Drafts followed to their end and their accepted tokens (``follow``)."""
        return (self.follower.resolved, self.follower.accepted) if self.follower is not None else (0, 0)

    def absorb(self, handles: Any, now: bool = False) -> None:
        handles = np.asarray(handles, dtype=np.int64).reshape(-1)
        for i in arrival_order(handles):
            self.drafter.absorb(self._request(handles[i]))

    def continuations(self, prompt_id: str, prompt: Any, output: Any, m: int) -> list[tuple[int, int]]:
        """The first ``m`` (token, count) continuations, in ranking order, of the state that ``output``
        reaches in the prompt's index: what the outcome model ranks its corrections from."""
        prompt, output = token_ids(_listed(prompt), "prompt"), token_ids(_listed(output), "output")
        if m < 0:
            raise ValueError(f"continuations: m must be >= 0, got {m}")
        index = self.history.index_of(prompt_id)
        if index is None:
            return []
        match = advance(index, MatchState(), self.history.sequence(prompt, output))
        return index.continuations(match.state)[:m]

    def lookup_context(self, prompt_id: str, prompt: Any, output: Any, k: int) -> Draft:
        """The draft after ``output`` from the current history, changing nothing but an index
        build (the drafter pool's stateless lookup)."""
        prompt, output = token_ids(_listed(prompt), "prompt"), token_ids(_listed(output), "output")
        index = self.history.index_of(prompt_id)
        if index is None:
            return EMPTY
        request = RequestState("lookup", prompt_id, prompt, output, known=True, index=index,
                               layout=self.history.layout)
        request.match = advance(index, MatchState(), self.history.sequence(prompt, output))
        # Not live: nothing of it may enter the index (absorb) nor be looked up by id (index()).
        return self.drafter.lookup(request, k)

    # -- prefetch --------------------------------------------------------------------------

    def _stamp(self, request: RequestState) -> tuple:
        """What a lookup of the request read: its prompt's index, the cross-prompt index, the layout."""
        built = self.history.built_global_index()
        index = request.index
        return (self.history.layout, id(index), index.num_tokens if index is not None else -1,
                id(built), built.num_tokens if built is not None else -1)

    def _readable(self, request: RequestState) -> bool:
        """Whether the request's state can be read as it is (nothing needs rebuilding or inserting)."""
        return (request.known and self.drafter.holds_current_index(request)
                and not request.pending)

    def _caught_up(self, request: RequestState) -> RequestState:
        """A copy of the request with its match states stepped over its committed tokens, as
        ``NgramDrafter.catch_up`` does, building nothing."""
        probe = copy.copy(request)
        if probe.behind:
            probe.match = advance(probe.index, probe.match, probe.behind)
            probe.behind = []
        behind = probe.global_behind
        if behind and probe.global_index is not None:
            probe.global_behind = []
            built = self.history.built_global_index()
            if probe.global_index is not built:
                probe.global_index = None
            elif len(behind) > self.drafter.config.rematch_tokens:
                context = probe.prompt + probe.output
                probe.global_match = advance(built, MatchState(), context[-self.drafter.config.rematch_tokens:])
            else:
                probe.global_match = advance(built, probe.global_match, behind)
        return probe

    def _committed(self, request: RequestState, tokens: list[int]) -> RequestState:
        """A copy of the request as ``NgramDrafter.commit(tokens)`` leaves it (the request is absorbed)."""
        probe = copy.copy(request)
        probe.output = request.output + tokens
        probe.pending = list(tokens)
        probe.behind = list(tokens)
        if request.global_index is not None:
            probe.global_behind = request.global_behind + tokens
        return probe

    def prefetch(self, handles: Any, tokens: Any, offsets: Any, probs: Any, k: int, absorb: Any = ()) -> None:
        """The drafts (per row) just went to verification: predict their likeliest outcomes and
        look up the next draft of each. Reads only; ``collect`` returns what it chose. ``absorb``:
        rows to ``absorb`` first (the native core does both in one background job)."""
        handles, tokens, offsets = as_rows(handles, tokens, offsets, what="draft tokens")
        probs = np.ascontiguousarray(probs, dtype=np.float64).reshape(-1)
        if len(probs) != len(tokens):
            raise ValueError(f"{len(probs)} probabilities for {len(tokens)} draft tokens")
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        _check_probabilities(probs)
        self.absorb(absorb)
        config = self.prefetch_config
        needs_global = self.drafter.config.use_global and self.history.built_global_index() is None
        planned, drafts = {}, {}
        for i, handle in enumerate(handles.tolist()):
            request = self._request(handle)
            begin, end = int(offsets[i]), int(offsets[i + 1])  # an empty draft: the outcome is the next token
            if not config.budget or not self._readable(request) or needs_global:
                continue
            draft = Draft(tokens[begin:end].tolist(), probs[begin:end].tolist())
            drafts[handle] = (i, draft)
            planned[handle] = (self.drafter.outcome_sources(self._caught_up(request)), draft)
        chosen, self._last_cut = plan_outcomes(planned, self.calibration, config, self._last_cut)
        rows, accepted, emitted, chance, found = [], [], [], [], []
        self._cache = {}
        for handle, outcomes in chosen.items():
            row, draft = drafts[handle]
            request = self._request(handle)
            stamp = self._stamp(request)
            for outcome in outcomes:
                after = draft.tokens[:outcome.accepted] + [outcome.token]
                probe = self._committed(request, after)
                next_draft = self.drafter.lookup(probe, k)
                self._cache[(handle, outcome.accepted, outcome.token)] = (next_draft, stamp, probe)
                rows.append(row)
                accepted.append(outcome.accepted)
                emitted.append(outcome.token)
                chance.append(outcome.probability)
                found.append(next_draft)
        self._outcomes = OutcomeBatch(np.array(rows, dtype=np.int32), np.array(accepted, dtype=np.int32),
                                      np.array(emitted, dtype=np.int32), np.array(chance, dtype=np.float64),
                                      DraftBatch.from_drafts(found))

    def wait_idle(self, seconds: float) -> bool:
        """The reference does its work in the calling thread: there is never any left to wait for."""
        return True

    def stop(self, cancel: bool = False) -> None:
        """The reference does its work in the calling thread: there is never any to stop."""

    def collect(self, cancel: bool = False) -> OutcomeBatch:
        """What the last prefetch chose (it ran to the end: the reference has no background)."""
        return self._outcomes

    def set_budget(self, budget: int) -> None:
        """Prefetch with ``budget`` lookups per request from now on; the next prefetch plans
        without a floor (the last cut was another budget's)."""
        self.prefetch_config = replace(self.prefetch_config, budget=int(budget))
        self._last_cut = 0.0

    def take_span(self) -> PrefetchSpan | None:
        """None: the reference prefetches in the calling thread, there is no forward it runs beside."""
        return None

    # -- calibration -----------------------------------------------------------------------

    def observe(self, probs: Any, offsets: Any, accepted: Any) -> None:
        """Verified drafts (their estimates, flat) and how many tokens of each were accepted."""
        probs, offsets = checked_estimates(probs, offsets)
        accepted = np.asarray(accepted, dtype=np.int64).reshape(-1).tolist()
        if len(accepted) + 1 != len(offsets):
            raise ValueError(f"accepted has {len(accepted)} entries for {len(offsets) - 1} drafts")
        if any(count < 0 for count in accepted):
            at = next(i for i, count in enumerate(accepted) if count < 0)
            raise ValueError(f"accepted[{at}] = {accepted[at]} is negative")
        for i, count in enumerate(accepted):
            self.calibration.observe(probs[offsets[i]:offsets[i + 1]], count)

    def chances(self, probs: Any, offsets: Any) -> np.ndarray:
        """Calibrated acceptance chance of each draft token (flat, like ``probs``)."""
        probs, offsets = checked_estimates(probs, offsets)
        out = []
        for i in range(len(offsets) - 1):
            out.extend(self.calibration.chances(probs[offsets[i]:offsets[i + 1]]))
        return np.array(out, dtype=np.float64)

    def lengths(self, probs: Any, offsets: Any, scale: float, fit: Sequence[float], min_gain: float,
                adaptive: bool = True, probe_tokens: int = 0) -> tuple[np.ndarray, float, bool, bool]:
        """How many leading tokens of each draft to verify (``choose_lengths``) from this core's calibration."""
        return choose_lengths(self.calibration, probs, offsets, scale, fit, min_gain, adaptive, probe_tokens)

    def calibration_state(self) -> list[list[float]]:
        return self.calibration.state()

    def load_calibration_state(self, state: list[list[float]]) -> None:
        self.calibration.load_state(state)

    def memory_bytes(self) -> int | None:
        return None  # Python objects: measured with tracemalloc (ngramrl.bench.run)

    def close(self) -> None:
        pass


def choose_lengths(calibration: AcceptanceCalibration, probs: Any, offsets: Any, scale: float,
                   fit: Sequence[float], min_gain: float, adaptive: bool = True,
                   probe_tokens: int = 0) -> tuple[np.ndarray, float, bool, bool]:
    """How many leading tokens of each draft (flat ``probs``, one row per ``offsets`` pair) to verify:
    all of them (not ``adaptive``), or what the step-cost model with ``fit`` (``StepCostModel.fit``:
    base, per request, per draft token past the plateau, per verifying step, the plateau's knee in
    tokens) says pays off on the calibrated survival chances
    scaled by ``scale`` (``cost.choose_draft_lengths``); when it keeps nothing and ``probe_tokens``
    > 0, the batch's ``probe_tokens`` likeliest tokens (``cost.probe_lengths``). Returns the lengths,
    the accepted tokens the unscaled chances expect of them, whether the cost model kept a token,
    and whether a probe chose."""
    model = step_cost(fit)
    probs, offsets = checked_estimates(probs, offsets)
    rows = [probs[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    if not any(rows):
        return np.zeros(len(rows), dtype=np.int32), 0.0, False, False
    survival = [Survival(p, calibration) for p in rows]
    probed = False
    if not adaptive:
        chosen, paid = [len(p) for p in rows], True
    else:
        chosen = choose_draft_lengths([Survival(p, calibration, scale) for p in rows], model, min_gain)
        paid = any(chosen)
        if probe_tokens > 0 and not paid:
            chosen, probed = probe_lengths(survival, probe_tokens), True
    expected = sum(sum(s[:n]) for s, n in zip(survival, chosen, strict=True))
    return np.array(chosen, dtype=np.int32), float(expected), paid, probed


def _listed(values: Any) -> Any:
    """An array's values as a list (other values as they are: ``token_ids`` checks them)."""
    return values.reshape(-1).tolist() if isinstance(values, np.ndarray) else values


def make_core(history: HistoryConfig | None = None, drafter: DrafterConfig | None = None,
              prefetch: PrefetchConfig | None = None, threads: int = 1, native: bool | None = None,
              follow: bool = False, cores: Collection[int] = ()) -> DraftingCore:
    """The drafting core: native when available (``native=None``), or the one asked for. ``follow``:
    it calibrates acceptance from every draft it makes by following the committed tokens.
    ``cores``: the CPU ids its worker threads run on (empty: wherever the process may)."""
    if native is False:
        return ReferenceCore(history, drafter, prefetch, threads, follow, cores)
    module = native_module()
    if module is None:
        if native:
            raise RuntimeError("the native drafting core was asked for but ngramrl._native is not built "
                               "(pip install . builds it; see docs/native.md)")
        return ReferenceCore(history, drafter, prefetch, threads, follow, cores)
    return NativeCore(module, history, drafter, prefetch, threads, follow, cores)
