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

    Per source, in order: the first ``levels`` suffix levels of the context that were followed by
    something and are at least ``min_length`` tokens long (0 lets the empty context in: the
    source's whole vocabulary), longest first, interpolated by Witten-Bell as the module says.
    ``exclude`` (a token known not to follow, such as a rejected draft token) is conditioned out:
    at every level its count leaves ``followed``, which renormalises the level's estimate given
    that the token is not ``exclude``. A level contributes its
    ``limit + 1`` most frequent continuations (the ranking of ``SuffixAutomaton.continuations``),
    so one more than the caller reads survives the exclusion. Once the mass still to hand out is
    at most ``floor`` nothing further can enter and the walk stops.

    Ties between tokens of equal probability go to the token that received mass first (a longer
    level before a shorter one, a level's ranking within it), so the newest of equally frequent
    continuations of the longest context wins, as in the index itself."""
    probs: dict[int, float] = {}
    mass = 1.0
    for index, match in sources:
        link, length, followed, continuations = index.link, index.length, index.followed, index.continuations
        state = match.state
        if match.matched < min_length:
            continue
        used = 0
        while used < levels and mass > floor and length[state] >= min_length:
            ranked = continuations(state)
            if ranked:
                used += 1
                norm = followed[state] + len(ranked)
                for token, count in ranked:
                    if token == exclude:  # the level's estimate given "not exclude"
                        norm -= count
                        break
                scale = mass / norm
                for token, count in ranked[:limit + 1]:
                    if token != exclude:
                        probs[token] = probs.get(token, 0.0) + scale * count
                mass *= len(ranked) / norm
            if state == ROOT:
                break
            state = link[state]
    ranked_out = sorted(((p, order, t) for order, (t, p) in enumerate(probs.items()) if p > floor),
                        key=lambda item: (-item[0], item[1]))
    return [(p, t) for p, _, t in ranked_out[:limit]]


__all__ = ["MatchState", "Source", "advance", "continuation_estimates", "step_sources"]
