"""Predicting verification outcomes, and spending a prefetch budget on the likeliest.

An outcome of verifying draft d_1..d_k is (j, b): j accepted tokens, then the token b the target
emits (a correction, never d_{j+1}, when j < k; the bonus token when j = k).

- P(j) comes from per-position acceptance chances: the drafter's own estimate for each drafted
  token, calibrated by what was observed so far (``AcceptanceCalibration``). Calibration is
  causal: it only learns from outcomes that already happened.
- P(b | j) is the drafter's own continuation estimate (``continuation_estimates``) after the
  context plus d_1..d_j, given that d_{j+1} did not follow (it was rejected): the same evidence
  the draft and its tree alternatives come from, read down to the empty context. The outcomes are
  the branches a draft tree would grow off the sent path, scored with calibrated chances.
- ``allocate`` spends a budget of next-draft lookups on the most probable outcomes, per request
  and optionally across a batch, so a confident request gets few candidates and an uncertain one
  many. Outcomes are disjoint events, so the top-B set maximises the chance of a hit.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ngramrl.config import PrefetchConfig
from ngramrl.core.drafter import Draft
from ngramrl.core.estimate import MatchState, Source, continuation_estimates


@dataclass(frozen=True, order=True)
class Outcome:
    probability: float
    accepted: int  # j
    token: int     # b

    @property
    def key(self) -> tuple[int, int]:
        return (self.accepted, self.token)


def _position_bucket(position: int) -> int:
    return position if position < 4 else 4 if position < 8 else 5


class AcceptanceCalibration:
    """Running acceptance rate per (draft position bucket, estimate decile), with the drafter's
    estimate as the prior; one instance per workload (or per prompt) as the caller chooses."""

    def __init__(self, prior_strength: float = 4.0, decay: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"AcceptanceCalibration decay must be in (0, 1], got {decay}")
        self.prior_strength = prior_strength
        self.decay = decay  # per observation of a cell: acceptance drifts as the history warms and the policy moves
        self._table: dict[tuple[int, int], list[float]] = {}

    def state(self) -> list[list[float]]:
        """The table as plain data: [position bucket, estimate decile, accepted, trials] per cell."""
        return [[*cell, *counts] for cell, counts in self._table.items()]

    def load_state(self, state: list[list[float]]) -> None:
        self._table = {(int(bucket), int(decile)): [float(accepted), float(trials)]
                       for bucket, decile, accepted, trials in state}

    def chance(self, position: int, estimate: float) -> float:
        cell = self._table.get((_position_bucket(position), min(9, int(estimate * 10))))
        if cell is None:
            return estimate
        accepted, trials = cell
        return (accepted + self.prior_strength * estimate) / (trials + self.prior_strength)

    def chances(self, probs: list[float]) -> list[float]:
        """Calibrated acceptance chance of each token of a draft, from its estimates."""
        return [self.chance(position, estimate) for position, estimate in enumerate(probs)]

    def observe_verified(self, draft: Draft, committed: list[int]) -> None:
        """The target verified ``draft`` and committed ``committed`` (accepted draft tokens, then one
        of its own): learn from it. Tokens that do not continue the draft say nothing about it."""
        accepted = len(committed) - 1
        if accepted >= 0 and accepted <= len(draft.tokens) and committed[:accepted] == draft.tokens[:accepted]:
            self.observe(draft.probs, accepted)

    def observe(self, probs: list[float], accepted: int) -> None:
        """Learn from one verified draft: positions < accepted were accepted, position accepted was not."""
        for position, estimate in enumerate(probs[:accepted + 1]):
            self.observe_token(position, estimate, position < accepted)

    def observe_token(self, position: int, estimate: float, accepted: bool) -> None:
        """Learn from one draft token whose path up to it was accepted: was it accepted too."""
        cell = self._table.setdefault((_position_bucket(position), min(9, int(estimate * 10))), [0.0, 0.0])
        cell[0] = self.decay * cell[0] + accepted
        cell[1] = self.decay * cell[1] + 1


class DraftFollower:
    """Calibrates acceptance from every draft, verified or not, by following the committed tokens.

    With a drafter that proposes one token for sure (q is a point mass), speculative sampling
    accepts draft token d_i with chance p(d_i): exactly the chance that the target, sampling on
    its own, emits d_i there (and after a rejection it emits something else). So comparing a draft
    with the tokens committed after it (in this step, and in the next ones while they keep
    matching) draws its number of accepted tokens from the same distribution as verifying it would.
    That lets the calibration keep learning while the cost model verifies little or nothing (large
    batches, compute-bound verification), with no exploration. One draft per request is followed
    at a time."""

    def __init__(self, calibration: AcceptanceCalibration) -> None:
        self.calibration = calibration
        self._open: dict[str, tuple[Draft, int]] = {}
        # Drafts followed to their end (an empty one ends at once) and their accepted tokens: each
        # stands for one forward that verifies it whole, so 1 + accepted / resolved is the tokens a
        # decode forward would commit with whole drafts.
        self.resolved = 0
        self.accepted = 0

    def offer(self, key: str, draft: Draft) -> None:
        """``draft`` was made for request ``key`` (whatever part of it is verified)."""
        if key in self._open:
            return
        if draft.tokens:
            self._open[key] = (draft, 0)
        else:  # nothing to verify: its forward commits the target's token alone
            self.resolved += 1

    def committed(self, key: str, tokens: list[int]) -> None:
        """Request ``key`` committed ``tokens`` (what its last forward produced)."""
        followed = self._open.get(key)
        if followed is None:
            return
        draft, matched = followed
        for token in tokens:
            if token != draft.tokens[matched]:
                break
            matched += 1
            if matched == len(draft.tokens):
                break
        else:
            self._open[key] = (draft, matched)  # every committed token matched: keep following
            return
        del self._open[key]
        self.calibration.observe(draft.probs, matched)
        self.resolved += 1
        self.accepted += matched

    def drop(self, key: str) -> None:
        self._open.pop(key, None)


class Survival(Sequence[float]):
    """The chance that a draft's tokens 0..i are all accepted, for each i, computed only as far as
    it is read (deciding draft lengths for a large batch mostly reads the first token of each),
    and scaled by ``scale``."""

    def __init__(self, probs: list[float], calibration: AcceptanceCalibration, scale: float = 1.0) -> None:
        self._probs = probs
        self._calibration = calibration
        self._values: list[float] = []
        self._running = scale

    def __len__(self) -> int:
        return len(self._probs)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        while len(self._values) <= i:
            position = len(self._values)
            self._running *= self._calibration.chance(position, self._probs[position])
            self._values.append(self._running)
        return self._values[i]


def accepted_length_distribution(chances: list[float]) -> list[float]:
    """P(j) for j = 0..k from per-position acceptance chances."""
    out = []
    survive = 1.0
    for chance in chances:
        out.append(survive * (1.0 - chance))
        survive *= chance
    out.append(survive)
    return out


def predict_outcomes(sources: list[Source], draft: Draft, chances: list[float], limit: int,
                     levels: int = 3, floor: float = 0.0) -> list[Outcome]:
    """The ``limit`` most probable outcomes (j, b) of verifying ``draft`` from the context's match
    states in ``sources`` (the prompt's index first), most probable first; with a ``floor``, only
    those likelier than it (the estimates then read no suffix level that could only add outcomes
    below it, as they do below the ``limit``-th)."""
    if limit <= 0 or not sources:
        return []
    tokens = draft.tokens
    # Match states after tokens[:j] in each source, extended as needed: the "match state for each
    # likely j" that makes any b one automaton step away.
    chains = [(index, [(match.state, match.matched)]) for index, match in sources]
    k = len(tokens)
    p_accepted = accepted_length_distribution(chances)
    best: list[tuple[float, int, int]] = []  # min-heap of the current top ``limit`` (p, j, b)
    push, replace = heapq.heappush, heapq.heapreplace
    for j in sorted(range(k + 1), key=p_accepted.__getitem__, reverse=True):
        pj = p_accepted[j]
        if (len(best) == limit and pj <= best[0][0]) or (floor > 0.0 and pj <= floor):
            break  # P(b | j) <= 1: no later j can enter the top set or pass the floor
        at_j = []
        for index, chain in chains:
            while len(chain) <= j:
                chain.append(index.step(*chain[-1], tokens[len(chain) - 1]))
            at_j.append((index, MatchState(*chain[j])))
        bar = max(best[0][0] if len(best) == limit else 0.0, floor)
        for p_token, token in continuation_estimates(at_j, levels, limit, tokens[j] if j < k else -1, 0,
                                                     bar / pj if bar > 0.0 else 0.0):
            p = pj * p_token
            if len(best) < limit:
                push(best, (p, j, token))
            elif p > best[0][0]:
                replace(best, (p, j, token))
            else:
                break  # tokens come most likely first
    best.sort(reverse=True)
    return [Outcome(p, j, b) for p, j, b in best]


def predict_for(sources: list[Source], draft: Draft, calibration: AcceptanceCalibration, limit: int,
                levels: int, floor: float = 0.0) -> list[Outcome]:
    """``predict_outcomes`` with the acceptance chances calibrated from what was observed so far."""
    return predict_outcomes(sources, draft, calibration.chances(draft.probs), limit, levels, floor)


SHARE_CAP = 2  # with a shared budget, one request gets at most this many times its share


def allocation(config: PrefetchConfig) -> tuple[int, bool]:
    """What a prefetch may spend: the most outcomes one request gets (how many the outcome model
    enumerates for it), and whether the batch's total is ``budget`` x its planned requests. With
    ``share_budget`` (and no ``global_budget``) the likeliest outcomes across the batch get the
    lookups, so a confident request leaves its share to uncertain ones, each up to ``SHARE_CAP``
    shares; otherwise ``budget`` each, and ``global_budget`` overall if given."""
    shared = config.share_budget and config.global_budget is None
    return (SHARE_CAP * config.budget if shared else config.budget), shared


@dataclass(frozen=True)
class PrefetchSpan:
    """One background prefetch, as the next step's cancelling stop found it: the outcomes it chose
    (-1: the stop came during its planning), how many it looked up, the seconds from its call to the
    end of its work, and from its call to the stop (the forward's length, and the host's work)."""

    chosen: int
    done: int
    work_s: float
    window_s: float


GROW_SHARE = 3 / 4    # a grown budget's work is aimed at this share of the window the last one had
GROW_STEP = 5 / 4     # the least growth worth a change (and at most it doubles)
SHRINK_SHARE = 1 / 3  # a prefetch cancelled before this share of its lookups halves the budget


def next_budget(budget: int, config: PrefetchConfig, span: PrefetchSpan) -> int:
    """The per-request budget for the next prefetch, between ``config.budget`` and
    ``config.max_budget``. Where the last prefetch finished everything it chose, the budget grows
    by the room its window left, so that the same work per outcome would fill three quarters of
    that window (at most twice the budget, and only where that is at least a quarter more); half
    where the stop cut it before a third of its lookups (or in its planning); else the same.
    Lookups run likeliest first, so a budget that the forward cuts short still gets the likeliest
    ones; what a too large budget wastes is the planning of outcomes never looked up. A grown
    budget aims inside the window it grew from, and one halved after less than a third done does
    not grow back until its prefetch finishes (hysteresis, not oscillation)."""
    ceiling = max(config.budget, config.max_budget)
    if span.chosen > 0 and span.done == span.chosen:
        room = 2.0 if span.work_s <= 0 else GROW_SHARE * span.window_s / span.work_s
        if room < GROW_STEP:
            return budget
        return min(ceiling, max(budget + 1, int(budget * min(2.0, room))))
    if span.chosen < 0 or span.done < SHRINK_SHARE * span.chosen:
        return max(config.budget, budget // 2)
    return budget


def allocate(candidates: dict[str, list[Outcome]], config: PrefetchConfig) -> dict[str, list[Outcome]]:
    """Choose outcomes to prefetch: at most ``budget`` per request and ``global_budget`` overall,
    never below ``min_probability``, likeliest first across the batch; with a shared budget
    (``allocation``), ``budget`` x the requests overall, at most ``SHARE_CAP`` x ``budget`` each."""
    limit, _ = allocation(config)
    per_request = {
        rid: [o for o in outcomes[:limit] if o.probability >= config.min_probability and o.probability > 0]
        for rid, outcomes in candidates.items()
    }
    total = budget_total(config, len(candidates))
    if total is None:
        return per_request
    pool = heapq.nlargest(total,
                          ((o.probability, rid, i) for rid, outs in per_request.items() for i, o in enumerate(outs)))
    chosen: dict[str, list[Outcome]] = {rid: [] for rid in per_request}
    for _, rid, i in sorted(pool, key=lambda x: (x[1], x[2])):
        chosen[rid].append(per_request[rid][i])
    return chosen


def plan_outcomes(sent: dict[Hashable, tuple[list[Source], Draft]], calibration: AcceptanceCalibration,
                  config: PrefetchConfig, last_cut: float) -> tuple[dict[Hashable, list[Outcome]], float]:
    """The prefetch's plan for drafts just sent for verification (per request: its match states in
    ``sources`` and its draft): each request's likeliest outcomes above ``config.plan_floor`` x
    ``last_cut``, then ``allocate`` across the batch; and this plan's ``budget_cut``. Every
    prefetcher plans with this (the native core as its reference does)."""
    limit, _ = allocation(config)  # the outcomes enumerated per request
    floor = config.plan_floor * last_cut
    candidates = {key: predict_for(sources, draft, calibration, limit, config.levels, floor)
                  for key, (sources, draft) in sent.items()}
    chosen = allocate(candidates, config)
    return chosen, budget_cut(chosen, budget_total(config, len(candidates)))


def budget_total(config: PrefetchConfig, requests: int) -> int | None:
    """The batch's total of lookups for ``requests`` planned requests (``allocate``), or None."""
    _, shared = allocation(config)
    return config.budget * requests if shared else config.global_budget


def budget_cut(chosen: dict[str, list[Outcome]], total: int | None) -> float:
    """The probability of the least likely outcome ``allocate`` chose where the batch's ``total``
    was spent in full, else 0. A batch's cut moves little from one prefetch to the next, so the
    next one enumerates only outcomes above ``PrefetchConfig.plan_floor`` times it (a cut that
    falls below that floor leaves part of the budget unspent once, and no floor the time after)."""
    probabilities = [o.probability for outcomes in chosen.values() for o in outcomes]
    return min(probabilities) if total and len(probabilities) >= total else 0.0
