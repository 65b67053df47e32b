"""Continuation estimates: how likely each token is to follow a context, from the history's counts.

One estimator serves drafting (which path to propose, how far), draft trees (which branches to add)
and the prefetcher's outcome model (which correction the target emits after a rejection): all three
ask the same question of the same evidence, so they share this function.

The evidence is a list of sources, each an index (a suffix automaton) and the context's match
state in it: the prompt's own index first (its rollouts, siblings in flight, the request's own
prompt and output), then the cross-prompt index (other prompts' rollouts). Within a source the
estimate interpolates the suffix levels of the context, longest first (Witten-Bell: a level whose
occurrences were followed ``followed`` times by ``distinct`` different tokens gives token t the
share count(t) / (followed + distinct) of the mass it receives and passes the rest, distinct /
(followed + distinct), to the next shorter level); the mass left after a source's levels goes to
the next source. So a long match of a rare context decides when it is consistent, shorter and more
frequent contexts decide when it is not, and other prompts' rollouts fill in what this prompt's
history has never seen. Nothing here depends on the order requests arrive in or on any state
outside the indexes: the estimate is a pure function of the indexes and the match states.
"""

from __future__ import annotations

from dataclasses import dataclass

from ngramrl.core.automaton import ROOT, SuffixAutomaton


@dataclass
class MatchState:
    """Where a context stands in one index: a state and the length of the suffix it matches."""

    state: int = ROOT
    matched: int = 0


Source = tuple[SuffixAutomaton, MatchState]  # an index and the context's match state in it


def advance(index: SuffixAutomaton, match: MatchState, tokens: list[int]) -> MatchState:
    state, matched = match.state, match.matched
    step = index.step
    for token in tokens:
        state, matched = step(state, matched, token)
    return MatchState(state, matched)


def step_sources(sources: list[Source], token: int) -> list[Source]:
    """The sources' match states after one more context token."""
    return [(index, MatchState(*index.step(match.state, match.matched, token))) for index, match in sources]


def continuation_estimates(sources: list[Source], levels: int, limit: int, exclude: int = -1,
                           min_length: int = 0, floor: float = 0.0) -> list[tuple[float, int]]:
    """Up to ``limit`` likeliest next tokens (other than ``exclude``) as (probability, token), most
    likely first.

    The levels read are, per source in order, the first ``levels`` suffix levels of the context
    that were followed by something and are at least ``min_length`` tokens long (0 lets the empty
    context in: the source's whole vocabulary), longest first; they are interpolated by
    Witten-Bell as the module says. ``exclude`` (a token known not to follow, such as a rejected
    draft token) is conditioned out: at every level its count leaves ``followed``, which
    renormalises the level's estimate given that the token is not ``exclude``. The walk stops
    early once the mass still to hand out is at most ``floor`` (nothing below it can enter).

    Candidates are the ``limit`` most frequent continuations of each level read (``level_top``),
    and each candidate's probability is exact: the sum over every level read of the mass it
    reached that level with, times the candidate's count there over the level's normaliser. A
    token in no level's top is not proposed. Ties between candidates of equal probability go to
    the one met first (a longer level before a shorter one, a level's ranking within it), so the
    newest of equally frequent continuations of the longest context wins, as in the index."""
    # Per level read: its children (None: one child, ``single``), the counts, and its mass per count.
    read: list[tuple[dict[int, int] | None, tuple[int, int], list[int], float]] = []
    candidates: dict[int, None] = {}
    mass = 1.0
    for index, match in sources:
        if match.matched < min_length:
            continue
        link, length, followed, count, nxt, best_token, best_state = (
            index.link, index.length, index.followed, index.count, index.next, index.best_token, index.best_state)
        state = match.state
        used = 0
        while used < levels and mass > floor and length[state] >= min_length:
            children = nxt[state]
            best = best_token[state]
            distinct = (best >= 0) if children is None else len(children)
            if distinct:
                used += 1
                norm = followed[state] + distinct
                if exclude >= 0:
                    rejected = index.child(state, exclude)
                    if rejected >= 0:  # the level's estimate given "not exclude"
                        norm -= count[rejected]
                read.append((children, (best, best_state[state]), count, mass / norm))
                if limit == 1 and best != exclude:  # level_top, inlined for the chain's walk
                    candidates[best] = None
                else:
                    for token, _ in level_top(index, state, limit, exclude):
                        candidates[token] = None
                mass *= distinct / norm
            if state == ROOT:
                break
            state = link[state]
    estimates = []
    for token in candidates:
        p = 0.0
        for children, (single, single_state), count, scale in read:
            child = (single_state if single == token else -1) if children is None else children.get(token, -1)
            if child >= 0:
                p += scale * count[child]
        # The levels' shares sum to at most 1, but their floating-point sum can pass it by an ulp
        # (a long repetitive context, every level saying the same token): an estimate is a probability.
        estimates.append((min(p, 1.0), token))
    if limit == 1:  # the same as the sort below, in one pass: the first of the largest wins
        top, top_p = -1, floor
        for p, token in estimates:
            if p > top_p:
                top, top_p = token, p
        return [(top_p, top)] if top >= 0 else []
    ranked = sorted(((p, order, t) for order, (p, t) in enumerate(estimates) if p > floor),
                    key=lambda item: (-item[0], item[1]))
    return [(p, t) for p, _, t in ranked[:limit]]


def level_top(index: SuffixAutomaton, state: int, limit: int, exclude: int = -1) -> list[tuple[int, int]]:
    """The ``limit`` most frequent continuations (token, count) of ``state`` other than
    ``exclude``, in the ranking of ``SuffixAutomaton.continuations`` (count, then the state's best
    continuation, then token id). The best continuation alone is read in O(1)."""
    best = index.best_token[state]
    if limit == 1 and best != exclude and best >= 0:
        return [(best, index.count[index.best_state[state]])]
    return [(token, seen) for token, seen in index.continuations(state)[:limit + 1] if token != exclude][:limit]


__all__ = ["MatchState", "Source", "advance", "continuation_estimates", "level_top", "step_sources"]
