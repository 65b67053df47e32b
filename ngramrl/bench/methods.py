"""Drafting methods as the replay benchmark drives them.

Every method sees, for a rollout of epoch e, only what was known before epoch e started (all
rollouts of earlier epochs) plus the rollout's own prompt and its own output committed so far.
For each replayed rollout the replay loop calls ``start``, ``commit`` with the prefill's token, then
per step ``propose``, ``background`` (what overlaps the target's forward) and ``commit``, then
``finish``; after each epoch, ``add_history`` with its rollouts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ngramrl.config import DrafterConfig, HistoryConfig, PrefetchConfig
from ngramrl.core.automaton import SuffixAutomaton
from ngramrl.core.batch import make_core
from ngramrl.core.drafter import Draft, NgramDrafter, RequestState
from ngramrl.core.estimate import MatchState, advance, continuation_estimates, step_sources
from ngramrl.core.history import RolloutHistory
from ngramrl.core.outcome import AcceptanceCalibration, Outcome, allocate, predict_for
from ngramrl.core.trace import Rollout
from ngramrl.core.tree import ROOT_NODE, DraftTree


class _BigramHistory:
    """For the coverage ceiling: which tokens ever followed a token in the allowed history
    (earlier epochs' prompts and outputs, the request's own prompt and output so far)."""

    def __init__(self) -> None:
        self.followers: dict[int, set[int]] = {}
        self.own: dict[int, set[int]] = {}
        self.last = -1

    def add(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            sequence = rollout.prompt + rollout.output
            for a, b in zip(sequence, sequence[1:], strict=False):
                self.followers.setdefault(a, set()).add(b)

    def start(self, prompt: list[int]) -> None:
        self.own = {}
        self.last = -1
        self.extend(prompt)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.last >= 0:
                self.own.setdefault(self.last, set()).add(token)
            self.last = token

    def seen(self, before: int, token: int) -> bool:
        return token in self.followers.get(before, ()) or token in self.own.get(before, ())


class ReplayMethod(Protocol):
    name: str

    def add_history(self, rollouts: list[Rollout]) -> None: ...
    def start(self, rollout: Rollout) -> None: ...
    def propose(self, k: int) -> list[int] | DraftTree: ...
    def background(self) -> None: ...
    def commit(self, tokens: list[int]) -> None: ...
    def finish(self) -> None: ...


class NoDraft:
    name = "none"

    def add_history(self, rollouts: list[Rollout]) -> None:
        pass

    def start(self, rollout: Rollout) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        return []

    def background(self) -> None:
        pass

    def commit(self, tokens: list[int]) -> None:
        pass

    def finish(self) -> None:
        pass


@dataclass
class CoverageTally:
    """Prefetch coverage in replay: how often the real outcome was among the top-B predicted."""

    budgets: list[int]
    steps: int = 0
    ceiling_hits: int = 0
    hits: dict[int, int] = field(default_factory=dict)
    model_ns: list[int] = field(default_factory=list)        # outcome model: predicting (j, b)
    bookkeeping_ns: list[int] = field(default_factory=list)  # allocation and prefetch-cache bookkeeping
    lookup_ns: list[int] = field(default_factory=list)       # one next-draft lookup
    prefetch_ns: list[int] = field(default_factory=list)     # all lookups of one step at the main budget
    prefetch_hits: int = 0                                   # steps whose next draft came from the prefetch
    spent_ns: int = 0
    # The other design: prefetch only the match states after d_1..d_j for the j of the top-B
    # outcomes; then any b is one automaton step (plus the walk) from a ready state.
    from_context_ns: list[int] = field(default_factory=list)  # next draft from the old context (no prefetch)
    state_spent_ns: int = 0                                   # computing the states
    state_hits: int = 0                                       # steps whose j had its state ready
    state_hidden_ns: int = 0                                  # time those steps saved
    # The part of the gap that predicting j leaves: steps whose b is among the outcome model's
    # ``known_j_budget`` likeliest tokens at the true j (what that budget covers if j were known).
    known_j_budget: int = 0
    known_j_hits: int = 0

    @property
    def hidden_ns(self) -> float:
        """Lookup time the hits took off the critical path (hits x the median ordinary lookup)."""
        return self.prefetch_hits * statistics.median(self.lookup_ns) if self.lookup_ns else 0.0

    @property
    def design_hidden_per_spent(self) -> tuple[float | None, float | None]:
        """Critical-path time hidden per unit of prefetch CPU, for next-draft prefetch (each hit
        hides a whole next-draft lookup from the old context: the steps over the committed tokens
        and the walk) and for match-state prefetch (a ready state leaves one step and the walk)."""
        if not self.from_context_ns:
            return (None, None)
        drafts = self.prefetch_hits * statistics.median(self.from_context_ns) / self.spent_ns if self.spent_ns else None
        states = self.state_hidden_ns / self.state_spent_ns if self.state_spent_ns else None
        return (drafts, states)

    def value(self, budget: int) -> float:
        return self.hits.get(budget, 0) / self.steps if self.steps else 0.0

    def count_step(self, rank: int | None, ceiling: _BigramHistory, tokens: list[int]) -> None:
        """A step after which a next draft is needed: its outcome was the ``rank``-th predicted
        (None: not predicted), and the ceiling's question for its emitted token."""
        self.steps += 1
        for budget in self.budgets:
            if rank is not None and rank < budget:
                self.hits[budget] = self.hits.get(budget, 0) + 1
        context_last = tokens[-2] if len(tokens) > 1 else ceiling.last
        self.ceiling_hits += ceiling.seen(context_last, tokens[-1])

    @property
    def ceiling(self) -> float:
        return self.ceiling_hits / self.steps if self.steps else 0.0


class ReferenceMethod:
    """ngramrl through the pure-Python drafter object itself, with the analysis hooks the coverage
    and drafter-choice scripts read (the outcome model's own ranking, the two prefetch designs
    timed side by side, the likeliest b at the true j). The benchmark's ``ngramrl`` is
    ``NgramRLMethod``: the drafting core the engine runs."""

    name = "ngramrl"

    def __init__(self, history: HistoryConfig | None = None, drafter: DrafterConfig | None = None,
                 prefetch: PrefetchConfig | None = None, budgets: list[int] | None = None,
                 known_j_budget: int = 0) -> None:
        self.history = RolloutHistory(history)
        self.drafter = NgramDrafter(self.history, drafter)
        self.prefetch = prefetch or PrefetchConfig()
        self.calibration = AcceptanceCalibration(self.prefetch.prior_strength, self.prefetch.calibration_decay)
        self.request: RequestState | None = None
        self.last_draft: Draft | None = None
        self.tally = CoverageTally(sorted(set(budgets or [])), known_j_budget=known_j_budget)
        # time the replay spends measuring designs ngramrl does not run (not the method's work)
        self.measuring_ns = 0
        self._known_j: list[set[int]] = []
        self._sweep_allocation = PrefetchConfig(budget=max(self.tally.budgets or [0]), levels=self.prefetch.levels)
        self._ceiling = _BigramHistory()
        self._outcomes: list[Outcome] = []
        self._prefetched: dict[tuple[int, int], Draft] = {}
        self._outcome: tuple[int, int] | None = None
        self._remaining = 0
        self._k = 0
        self._settled: tuple[Draft | None, list[int], int] | None = None
        self._states: tuple[dict[int, list[MatchState]], list[MatchState]] | None = None

    def add_history(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            self.history.add_rollout(rollout.prompt_id, rollout.prompt, rollout.output, rollout.epoch)
        if self.tally.budgets:
            self._ceiling.add(rollouts)

    def start(self, rollout: Rollout) -> None:
        # A prompt no earlier epoch has drafts from its own output and the other prompts' rollouts,
        # as in an engine; ``finish`` leaves nothing of it behind.
        self.request = self.drafter.start(f"{rollout.prompt_id}/{rollout.epoch}/{rollout.sample}",
                                          rollout.prompt_id, rollout.prompt)
        self._remaining = len(rollout.output)
        self._outcome = None
        self._prefetched = {}
        self.last_draft = None  # the prefill's token verifies no draft: no outcome to score
        if self.tally.budgets:
            self._ceiling.start(rollout.prompt)

    def propose(self, k: int) -> list[int]:
        assert self.request is not None
        draft = self._prefetched.get(self._outcome) if self._prefetched else None
        if draft is None:
            begin = time.perf_counter_ns()
            draft = self.drafter.lookup(self.request, k)
            elapsed = time.perf_counter_ns() - begin
            if self.tally.budgets:
                self.tally.lookup_ns.append(elapsed)
        else:
            self.tally.prefetch_hits += 1
        self.drafter.absorb(self.request)
        self.last_draft = draft
        self._prefetched = {}
        self._k = k
        return draft.tokens

    def background(self) -> None:
        """While the target verifies the draft: what the prefetcher does (not counted as drafting)."""
        if self._settled is not None:
            self._learn(*self._settled)
            self._settled = None
        if self.tally.budgets and self.last_draft is not None:
            self._predict(self.last_draft, self._k)

    def _learn(self, draft: Draft | None, tokens: list[int], remaining: int) -> None:
        """Calibrate on the previous step's outcome and score its prediction."""
        accepted = len(tokens) - 1
        if draft is not None:
            self.calibration.observe_verified(draft, tokens)
        if not self.tally.budgets:
            return
        if draft is None:  # the prefill's token: no draft was verified with it, no outcome predicted
            self._ceiling.extend(tokens)
            return
        if remaining > 0 and self._states is not None and self._states[1] and self.request is not None:
            begin = time.perf_counter_ns()
            self._time_designs(tokens)
            self.measuring_ns += time.perf_counter_ns() - begin
        self._states = None
        if remaining > 0:  # the rollout goes on, so a next draft is needed
            rank = next((i for i, o in enumerate(self._outcomes) if o.key == (accepted, tokens[-1])), None)
            self.tally.count_step(rank, self._ceiling, tokens)
            if self.tally.known_j_budget:
                self.tally.known_j_hits += accepted < len(self._known_j) and tokens[-1] in self._known_j[accepted]
        self._ceiling.extend(tokens)

    def _predict(self, draft: Draft, k: int) -> None:
        """What the prefetcher would do while this draft is verified (measured, and the lookups
        at the main budget really run so their drafts are the next ones on a hit)."""
        begin = time.perf_counter_ns()
        sources = self.drafter.outcome_sources(self.request) if self.request is not None else []
        top = max(self.tally.budgets)
        predicted = predict_for(sources, draft, self.calibration, top, self.prefetch.levels)
        self.tally.model_ns.append(time.perf_counter_ns() - begin)
        begin = time.perf_counter_ns()
        self._outcomes = allocate({"r": predicted}, self._sweep_allocation)["r"]
        keys = [outcome.key for outcome in self._outcomes[:self.prefetch.budget]]
        self.tally.bookkeeping_ns.append(time.perf_counter_ns() - begin)
        begin = time.perf_counter_ns()
        for j, b in keys:
            self._prefetched[(j, b)] = self.drafter.lookup(self.request, k, draft.tokens[:j] + [b])
        spent = time.perf_counter_ns() - begin
        self.tally.prefetch_ns.append(spent)
        self.tally.spent_ns += spent
        begin = time.perf_counter_ns()
        self._prefetch_states(sources, draft, {j for j, _ in keys})
        if self.tally.known_j_budget:
            self._known_j = self._likeliest_b(sources, draft, self.tally.known_j_budget)
        self.measuring_ns += time.perf_counter_ns() - begin

    def _likeliest_b(self, sources: list, draft: Draft, budget: int) -> list[set[int]]:
        """For every j, the ``budget`` tokens the outcome model rates likeliest as b after
        d_1..d_j (its P(b | j))."""
        out = []
        at = list(sources)
        for j in range(len(draft.tokens) + 1):
            rejected = draft.tokens[j] if j < len(draft.tokens) else -1
            estimates = continuation_estimates(at, self.prefetch.levels, budget, rejected, 0)
            out.append({token for _, token in estimates})
            if j < len(draft.tokens):
                at = step_sources(at, draft.tokens[j])
        return out

    def _prefetch_states(self, sources: list, draft: Draft, accepted: set[int]) -> None:
        """The match-state design, measured beside the other: the states after d_1..d_j for the
        same j values, one pass over the draft per source."""
        begin = time.perf_counter_ns()
        states: dict[int, list[MatchState]] = {}
        if accepted:
            last = max(accepted)
            chains = []
            for index, match in sources:
                chain = [match]
                for token in draft.tokens[:last]:
                    chain.append(advance(index, chain[-1], [token]))
                chains.append(chain)
            states = {j: [chain[j] for chain in chains] for j in accepted}
        self.tally.state_spent_ns += time.perf_counter_ns() - begin
        self._states = (states, [match for _, match in sources])

    def _time_designs(self, tokens: list[int]) -> None:
        """The next draft from the old context over the committed tokens (what no prefetch does, and
        what a next-draft hit saves), against the same from a prefetched state when j had one."""
        states, context = self._states
        clock = time.perf_counter_ns
        begin = clock()
        self.drafter.lookup(self.request, self._k, tokens, at=(0, context))
        from_context = clock() - begin
        self.tally.from_context_ns.append(from_context)
        ready = states.get(len(tokens) - 1)
        if ready is not None:
            begin = clock()
            self.drafter.lookup(self.request, self._k, tokens, at=(len(tokens) - 1, ready))
            self.tally.state_hits += 1
            self.tally.state_hidden_ns += max(0, from_context - (clock() - begin))

    def commit(self, tokens: list[int]) -> None:
        assert self.request is not None
        self._outcome = (len(tokens) - 1, tokens[-1])
        self._remaining -= len(tokens)
        self._settled = (self.last_draft, tokens, self._remaining)
        self.drafter.commit(self.request, tokens)

    def finish(self) -> None:
        if self._settled is not None:
            self._learn(*self._settled)
            self._settled = None
        # Same-epoch rollouts must not see each other: drop this one; add_history adds the epoch later.
        assert self.request is not None
        self.drafter.finish(self.request, epoch=None)
        self.request = None


class NgramRLTreeMethod(ReferenceMethod):
    """ngramrl's draft trees: at most k tokens in at most ``width`` root-to-leaf paths, grown
    best-first by path probability (docs/drafter.md); a tree of k tokens costs what a chain of k
    tokens costs to verify. ``calibrated``: the path probabilities multiply the acceptance chances
    learned from the trees verified so far (by depth and estimate), else the raw estimates."""

    name = "ngramrl-tree"

    def __init__(self, history: HistoryConfig | None = None, drafter: DrafterConfig | None = None,
                 width: int = 4, calibrated: bool = True) -> None:
        super().__init__(history, drafter)
        if width < 1:
            raise ValueError(f"--tree-width must be >= 1, got {width}")
        self.width = width
        self.calibrated = calibrated
        self._tree: DraftTree | None = None

    def propose(self, k: int) -> DraftTree:  # type: ignore[override]
        assert self.request is not None
        tree = self.drafter.lookup_tree(self.request, k, self.width,
                                        chance=self.calibration.chance if self.calibrated else None)
        self.drafter.absorb(self.request)
        self.last_draft = None
        self._tree = tree
        return tree

    def commit(self, tokens: list[int]) -> None:
        """Every child of the nodes verification reached (the context, then each accepted node)
        says whether an estimate like its own was accepted at its depth."""
        tree = self._tree
        if tree is not None:
            accepted = tree.accept(tokens)
            for depth, parent in enumerate([ROOT_NODE, *accepted][:len(tokens)]):
                taken = accepted[depth] if depth < len(accepted) else ROOT_NODE
                for child in tree.children(parent):
                    self.calibration.observe_token(depth, tree.probs[child], child == taken)
            self._tree = None
        super().commit(tokens)

    def background(self) -> None:
        pass


class NgramRLMethod:
    """ngramrl as an engine runs it: the drafting core (native where built, else the Python
    reference), each rollout one row stepped as the proposer steps it (the step commits the
    tokens the last forward committed and drafts), its acceptance calibration learned by following
    every draft it makes. With a prefetch ``budget`` the core predicts the likeliest outcomes
    (j, b) of each draft while the target verifies it and looks up their next drafts; the replay
    waits for that work (the forward would) and scores the ranking against the real outcome at
    each of ``budgets``. ``native``: None picks the native core where built (``make_core``)."""

    name = "ngramrl"

    def __init__(self, history: HistoryConfig | None = None, drafter: DrafterConfig | None = None,
                 prefetch: PrefetchConfig | None = None, budgets: list[int] | None = None,
                 native: bool | None = None) -> None:
        self.prefetch = prefetch or PrefetchConfig()
        self.core = make_core(history, drafter, self.prefetch, follow=True, native=native)
        self.tally = CoverageTally(sorted(set(budgets or [])))
        self._ceiling = _BigramHistory()
        self._handle: int | None = None
        self._committed: list[int] = []
        self._draft: tuple[np.ndarray, np.ndarray] | None = None  # the last draft's tokens and estimates
        self._ranks: dict[tuple[int, int], int] = {}  # the prefetch's outcomes (j, b), likeliest first
        self._remaining = 0
        self._k = 0

    def add_history(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            self.core.add_rollout(rollout.prompt_id, rollout.prompt, rollout.output, rollout.epoch)
        if self.tally.budgets:
            self._ceiling.add(rollouts)

    def start(self, rollout: Rollout) -> None:
        # A prompt no earlier epoch has drafts from its own output and the other prompts' rollouts,
        # as in an engine; ``finish`` leaves nothing of it behind.
        self._handle = self.core.start(rollout.prompt_id, rollout.prompt, [], register=True)
        self._remaining = len(rollout.output)
        self._draft = None
        self._ranks = {}
        if self.tally.budgets:
            self._ceiling.start(rollout.prompt)

    def propose(self, k: int) -> list[int]:
        committed = self._committed
        made = self.core.step([self._handle], committed, [0, len(committed)], [k])
        self.tally.prefetch_hits += bool(made.prefetched[0])
        self._draft = (made.tokens, made.probs)
        self._k = k
        return made.tokens.tolist()

    def background(self) -> None:
        """While the target verifies the draft: the next drafts of its likeliest outcomes."""
        if not self.tally.budgets or self._draft is None:
            return
        tokens, probs = self._draft
        begin = time.perf_counter_ns()
        self.core.prefetch([self._handle], tokens, [0, len(tokens)], probs, self._k, absorb=[self._handle])
        outcomes = self.core.collect()
        self.tally.prefetch_ns.append(time.perf_counter_ns() - begin)
        self._ranks = {}
        for j, b in zip(outcomes.accepted.tolist(), outcomes.token.tolist(), strict=True):
            self._ranks.setdefault((j, b), len(self._ranks))

    def commit(self, tokens: list[int]) -> None:
        self._remaining -= len(tokens)
        if self._draft is not None and self.tally.budgets and self._remaining > 0:  # a next draft is needed
            self.tally.count_step(self._ranks.get((len(tokens) - 1, tokens[-1])), self._ceiling, tokens)
        if self.tally.budgets:
            self._ceiling.extend(tokens)
        self._committed = tokens

    def finish(self) -> None:
        # Same-epoch rollouts must not see each other: drop this one; add_history adds the epoch later.
        self.core.finish(self._handle)
        self._handle = None
        self._draft = None

    def coverage_report(self, budget: int) -> dict:
        """The contract's coverage object, extended with the steps it counts, how often the next
        draft really came from the prefetch, and the prefetch's costs: its wall time per step
        (the replay waits for it), and from the native core's own clocks the planning (outcome
        model and allocation) per row and one lookup, in the prefetch and in a step."""
        tally = self.tally
        report = {"budget": budget, "value": round(tally.value(budget), 4), "ceiling": round(tally.ceiling, 4),
                  "steps": tally.steps, "ready": round(tally.prefetch_hits / tally.steps, 4) if tally.steps else 0.0,
                  "prefetch_us_per_step": (round(statistics.median(tally.prefetch_ns) / 1000, 3)
                                           if tally.prefetch_ns else None)}
        if self.core.native:
            timings = self.core.timings()
            report.update(
                plan_us_per_row=round(timings["plan_ns"] / 1000 / max(1, timings["plan_rows"]), 3),
                prefetch_lookup_us=round(timings["prefetch_lookup_ns"] / 1000 / max(1, timings["prefetch_lookups"]), 3),
                step_lookup_us=round(timings["step_lookup_ns"] / 1000 / max(1, timings["step_lookups"]), 3))
        return report


# vLLM's defaults for its ``suffix`` method (SuffixDecoding)
SUFFIX_DEFAULTS = {"max_tree_depth": 24, "max_spec_factor": 1.0, "min_token_prob": 0.1}


class SuffixMethod:
    """SuffixDecoding through the real arctic-inference cache, with vLLM's ``suffix`` defaults."""

    name = "suffix"

    def __init__(self, max_tree_depth: int = SUFFIX_DEFAULTS["max_tree_depth"],
                 max_spec_factor: float = SUFFIX_DEFAULTS["max_spec_factor"],
                 min_token_prob: float = SUFFIX_DEFAULTS["min_token_prob"]) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise RuntimeError(
                "method 'suffix' needs arctic-inference (see README: install with the [suffix] extra)"
            ) from err
        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=-1)
        self.depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._next_id = 0
        self.request_id: int | None = None
        self.context: list[int] = []

    def add_history(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            rid = self._new_id()
            self.cache.start_request(rid, rollout.prompt)
            if rollout.output:
                self.cache.add_active_response(rid, rollout.output)
            self.cache.stop_request(rid)  # the response stays cached for later requests

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def start(self, rollout: Rollout) -> None:
        self.request_id = self._new_id()
        self.cache.start_request(self.request_id, rollout.prompt)
        self.context = list(rollout.prompt)

    def propose(self, k: int) -> list[int]:
        draft = self.cache.speculate(self.request_id, self.context[-self.depth:], max_spec_tokens=k,
                                     max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
        return list(draft.token_ids)

    def background(self) -> None:
        pass

    def commit(self, tokens: list[int]) -> None:
        self.context.extend(tokens)
        self.cache.add_active_response(self.request_id, tokens)

    def finish(self) -> None:
        # The replayed rollout must not be visible to rollouts of its own epoch: drop it from the cache.
        self.cache.stop_request(self.request_id)
        self.cache.evict_cached_response(self.request_id)
        self.request_id = None


def prompt_lookup(tokens: list[int], min_ngram: int, max_ngram: int, k: int) -> list[int]:
    """vLLM's n-gram proposer: the longest suffix n-gram (min..max) seen earlier in the context,
    ties going to its earliest occurrence, and the up to k tokens that followed it."""
    total = len(tokens)
    if total < min_ngram or k <= 0:
        return []
    reverse = tokens[::-1]
    # KMP prefix function of the reversed context, capped at max_ngram: prefix matches of the
    # reversed context are suffix matches of the context.
    lps = [0] * max_ngram
    longest, position, prev = 0, 0, 0
    i = 1
    while i < total:
        if reverse[prev] == reverse[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_ngram:
                lps[i] = prev
            if prev == max_ngram:
                prev = lps[max_ngram - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_ngram:
        return []
    start = total - 1 - position + longest
    return tokens[start:start + min(k, total - start)]


class PromptLookupMethod:
    name = "pld"

    def __init__(self, min_ngram: int = 2, max_ngram: int = 5) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.context: list[int] = []

    def add_history(self, rollouts: list[Rollout]) -> None:
        pass  # prompt lookup only reads the request's own context

    def start(self, rollout: Rollout) -> None:
        self.context = list(rollout.prompt)

    def propose(self, k: int) -> list[int]:
        return prompt_lookup(self.context, self.min_ngram, self.max_ngram, k)

    def background(self) -> None:
        pass

    def commit(self, tokens: list[int]) -> None:
        self.context.extend(tokens)

    def finish(self) -> None:
        pass


class OracleMethod:
    """Ceiling, not a drafter: the longest run of the true next tokens that follows any allowed
    position whose token equals the context's last token (earlier epochs' rollouts with their
    prompts, the request's own prompt and output; a copy from its own context may overlap the
    tokens it predicts, as a repeating loop does)."""

    name = "oracle"

    def __init__(self) -> None:
        self.index = SuffixAutomaton()
        self.truth: list[int] = []
        self.context: list[int] = []
        self.positions: dict[int, list[int]] = {}
        self.done = 0

    def add_history(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            self.index.add_sequence(rollout.prompt + rollout.output)

    def start(self, rollout: Rollout) -> None:
        self.truth = rollout.output
        self.context = list(rollout.prompt)
        self.positions = {}
        for pos, token in enumerate(self.context):
            self.positions.setdefault(token, []).append(pos)
        self.done = 0

    def _history_run(self, last: int, future: list[int]) -> int:
        """Walk the automaton along (last, future...) while the string stays a substring."""
        child = self.index.child
        state = child(0, last)
        run = 0
        if state >= 0:
            for token in future:
                state = child(state, token)
                if state < 0:
                    break
                run += 1
        return run

    def propose(self, k: int) -> list[int]:
        future = self.truth[self.done:self.done + k]
        if not self.context:  # an empty prompt: no state to continue from
            return []
        last = self.context[-1]
        best = self._history_run(last, future)
        # Own context, overlapping copies allowed: ext = context + future.
        if best < len(future):
            context = self.context
            n = len(context)
            for p in self.positions.get(last, ()):
                if p == n - 1:
                    continue
                length = 0
                while length < len(future):
                    src = p + 1 + length
                    token = context[src] if src < n else future[src - n]
                    if token != future[length]:
                        break
                    length += 1
                if length > best:
                    best = length
                    if best == len(future):
                        break
        return future[:best]

    def background(self) -> None:
        pass

    def commit(self, tokens: list[int]) -> None:
        for token in tokens:
            self.positions.setdefault(token, []).append(len(self.context))
            self.context.append(token)
        self.done += len(tokens)

    def finish(self) -> None:
        pass


class PromptOracleMethod(OracleMethod):
    """A tighter ceiling for history drafting: the best continuation copied after a one-token match
    in the same prompt's earlier rollouts only (no other prompts, no own context)."""

    name = "oracle-prompt"

    def __init__(self) -> None:
        super().__init__()
        self.per_prompt: dict[str, SuffixAutomaton] = {}

    def add_history(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            self.per_prompt.setdefault(rollout.prompt_id, SuffixAutomaton()).add_sequence(rollout.output)

    def start(self, rollout: Rollout) -> None:
        super().start(rollout)
        self.index = self.per_prompt.get(rollout.prompt_id) or SuffixAutomaton()

    def propose(self, k: int) -> list[int]:
        future = self.truth[self.done:self.done + k]
        if not self.context:
            return []
        return future[:self._history_run(self.context[-1], future)]


METHOD_NAMES = ("ngramrl", "ngramrl-tree", "suffix", "pld", "none", "oracle", "oracle-prompt")


def make_method(name: str, drafter: DrafterConfig | None = None, history: HistoryConfig | None = None,
                prefetch: PrefetchConfig | None = None, budgets: list[int] | None = None,
                tree_width: int = 4) -> ReplayMethod:
    if name == "ngramrl":
        return NgramRLMethod(history, drafter, prefetch, budgets)
    if name == "ngramrl-tree":
        return NgramRLTreeMethod(history, drafter, tree_width)
    if name == "suffix":
        return SuffixMethod()
    if name == "pld":
        return PromptLookupMethod()
    if name == "none":
        return NoDraft()
    if name == "oracle":
        return OracleMethod()
    if name == "oracle-prompt":
        return PromptOracleMethod()
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHOD_NAMES)}")
